"""Llama-family decoder (the families of gateeng.model.families) over a paged KV cache.

One model definition. How each reduction is computed (matmul, RMSNorm, attention)
is chosen by the plan object passed to `forward`, so the fast and invariant plans
share every weight and every elementwise step.

A mixture of experts' routing layer (families.layer_kind MOE) holds, instead of
gate_up and down, `router` [experts, hidden] and `experts`, a ModuleList whose j-th
module holds expert j's `gate_up` [2 expert_inter, hidden] (gate, up stacked) and
`down` [hidden, expert_inter]: each expert a plain MLP, so each is a projection the
plans pack and multiply like any other. `_moe` says what the layer computes; the
plan says how (router_logits, route, combine; kernels/SPEC.md, "Mixture of experts"),
or computes the same layer in one call (moe_layer: the CPU plans' C++ routing layers).
A plan may also run every layer of a forward in one call (decode_layers: the fast
plan's decode steps and every pass of the CPU reference), the same ops in the same order.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from gateeng.config import QK_NORM_HEAD, ModelConfig
from gateeng.model import families, rope
from gateeng.model.experts import per_expert


class KVCache:
    """Per layer, K and V as [num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype, device):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size = block_size

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: "KVSlots") -> None:
        """Store the rows' K and V at their slots (padding rows store nothing)."""
        nb, bs = self.k.shape[1], self.k.shape[2]
        writers, real = slots.writers()
        if writers is not None:
            k, v = k.index_select(0, writers), v.index_select(0, writers)
        self.k[layer].view(nb * bs, *self.k.shape[3:]).index_copy_(0, real, k)
        self.v[layer].view(nb * bs, *self.v.shape[3:]).index_copy_(0, real, v)


class KVSlots:
    """One forward's cache slot per row; padding rows carry -1 and store nothing."""

    def __init__(self, slots: torch.Tensor):
        self.all = slots
        self._writers = None

    def writers(self):
        """(indices of the rows that store KV, their slots), or (None, all slots) when
        every row does; decided once per forward."""
        if self._writers is None:
            keep = self.all >= 0
            if bool(keep.all()):
                self._writers = (None, self.all)
            else:
                rows = keep.nonzero().view(-1)
                self._writers = (rows, self.all.index_select(0, rows))
        return self._writers


@dataclass(frozen=True)
class LayerWeights:
    """One decoder layer's weights, as the forward reads them (LlamaModel.step_layers)."""
    qkv: torch.Tensor
    qkv_bias: Optional[torch.Tensor]
    q_norm: Optional[torch.Tensor]
    k_norm: Optional[torch.Tensor]
    o: torch.Tensor
    o_bias: Optional[torch.Tensor]
    post_norm: torch.Tensor
    gate_up: Optional[torch.Tensor]   # a plain-MLP layer's (None in a routing layer)
    down: Optional[torch.Tensor]
    router: Optional[torch.Tensor]    # a routing layer's (None in a plain-MLP layer)
    experts: Optional[tuple]          # a routing layer's ((gate_up, down) of expert 0, 1, ...)
    next_norm: torch.Tensor   # the norm after this layer's MLP


class LlamaModel(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, dtype=torch.bfloat16, device="cpu"):
        super().__init__()
        self.cfg = cfg
        self.tp = None   # a tensor-parallel shard's row-parallel sums (model.shard.RowParallel)
        h, d = cfg.hidden_size, cfg.head_dim
        qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * d

        def p(*shape):
            return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)

        self.embed = p(cfg.vocab_size, h)

        def mlp(module, inter):
            module.gate_up = p(2 * inter, h)   # gate, up stacked
            module.down = p(h, inter)
            return module

        whole = cfg.qk_norm_scope != QK_NORM_HEAD   # q/k norms over the whole projection (OLMoE)
        self.layers = torch.nn.ModuleList()
        for i in range(cfg.num_layers):
            layer = torch.nn.Module()
            layer.input_norm = p(h)
            layer.qkv = p(qkv, h)                         # q, k, v stacked
            layer.qkv_bias = p(qkv) if cfg.qkv_bias else None
            layer.o = p(h, cfg.num_heads * d)
            layer.o_bias = p(h) if cfg.o_bias else None
            layer.q_norm = p(cfg.num_heads * d if whole else d) if cfg.qk_norm else None
            layer.k_norm = p(cfg.num_kv_heads * d if whole else d) if cfg.qk_norm else None
            layer.post_norm = p(h)
            if families.layer_kind(cfg, i) == families.MOE:
                layer.gate_up = layer.down = None
                layer.router = p(cfg.moe.num_experts, h)
                layer.experts = torch.nn.ModuleList(mlp(torch.nn.Module(), cfg.moe.intermediate_size)
                                                    for _ in range(cfg.moe.num_experts))
            else:
                mlp(layer, cfg.intermediate_size)
                layer.router = layer.experts = None
            self.layers.append(layer)
        self.norm = p(h)
        self.lm_head = self.embed if cfg.tie_word_embeddings else p(cfg.vocab_size, h)
        cos, sin = rope.tables(cfg, dtype)   # the same bits on every machine (model/rope.py)
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

    @property
    def dtype(self):
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def finalize(self) -> None:
        """Call after loading weights: each layer's weights as the forward reads them."""
        # Each layer's weights as plain attributes, with the norm after its MLP (the next
        # layer's input norm, or the final one): a one-row decode step spent a tenth of a
        # millisecond on nn.Module attribute lookups and on slicing self.layers.
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        self.step_layers = [LayerWeights(*(getattr(layer, f.name) for f in fields(LayerWeights)[:-2]),
                                         _experts(layer), norm)
                            for layer, norm in zip(self.layers, norms)]
        # How the plans hold these weights (packed, quantized as stored, freed once packed:
        # plans.packing), made by them on first use; weights loaded anew start without it.
        self.stored = None

    def projections(self) -> list:
        """Every layer's projection weights (qkv, o, then gate_up, down, or each expert's
        gate_up, down), layer by layer: with the lm_head, what the plans multiply into
        bf16. The routers are not among them (routers())."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o) + _mlp_matrices(layer)]

    def routers(self) -> list:
        """Every routing layer's router [experts, hidden], whose logits are binary32."""
        return [layer.router for layer in self.layers if layer.router is not None]

    def first_mlp(self) -> tuple:
        """(gate_up, down) of layer 0's MLP, or of its expert 0: every MLP's matrices have
        these shapes or an expert's (the plans' self-checks and probes take them)."""
        return _mlp_matrices(self.layers[0])[:2]

    def hf_state_dict(self, get=lambda t: t) -> dict:
        """The weights under transformers' names (load_hf_state_dict's inverse, the
        family's table): the stacked qkv and gate_up split back into their projections.
        `get` maps each parameter first (`lambda p: p.grad` names the gradients)."""
        if any(t.numel() > 0 and t.untyped_storage().nbytes() == 0 for t in self.parameters()):
            raise ValueError("a model whose weights the plans hold packed (a GGUF's quantized weights served "
                             "as stored, or plain weights freed once packed) has no transformers checkpoint "
                             "(serve its GGUF with --dequantize for one)")
        cfg, block = self.cfg, families.of(self.cfg).block
        sd = {block.embed.hf[0]: get(self.embed), block.norm.hf[0]: get(self.norm)}
        for names, t, w in self._table_weights():
            for name, part in zip(names, get(t).split(w.parts(cfg)) if len(names) > 1 else (get(t),)):
                sd[name] = part
        if not cfg.tie_word_embeddings:
            sd[block.lm_head.hf[0]] = get(self.lm_head)
        return sd

    def forward(self, input_ids, positions, slots, attn_meta, kv: KVCache, plan) -> torch.Tensor:
        """Hidden states after the final norm, [rows, hidden]. Each residual add is
        fused with the RMSNorm that follows it (the next layer's input norm, or the
        final one): the same bits as the add, then the norm."""
        cfg = self.cfg
        nq, d = cfg.num_heads * cfg.head_dim, cfg.head_dim
        h = plan.embed(self, input_ids)
        cos, sin = self.cos[positions], self.sin[positions]   # [rows, head_dim], gathered once per forward
        slots = KVSlots(slots)
        x = plan.rms_norm(h, self.layers[0].input_norm, cfg.rms_norm_eps)
        fused = plan.decode_layers(self, h, x, cos, sin, kv, slots, attn_meta)   # every layer in one call
        if fused is not None:
            return fused
        for i, layer in enumerate(self.step_layers):
            qkv = plan.linear(x, layer.qkv)
            if layer.qkv_bias is not None:     # elementwise: the same bits in any batch
                qkv = plan.add(qkv, layer.qkv_bias)
            if layer.q_norm is not None:       # one reduction per (row, head), or per row (OLMoE)
                q, k, v = qkv.split([nq, cfg.num_kv_heads * d, cfg.num_kv_heads * d], dim=-1)
                qn, kn = layer.q_norm.shape[0], layer.k_norm.shape[0]
                qkv = torch.cat([plan.rms_norm(q.reshape(-1, qn), layer.q_norm, cfg.rms_norm_eps).view(q.shape),
                                 plan.rms_norm(k.reshape(-1, kn), layer.k_norm, cfg.rms_norm_eps).view(k.shape),
                                 v], -1)
            q = plan.rope_store(qkv, cos, sin, kv, i, slots, cfg.num_heads)
            attn = plan.attention(q, kv.k[i], kv.v[i], attn_meta, 1.0 / math.sqrt(d))
            o = self._row_parallel(plan, attn.reshape(-1, nq), layer.o, "o")
            h, x = plan.add_rms_norm(h, plan.add(o, layer.o_bias) if layer.o_bias is not None else o, layer.post_norm,
                                     cfg.rms_norm_eps)
            if layer.experts is not None:
                mlp = self._moe(plan, x, layer, attn_meta)
            else:
                mlp = self._row_parallel(plan, plan.silu_mul(plan.linear(x, layer.gate_up)), layer.down, "down")
            h, x = plan.add_rms_norm(h, mlp, layer.next_norm, cfg.rms_norm_eps)
        return x

    def _table_weights(self):
        """(each part's full transformers name, the parameter, its table entry) for every
        layer weight, in the table's order (an expert weight once per expert)."""
        for i, j, w, names in families.of(self.cfg).block.tensors(self.cfg):
            layer = self.layers[i]
            yield names, getattr(layer if j is None else layer.experts[j], w.attr), w

    def _moe(self, plan, x: torch.Tensor, layer: LayerWeights, meta) -> torch.Tensor:
        """A routing layer's MLP output for rows x [M, hidden]: each row's k experts
        (plan.route, ascending expert ids, binary32 weights from the binary32 router
        logits), each active expert's plain MLP once over the rows routed to it (each
        row's bits its own: the plan's matmul is row-invariant where it must be), then
        each row's weighted sum in ascending expert order (plan.combine). A plan with a
        one-call routing layer (plan.moe_layer; the reference's gives these steps' bits)
        runs it instead, except on a tensor-parallel shard. The rows' smallest router margin
        so far goes to meta.router_margin (the gate reads it)."""
        moe, tp = self.cfg.moe, self.tp
        fused = plan.moe_layer(self, x, layer) if tp is None else None
        if fused is not None:
            _min_margin(meta, fused[1])
            return fused[0]
        chosen, weights, margins = plan.route(plan.router_logits(x, layer.router), moe)   # [M, k], [M, k], [M]
        if tp is not None:   # every rank runs the same experts on the same rows
            chosen, weights = tp.same_routing(plan, chosen, weights)
        _min_margin(meta, margins)
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)   # (row, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=moe.num_experts).tolist()
        # On a tensor-parallel shard, each expert's down gives this rank's binary32 share,
        # summed over the ranks (tp.expert_sum) before the combine.
        out = x.new_empty(flat.shape[0], x.shape[1], dtype=x.dtype if tp is None else torch.float32)
        start = 0
        for (gate_up, down), n in zip(layer.experts, counts):
            if n:
                pairs = order[start:start + n]
                rows = plan.silu_mul(plan.linear(x.index_select(0, pairs // moe.top_k), gate_up))
                y = plan.linear(rows, down) if tp is None else tp.expert_partial(plan, rows, down)
                out.index_copy_(0, pairs, y)
                start += n
        out = out.view(x.shape[0], moe.top_k, x.shape[1])
        return plan.combine(out, weights) if tp is None else tp.expert_sum(plan, out, weights, x.dtype)

    def _row_parallel(self, plan, x: torch.Tensor, w: torch.Tensor, which: str) -> torch.Tensor:
        """x @ w.T for o and down: on a tensor-parallel shard, the sum over the ranks."""
        return plan.linear(x, w) if self.tp is None else self.tp.linear(plan, x, w, which)

    def load_hf_state_dict(self, sd: dict) -> None:
        """Weights named as transformers names them (the family's table; a mixture of
        experts' per expert or fused, model.experts). A missing or misshaped tensor is
        refused by name (ValueError); the model is then not to be used."""
        cfg, block = self.cfg, families.of(self.cfg).block
        sd = per_expert(sd, cfg)

        def take(name, shape):
            if name not in sd:
                raise ValueError(f"the checkpoint has no tensor {name}")
            t = sd[name]
            if tuple(t.shape) != tuple(shape):
                raise ValueError(f"tensor {name} has shape {tuple(t.shape)}, expected {tuple(shape)}")
            return t.to(dtype=self.dtype, device=self.device)

        def one(w):
            return take(w.hf[0], w.shapes(cfg)[0])

        with torch.no_grad():
            self.embed.copy_(one(block.embed))
            for names, t, w in self._table_weights():   # a stacked weight (q, k, v; gate, up): its parts by rows
                parts = [take(name, shape) for name, shape in zip(names, w.shapes(cfg))]
                t.copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
            self.norm.copy_(one(block.norm))
            if not cfg.tie_word_embeddings:
                self.lm_head.copy_(one(block.lm_head))
        self.finalize()


def _min_margin(meta, margins: torch.Tensor) -> None:
    """meta.router_margin: each row's smallest router margin over the routing layers so far."""
    old = getattr(meta, "router_margin", None)
    meta.router_margin = margins if old is None else torch.minimum(old, margins)


def _experts(layer) -> Optional[tuple]:
    """A routing layer's experts as ((gate_up, down), ...), else None."""
    return None if layer.experts is None else tuple((e.gate_up, e.down) for e in layer.experts)


def _mlp_matrices(layer) -> tuple:
    """A layer's MLP matrices: (gate_up, down), or every expert's in expert order."""
    if layer.experts is None:
        return (layer.gate_up, layer.down)
    return tuple(w for e in layer.experts for w in (e.gate_up, e.down))
