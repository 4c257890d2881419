"""A checkpoint's tensors under the names the family table reads, whichever form its
expert weights are stored in.

The hub stores a mixture of experts' weights one tensor per expert and projection
(`mlp.experts.3.gate_proj.weight`), as transformers' save_pretrained writes them;
transformers 5 holds them fused, one 3-D tensor per layer and projection kind
(`mlp.experts.gate_up_proj` [experts, 2 inter, hidden], gate then up), and a
state_dict of its model (or a file saved from one) has those. `per_expert` shows
the second form as the first: each expert's part is a slice of the fused tensor,
read when asked for. So loading, the fingerprint and a weight update's checks see
one set of names, and a model has one fingerprint whichever form it came in.
"""
from __future__ import annotations

from collections.abc import Mapping

from gateeng.config import ModelConfig
from gateeng.model import families


class _PerExpert(Mapping):
    def __init__(self, tensors: Mapping, aliases: dict):
        self._tensors = tensors
        # per-part name -> (fused name, its shape, expert or None, first row, rows)
        self._aliases = aliases
        fused = {a[0] for a in aliases.values()}
        self._names = [n for n in tensors if n not in fused] + list(aliases)
        self._known = set(self._names)
        self._last = (None, None)   # the fused tensor read last: its experts are read one after another

    def __contains__(self, name) -> bool:
        return name in self._known

    def __getitem__(self, name: str):
        if name not in self._known:
            raise KeyError(name)
        if name not in self._aliases:
            return self._tensors[name]
        fused, shape, expert, start, rows = self._aliases[name]
        if self._last[0] != fused:
            t = self._tensors[fused]
            if tuple(t.shape) != shape:
                raise ValueError(f"tensor {fused} has shape {tuple(t.shape)}, expected {shape}")
            self._last = (fused, t)
        t = self._last[1] if expert is None else self._last[1][expert]
        return t[start:start + rows]

    def __iter__(self):
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def fused_parts(names, cfg: ModelConfig) -> dict:
    """{per-part name: (its fused tensor's name, that tensor's shape, the expert or
    None, the part's first row, its rows)} for every expert weight that `names` (a
    checkpoint's tensor names) holds fused; empty for a dense model or one stored per
    expert. A tensor named in both forms is refused (ValueError naming it)."""
    if cfg.moe is None:
        return {}
    block = families.of(cfg).block
    aliases = {}
    for i in cfg.moe.sparse_layers:
        pre = f"{block.hf_layers}{i}."
        for w in block.weights(cfg, i):
            if not w.fused or pre + w.fused not in names:
                continue
            parts = w.parts(cfg)
            starts = [sum(parts[:p]) for p in range(len(parts))]
            whole = (sum(parts), families.dims(cfg)[w.cols])
            shape = (cfg.moe.num_experts,) + whole if w.experts else whole
            for expert in range(cfg.moe.num_experts) if w.experts else (None,):
                for name, start, rows in zip(w.names(expert), starts, w.parts(cfg)):
                    if pre + name in names:
                        raise ValueError(f"the checkpoint holds {pre + name} both on its own and in "
                                         f"{pre + w.fused}")
                    aliases[pre + name] = (pre + w.fused, shape, expert, start, rows)
    return aliases


def per_expert(tensors: Mapping, cfg: ModelConfig) -> Mapping:
    """`tensors` (name -> tensor) with every fused expert tensor shown as its per-expert
    parts (the module doc); `tensors` itself for a dense model or one stored per
    expert. A tensor named in both forms is refused (ValueError naming it)."""
    if isinstance(tensors, _PerExpert):
        return tensors
    aliases = fused_parts(tensors, cfg)
    return _PerExpert(tensors, aliases) if aliases else tensors
