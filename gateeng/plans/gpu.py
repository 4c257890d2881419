"""The two plans on a CUDA device.

TritonReferencePlan: the reference (gateeng-ref-1, kernels/SPEC.md) in Triton
(kernels/triton_reference.py), the invariant plan of a bf16 model: the same bits
as the CPU's ReferencePlan. Its rows are sampled on the CPU reference kernels
(the logits come back to the host: one row of the vocabulary each).

TritonInvariantPlan (other dtypes): matmul, RMSNorm and attention from gateeng.kernels' Triton
kernels, whose per-row bits do not depend on the batch by construction (fixed
tiles, full-K reductions, fixed attention splits), so rows need no padding to a
fixed count: one forward serves all invariant rows of a step.

FlashInferFastPlan: flashinfer's paged prefill/append attention over the same
paged cache layout (NHD pages), cuBLAS matmuls through torch. flashinfer is
imported lazily, only here, only on CUDA.
"""
from __future__ import annotations

import torch

from gateeng.config import BFLOAT16, BLOCK_SIZE
from gateeng.kernels import fixed_order as ref
from gateeng.plans import packing
from gateeng.plans.generic import FastPlan, InvariantAttnMeta, InvariantPlan
from gateeng.plans.head import float_logits
from gateeng.plans.kernel_names import REFERENCE
from gateeng.plans.reference import ReferenceBase
from gateeng.plans.rows import Rows, seq_block_tables


class TritonInvariantPlan(InvariantPlan):
    name = "invariant-triton"
    sparse_greedy = False   # full logits on the GPU, sampled by the Triton kernel

    def __init__(self, split: int = 64):
        super().__init__(rows=0, split=split)
        from gateeng.kernels import triton_attention, triton_matmul, triton_rmsnorm
        self._mm, self._norm, self._attn = triton_matmul.matmul, triton_rmsnorm.rms_norm, triton_attention

    def describe(self, dtype: str = BFLOAT16) -> str:
        return f"{self.name}(split={self.split})"

    def linear(self, x, w):
        return self._mm(x, w)

    silu_mul = staticmethod(ref.silu_mul)   # elementwise: every CUDA thread runs the same code

    def rms_norm(self, x, w, eps):
        return self._norm(x, w, eps)

    def attention(self, q, k_cache, v_cache, meta: InvariantAttnMeta, scale: float):
        return self._attn.split_attention(q, k_cache, v_cache, meta.block_tables, meta.positions, meta.split, scale)

    @torch.inference_mode()
    def hidden(self, model, kv, rows: Rows) -> torch.Tensor:
        dev = model.device
        n = len(rows)
        tables = seq_block_tables(rows.seqs, n, max(p // kv.block_size + 1 for p in rows.positions))
        pos = torch.tensor(rows.positions, device=dev)
        meta = InvariantAttnMeta(tables.to(dev), pos, self.split)
        hidden = model(torch.tensor(rows.input_ids, device=dev), pos, torch.tensor(rows.slots, device=dev),
                       meta, kv, self)
        return hidden[rows.sample_rows + rows.extra_rows]

    @torch.inference_mode()
    def choice_logits(self, model, hidden, greedy):
        return float_logits(self, model, hidden)   # the Triton matmul is row-invariant at any row count

    full_logits = choice_logits


class TritonReferencePlan(ReferenceBase):
    """Every op of the reference in Triton; rows run unpadded, one forward per step.
    `model`'s quantized weights (plans.packing.set_blocks) are multiplied and looked up
    as stored (kernels/SPEC.md, "Quantized weights"), a stack of parts in different
    types part by part; every other weight is bf16."""

    def __init__(self, block_size: int = BLOCK_SIZE, model=None):
        from gateeng.kernels import triton_reference
        super().__init__(triton_reference, block_size)
        self._blocks = packing.of(model).blocks if model is not None else {}
        self._version = self.reference_version(model) if model is not None else REFERENCE

    def describe(self, dtype: str = BFLOAT16) -> str:
        return self._version

    def embed(self, model, ids: torch.Tensor) -> torch.Tensor:
        b = self._blocks.get(id(model.embed))
        return super().embed(model, ids) if b is None else self.ops.qrows(b.q, b.d, b.m, ids, b.sc, b.mn)

    def linear(self, x, w, f32: bool = False):
        b = self._blocks.get(id(w))
        if b is None:
            return self.ops.matmul(x, w, f32=f32)
        # A stack of parts in different types: each part's outputs are its own columns' dots.
        outs = [self.ops.qmatmul(x, p.q, p.d, p.m, f32, p.sc, p.mn) for p in packing.block_parts(b)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)

    def router_logits(self, x, w):
        """A router's logits: the binary32 dots x @ w.T, not rounded to bf16. (route and
        combine are ReferenceBase's, on triton_reference's moe_route and moe_combine.)"""
        return self.linear(x.contiguous(), w, f32=True)

    def add_rms_norm(self, h, add, w, eps):
        h = self.ops.add(h, add)
        return h, self.ops.rms_norm(h, w, eps)

    def rope_store(self, qkv, cos, sin, kv, layer, slots, num_heads):
        hkv, d = kv.k.shape[-2], kv.k.shape[-1]
        q = self.ops.rope(qkv, cos, sin, 0, num_heads, d)
        k = self.ops.rope(qkv, cos, sin, num_heads, hkv, d)
        v = qkv[:, (num_heads + hkv) * d:].reshape(-1, hkv, d)
        kv.write(layer, k, v, slots)
        return q

    @torch.inference_mode()
    def full_logits(self, model, hidden):
        return self.linear(hidden.contiguous(), model.lm_head, f32=True)


def host_sampler(ops):
    """The reference sampler (plans.sampler.Sampler on the CPU reference kernels `ops`)
    for logits on the device: (sample, logprobs), each moving its rows to the host."""
    from gateeng.plans.sampler import Sampler
    chosen = Sampler(ops)

    def sample(logits, specs):
        return chosen.sample(logits.cpu(), specs)

    def logprobs(full, params, token, k):
        return chosen.logprobs(full.cpu(), params, token, k)
    return sample, logprobs


class FlashInferFastPlan(FastPlan):
    name = "fast-flashinfer"
    sparse_greedy = False

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device, logit_noise: float = 0.0):
        super().__init__(logit_noise)
        import flashinfer   # GPU only
        self.workspace = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD")
        self.heads = (num_heads, num_kv_heads, head_dim)
        self.dtype = dtype

    def _meta(self, rows: Rows, block_size: int, dev):
        qo, kv_indptr, kv_indices, last = [0], [0], [], []
        for start, end, table in rows.seqs:
            ctx = rows.positions[end - 1] + 1
            pages = -(-ctx // block_size)
            qo.append(qo[-1] + end - start)
            kv_indices.extend(table[:pages])
            kv_indptr.append(kv_indptr[-1] + pages)
            last.append(ctx - (pages - 1) * block_size)
        i32 = dict(dtype=torch.int32, device=dev)
        h, hkv, d = self.heads
        self.wrapper.plan(torch.tensor(qo, **i32), torch.tensor(kv_indptr, **i32), torch.tensor(kv_indices, **i32),
                          torch.tensor(last, **i32), h, hkv, d, block_size, causal=True,
                          q_data_type=self.dtype, kv_data_type=self.dtype)
        return None

    def attention(self, q, k_cache, v_cache, meta, scale: float):
        return self.wrapper.run(q.contiguous(), (k_cache, v_cache))


def gpu_sample(logits: torch.Tensor, specs: list):
    """Greedy and plain seeded rows through the Triton sampling kernel (fixed order on
    the GPU); rows with top-k / top-p use the torch sampler."""
    from gateeng.plans import sampler
    from gateeng.kernels import triton_sampling
    n = logits.shape[0]
    tokens, margins = [0] * n, [0.0] * n
    groups = {"greedy": [], "seeded": [], "filtered": []}
    for i, s in enumerate(specs):
        p = s.params
        key = "greedy" if p.greedy else ("seeded" if p.top_k == 0 and p.top_p == 1.0 else "filtered")
        groups[key].append(i)
    for key in ("greedy", "seeded"):
        idx = groups[key]
        if idx:
            temps = [0.0 if key == "greedy" else specs[i].params.temperature for i in idx]
            tok, mar = triton_sampling.sample(logits[idx].contiguous(), temps,
                                              [specs[i].seed for i in idx], [specs[i].position for i in idx])
            for j, i in enumerate(idx):
                tokens[i], margins[i] = int(tok[j]), float(mar[j])
    idx = groups["filtered"]
    if idx:
        tok, mar = sampler.sample(logits[idx], [specs[i] for i in idx])
        for j, i in enumerate(idx):
            tokens[i], margins[i] = tok[j], mar[j]
    return tokens, margins
