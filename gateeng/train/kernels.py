"""The reference's kernels as the trainer's plan calls them, on either implementation:
the CPU builds (plans.reference_ops: avx512_bf16, avx2, scalar) or the Triton kernels
(kernels/triton_reference.py, on the tensors' device: CUDA, or the interpreter).
Both give kernels/SPEC.md's bits, so the policy's forward does not depend on which
runs it. Inputs and outputs are bf16 except the logits (binary32).

`prepare(w)` is a weight as the implementation multiplies it (the CPU builds' packed
layout, or the plain bf16 matrix); `linear` takes what it returned."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class _Packed:
    data: torch.Tensor
    n: int


class CpuReference:
    """A CPU build of the reference (plans.reference_ops' module)."""

    def __init__(self, ops):
        self.ops = ops
        self.name = f"cpu:{getattr(ops, 'isa', '?')}"

    def prepare(self, w: torch.Tensor) -> _Packed:
        return _Packed(self.ops.pack(w), w.shape[0])

    def linear(self, x: torch.Tensor, w: _Packed, logits: bool) -> torch.Tensor:
        return self.ops.linear(x, w.data, w.n, logits)

    def add(self, a, b):
        return self.ops.add(a, b)

    def rms_norm(self, x, w, eps: float):
        return self.ops.rms_norm(x, w, eps)

    def add_rms_norm(self, h, add, w, eps: float):
        return tuple(self.ops.add_rms_norm(h, add, w, eps))

    def silu_mul(self, gate_up):
        return self.ops.silu_mul(gate_up)

    def rope_store(self, qkv, cos, sin, k_cache, v_cache, slots, num_heads: int):
        return self.ops.rope_store(qkv, cos, sin, k_cache, v_cache, slots, num_heads)

    def decode_attention(self, q, k_cache, v_cache, tables, lens, scale: float):
        return self.ops.decode_attention(q, k_cache, v_cache, tables, lens, scale)

    def moe_route(self, logits, k: int, softmax_first: bool, renorm: bool):
        return tuple(self.ops.moe_route(logits, k, softmax_first, renorm))

    def moe_combine(self, y, weights):
        return self.ops.moe_combine(y, weights)


class TritonReference:
    """The Triton kernels of the reference (the CUDA invariant plan's, TritonReferencePlan)."""
    name = "triton"

    def __init__(self):
        from gateeng.kernels import triton_reference
        self.ops = triton_reference

    def prepare(self, w: torch.Tensor) -> torch.Tensor:
        return w.contiguous()

    def linear(self, x, w, logits: bool):
        return self.ops.matmul(x.contiguous(), w, f32=logits)

    def add(self, a, b):
        return self.ops.add(a, b)

    def rms_norm(self, x, w, eps: float):
        return self.ops.rms_norm(x, w, eps)

    def add_rms_norm(self, h, add, w, eps: float):
        h = self.ops.add(h, add)
        return h, self.ops.rms_norm(h, w, eps)

    def silu_mul(self, gate_up):
        return self.ops.silu_mul(gate_up)

    def rope_store(self, qkv, cos, sin, k_cache, v_cache, slots, num_heads: int):
        """As the CPU builds' rope_store: queries returned, keys (rotated) and values
        stored at their slots."""
        hkv, d = k_cache.shape[-2], k_cache.shape[-1]
        q = self.ops.rope(qkv, cos, sin, 0, num_heads, d)
        k = self.ops.rope(qkv, cos, sin, num_heads, hkv, d)
        v = qkv[:, (num_heads + hkv) * d:].reshape(-1, hkv, d)
        k_cache.view(-1, hkv, d).index_copy_(0, slots, k)
        v_cache.view(-1, hkv, d).index_copy_(0, slots, v)
        return q

    def decode_attention(self, q, k_cache, v_cache, tables, lens, scale: float):
        return self.ops.decode_attention(q, k_cache, v_cache, tables.to(q.device), lens.to(q.device), scale)

    def moe_route(self, logits, k: int, softmax_first: bool, renorm: bool):
        """(ids, weights, margins) of each row's k experts from its binary32 router
        logits, as the CPU builds' moe_route (SPEC.md, "Mixture of experts")."""
        return tuple(self.ops.moe_route(logits, k, softmax_first, renorm))

    def moe_combine(self, y, weights):
        """Each row's experts' outputs y [rows, k, H] weighted and summed in order, bf16."""
        return self.ops.moe_combine(y, weights)
