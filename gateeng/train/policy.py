"""Policy: the trainer's side of a VERIFIED rollout.

A torch.nn.Module whose parameters are float32 master weights, and whose forward is
the reference (kernels/SPEC.md) on their bf16 roundings, as the server rounds them
on loading: `logprobs` gives each completion token's log-probability bit for bit as
a VERIFIED request reports it, on any machine and build the reference runs on, and
`backward()` fills every parameter's `.grad` (train/plan.py says how). So the policy
ratio exp(logp_trainer - logp_rollout) of a VERIFIED rollout is exactly 1 before the
first update, and the KL between them exactly 0.

    policy = Policy.load()                          # what `gateeng serve` serves
    lps = policy.logprobs([prompt + completion], [len(prompt)], temperature=0.8)
    loss = -(advantage * lps[0]).sum(); loss.backward(); optimizer.step()
    policy.save("ckpt")                              # for `gateeng update-weights`
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional, Sequence

import torch

# The KV cache's block size of a policy forward: the engine's default. The reference's
# bits do not depend on it (attention runs in chunks of 16 absolute positions whatever
# the cache's blocks).
from gateeng.config import BLOCK_SIZE, FLOAT32
from gateeng.model import loader
from gateeng.model.rope import tables
from gateeng.plans import reference_ops
from gateeng.train.kernels import CpuReference, TritonReference
from gateeng.train.plan import TrainingPlan, TrainKV, spans_meta, token_logprobs

# Tokenizer and config files copied beside saved weights, so a saved policy serves as is.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja",
                   "generation_config.json")


class Policy(torch.nn.Module):
    """The model as float32 master weights (`self.model`, the same LlamaModel the
    server runs, its parameters trainable) with the reference's forward."""

    def __init__(self, loaded: loader.LoadedModel, hf_dir: Optional[Path] = None, isa: Optional[str] = None,
                 kernels: Optional[str] = None):
        super().__init__()
        if loaded.model.dtype != torch.float32:
            raise ValueError("a Policy holds float32 master weights: load the model with dtype float32")
        self.model = loaded.model
        for p in self.model.parameters():
            p.requires_grad_(True)
        # The server's RoPE tables are its bf16 model's: computed in binary64 and rounded
        # once to bf16 (model/rope.py), not rounded from the float32 tables.
        self.model.cos, self.model.sin = tables(loaded.config, torch.bfloat16)
        self.config, self.tokenizer, self.source = loaded.config, loaded.tokenizer, loaded.source
        self.hf_dir = hf_dir
        if kernels not in (None, "cpu", "triton"):
            raise ValueError(f"kernels must be cpu or triton, got {kernels!r}")
        self._kernels_asked = kernels
        try:
            # A CPU build: the forward's kernels on the CPU, and on any device the token
            # choice's arithmetic (scores, log_softmax), as the server's sampler runs it.
            self.ops = reference_ops.load(isa)
        except reference_ops.ReferenceUnavailable as exc:
            raise RuntimeError(f"the policy computes the reference, and no build of it runs here: {exc}") from None
        self._cpu = CpuReference(self.ops)
        self._triton = None

    @classmethod
    def load(cls, path: Optional[str] = None, isa: Optional[str] = None, kernels: Optional[str] = None) -> "Policy":
        """What `gateeng serve --model path` serves (the embedded model when None): a
        Hugging Face directory or a GGUF file. `isa` forces a CPU build of the
        reference (avx512_bf16, avx2, scalar; default: GATEENG_CPU_ISA, else the best
        here). `kernels`: "cpu" or "triton" (the reference's Triton kernels); by
        default the CPU build on the CPU and Triton on CUDA (`policy.cuda()`)."""
        loaded = loader.load(path, dtype=FLOAT32)
        hf_dir = loader.ensure_hf_dir(Path(path) if path else loader.default_model_path())
        return cls(loaded, hf_dir, isa, kernels)

    @property
    def isa(self) -> str:
        """The CPU build this policy computes on (information: every build gives the same bits)."""
        return getattr(self.ops, "isa", "?")

    def kernels(self):
        """The reference's kernels for the parameters' device (train/kernels.py)."""
        device = self.model.embed.device.type
        use = self._kernels_asked or ("triton" if device == "cuda" else "cpu")
        if use == "cpu":
            if device != "cpu":
                raise RuntimeError(f"the CPU build of the reference runs on CPU tensors; the policy is on {device}: "
                                   f"use kernels='triton'")
            return self._cpu
        if self._triton is None:
            self._triton = TritonReference()
        return self._triton

    def logprobs(self, sequences: Sequence[Sequence[int]], prompt_lens: Sequence[int], temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = 0) -> list:
        """Each completion token's log-probability, one float32 tensor per sequence
        (prompt then completion; `prompt_lens` their prompt lengths), bit-equal to a
        VERIFIED request's logprobs for the same tokens and sampling: log_softmax of
        logits / temperature over what top_k and top_p keep. A greedy rollout's are
        the temperature 1, untruncated ones (temperature 0 means the same). All
        sequences run in one forward, each row on its own keys, so packing changes no
        bit. Differentiable: backward() fills .grad of the parameters."""
        kernels = self.kernels()
        device = self.model.embed.device
        seqs = [list(map(int, s)) for s in sequences]
        lens = [int(n) for n in prompt_lens]
        self._check(seqs, lens, temperature, top_p, top_k)
        greedy = temperature == 0 or (temperature == 1.0 and top_p == 1.0 and top_k == 0)
        positions, slots, meta, blocks = spans_meta([len(s) for s in seqs], BLOCK_SIZE)
        ids = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
        meta.tables, meta.key_counts = meta.tables.to(device), meta.key_counts.to(device)
        plan = TrainingPlan(self.model, kernels)
        kv = TrainKV(self.config, blocks, BLOCK_SIZE, device)
        hidden = self.model(ids, torch.tensor(positions, device=device), torch.tensor(slots, device=device), meta, kv,
                            plan)
        # Row p predicts token p + 1: a completion's tokens come from rows prompt_len-1 .. len-2.
        rows, targets, sizes = [], [], []
        for (start, _), s, n in zip(meta.spans, seqs, lens):
            rows.extend(range(start + n - 1, start + len(s) - 1))
            targets.extend(s[n:])
            sizes.append(len(s) - n)
        logits = plan.logits(hidden[torch.tensor(rows, dtype=torch.int64, device=device)])
        out = token_logprobs(logits, torch.tensor(targets, dtype=torch.int64), self.ops,
                             float(temperature) if not greedy else 1.0, int(top_k), float(top_p), greedy)
        return list(out.split(sizes))

    def _check(self, seqs: list, lens: list, temperature: float, top_p: float, top_k: int) -> None:
        if len(seqs) != len(lens) or not seqs:
            raise ValueError(f"{len(seqs)} sequences and {len(lens)} prompt lengths: give one length per sequence")
        vocab, limit = self.config.vocab_size, self.config.max_position
        for i, (s, n) in enumerate(zip(seqs, lens)):
            if not 1 <= n < len(s):
                raise ValueError(f"sequence {i}: prompt length {n} must be at least 1 and leave a completion "
                                 f"(the sequence has {len(s)} tokens)")
            if len(s) > limit:
                raise ValueError(f"sequence {i}: {len(s)} tokens, past the model's {limit} positions")
            if min(s) < 0 or max(s) >= vocab:
                raise ValueError(f"sequence {i}: token ids must be in [0, {vocab})")
            window = self.config.sliding_window
            if window is not None and len(s) > window:
                raise ValueError(f"sequence {i}: {len(s)} tokens, past the model's sliding window ({window}); "
                                 f"the reference attends every earlier position")
        if not (temperature == 0 or 0 < temperature < float("inf")):
            raise ValueError(f"temperature must be 0 (greedy) or a finite number > 0, got {temperature}")
        if not 0 < top_p <= 1 or top_k < 0:
            raise ValueError(f"need 0 < top_p <= 1 and top_k >= 0, got top_p {top_p}, top_k {top_k}")

    def save(self, directory: str, dtype: torch.dtype = torch.bfloat16) -> Path:
        """HF-named safetensors of the weights as the forward uses them (bf16 roundings
        of the masters; `dtype=torch.float32` keeps the masters, which the server rounds
        to the same bf16), with config.json and the tokenizer's files, so that
        `gateeng serve --model directory` and `gateeng update-weights` load it and
        give this policy's bits."""
        from safetensors.torch import save_file
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.detach().to(dtype).contiguous() for name, t in self.model.hf_state_dict().items()}
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        if self.hf_dir is not None:
            config = json.loads((self.hf_dir / "config.json").read_text())
            config["dtype"] = config["torch_dtype"] = str(dtype).removeprefix("torch.")
            (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
            for name in TOKENIZER_FILES:
                if (self.hf_dir / name).is_file():
                    shutil.copyfile(self.hf_dir / name, out / name)
        return out

