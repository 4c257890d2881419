"""Kernel plans: how the model's reductions are computed for one forward.

FastPlan: matmuls by whichever kernel is fastest at the step's row count (the
batch may change the bits: that is the phenomenon VERIFIED requests are
protected from).

InvariantPlan: no row's reductions depend on the batch. The per-row C++ kernels
(norms, RoPE, SiLU, attention; with AVX-512 BF16 or AVX2 the matmul too) compute each
row start to finish in one thread, by construction; other matmuls run on row
groups of exactly `rows` (padded), so each call has the same M; the torch
fallback attention splits keys at fixed absolute positions; a greedy row's
top-2 logits are exact float32 dot products. A row's result then depends only
on its token, its position and its sequence's KV, which is what makes the
canonical reference well defined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Optional

import torch
import torch.nn.functional as F

from gateeng.config import BFLOAT16, BLOCK_SIZE, FAST, FLOAT32, INVARIANT, KERNEL_PREFILL_WORK, SOFTMAX_TOPK
from gateeng.plans.kernel_names import ONEDNN_PACKED, ROWWISE_MATMULS, TORCH_MM
from gateeng.kernels import fixed_order as ref
from gateeng.plans import packing
from gateeng.plans.head import float_logits, mixed_lm_head
from gateeng.plans.rows import Rows, seq_block_tables, slot_tensor


class CpuKernelOps:
    """The row-wise ops both plans share: plans.cpu_ops' kernels (`self.kernels`)
    where they apply, else the torch ops they replace. Each kernel computes a row
    start to finish in one thread from that row's data, so it is row-invariant by
    construction and runs on the real rows at any count."""
    kernels = None

    def _kernel(self, x: torch.Tensor):
        """The CPU kernels where they apply to x, else None."""
        if self.kernels is not None and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16):
            return self.kernels
        return None

    @staticmethod
    def embed(model, ids: torch.Tensor) -> torch.Tensor:
        """The token ids' embedding rows (a copy: no arithmetic)."""
        return packing.embed_rows(model, ids)

    @staticmethod
    def add(x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """x + b (a bias), rounded to x's dtype."""
        return x + b

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        k = self._kernel(x)
        return k.rms_norm(x, w, eps) if k is not None else ref.rms_norm(x, w, eps)

    def add_rms_norm(self, h: torch.Tensor, add: torch.Tensor, w: torch.Tensor, eps: float):
        """(h + add, RMSNorm of it): the residual add and the norm after it."""
        k = self._kernel(h)
        if k is not None:
            return tuple(k.add_rms_norm(h, add, w, eps))
        h = h + add
        return h, self.rms_norm(h, w, eps)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        k = self._kernel(gate_up)
        return k.silu_mul(gate_up) if k is not None else self._torch_silu_mul(gate_up)

    _torch_silu_mul = staticmethod(ref.silu_mul)

    def decode_layers(self, model, h, x, cos, sin, kv, slots, meta):
        """Every decoder layer in one call, where the plan has such a path for this
        step (the final normed hidden states), else None: the forward runs op by op."""
        return None

    def moe_layer(self, model, x, layer):
        """A routing layer's MLP output and its rows' router margins in one call, where
        the plan has such a path for this layer, else None: the forward routes, then
        runs expert by expert."""
        return None

    def rope_store(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, layer: int, slots,
                   num_heads: int) -> torch.Tensor:
        """RoPE on the query and key heads of qkv [rows, (Hq + 2 Hkv) D] (cos, sin:
        [rows, D]); keys and values stored at the rows' slots (model.KVSlots) in
        layer `layer`; returns the queries [rows, Hq, D]."""
        k = self._kernel(qkv)
        if k is not None:
            return k.rope_store(qkv, cos, sin, kv.k[layer], kv.v[layer], slots.all, num_heads)
        hkv, d = kv.k.shape[-2], kv.k.shape[-1]
        qk, v = qkv.split([(num_heads + hkv) * d, hkv * d], dim=-1)
        # Elementwise, so queries and keys rotate in one call (the same bits).
        qk = ref.rope(qk.reshape(-1, num_heads + hkv, d), cos[:, None, :], sin[:, None, :])
        q, k_rot = qk.split([num_heads, hkv], dim=1)
        kv.write(layer, k_rot, v.reshape(-1, hkv, d), slots)
        return q


@dataclass
class FastAttnMeta:
    prefill: list               # (row_start, row_end, key slots [ctx], mask [q, ctx]), torch attention
    decode_rows: torch.Tensor   # [B] rows attended one by one: decodes (and short prefill chunks, C++ kernel)
    decode_tables: torch.Tensor  # [B, W] block ids (the CPU kernel reads the cache by these)
    decode_lens: torch.Tensor    # [B] keys each of those rows attends
    decode_slots: Optional[torch.Tensor] = None  # [B, Lmax] key slots (torch attention only)
    decode_mask: Optional[torch.Tensor] = None   # [B, Lmax] (torch attention only)
    # A mixture of experts: per row, the smallest router margin over the routing layers
    # (the model's forward writes it).
    router_margin: Optional[torch.Tensor] = None


class FastPlan(CpuKernelOps):
    name = FAST

    def __init__(self, logit_noise: float = 0.0, packed: dict | None = None, kernels=None, dense_head=None):
        self.logit_noise = logit_noise   # test-only perturbation (provokes rollbacks)
        self._noise_gen = torch.Generator().manual_seed(1234)
        self.packed = packed if packed is not None else {}   # packing's `packed`
        self.kernels = kernels   # plans.cpu_ops' module, or None for torch ops
        # hidden -> float32 logits on the packed lm_head (packing's dense_head), or None:
        # as cheap as bf16 logits, so every row takes dense logits (no candidate search).
        self.dense_head = dense_head

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fn = self.packed.get(id(w))
        return fn(x) if fn is not None else F.linear(x, w)

    # A mixture of experts' routing in torch's arithmetic (the reference's is
    # plans.reference): the same rule, any rounding, any tie-break.
    @staticmethod
    def router_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """x @ router.T in float32."""
        return F.linear(x.float(), w.float())

    @staticmethod
    def route(logits: torch.Tensor, moe) -> tuple:
        """(each row's k expert ids ascending [M, k], their float32 weights [M, k], its
        router margin [M]: the k-th ranking score minus the (k+1)-th, inf when k = E)."""
        k = moe.top_k
        scores = torch.softmax(logits, -1) if moe.routing == SOFTMAX_TOPK else logits
        top, chosen = scores.topk(min(k + 1, scores.shape[-1]), -1)
        margins = top[:, k - 1] - top[:, k] if k < scores.shape[-1] else torch.full_like(top[:, 0], math.inf)
        top, chosen = top[:, :k], chosen[:, :k]
        if moe.routing != SOFTMAX_TOPK:
            weights = torch.softmax(top, -1)
        elif moe.norm_topk_prob:
            weights = top / top.sum(-1, keepdim=True)
        else:
            weights = top
        chosen, order = chosen.sort(-1)
        return chosen, weights.gather(-1, order), margins

    @staticmethod
    def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's experts' outputs y [M, k, H] weighted and summed, in y's dtype."""
        return (y.float() * weights[..., None]).sum(1).to(y.dtype)

    @property
    def sparse_greedy(self) -> bool:
        """Greedy rows may skip dense logits (choose): not when noise perturbs them, nor
        where dense float32 logits cost what bf16 ones do (dense_head)."""
        return not self.logit_noise and self.dense_head is None

    @staticmethod
    def candidate_head(model):
        """The bf16 lm_head for the greedy candidate search: the packed copy."""
        return packing.of(model).lm_head_bf16

    def decode_layers(self, model, h, x, cos, sin, kv, slots, meta):
        """A decode step (no prefill chunk) on the row-invariant matmul: every layer in
        one C++ call (cpu_ops.cpp decode_layers), the same kernels in the same order as
        the op-by-op forward, so the same bits, without a Python call per op: a one-row
        step spent more time in those calls than in everything but the matmuls. Only
        at the row counts where the op-by-op forward takes that matmul too."""
        stored = packing.of(model)
        if stored.fused_layers is None or self.kernels is None or meta.prefill or h.device.type != "cpu":
            return None
        if stored.fast_rowwise_max_rows is not None and x.shape[0] > stored.fast_rowwise_max_rows:
            return None
        f, cfg = stored.fused_layers, model.cfg
        args = (h, x, f.packed, f.out_sizes, f.parts, f.norms, f.qk_norms, f.routing, cos, sin, kv.k, kv.v, slots.all,
                meta.decode_tables, meta.decode_lens, cfg.num_heads, cfg.rms_norm_eps, 1.0 / math.sqrt(cfg.head_dim))
        x, margins = (self.kernels.decode_layers(*args) if f.matmul is None else
                      self.kernels.decode_layers_with(f.matmul, *args))
        if f.routing is not None:   # the rows' smallest router margin (as the op-by-op forward leaves it)
            meta.router_margin = margins
        return x

    def moe_layer(self, model, x, layer):
        """A routing layer in one C++ call (cpu_ops.cpp moe_layer): the router's logits,
        route's rule and tie-break in C++ arithmetic, then the rows grouped per expert,
        one int8 matmul per active expert and projection over its rows, and combine's
        weighted sum, no Python per expert; where packing found every expert of the
        layer on the int8 kernels. (output, router margins)."""
        experts = packing.of(model).expert_layers.get(id(layer.experts[0][0]))
        if experts is None or self.kernels is None or x.dtype != torch.bfloat16 or layer.router.dtype != x.dtype:
            return None
        moe = model.cfg.moe
        out, margins, _, _ = self.kernels.moe_layer(x, layer.router, moe.top_k, moe.routing == SOFTMAX_TOPK,
                                                    moe.norm_topk_prob, *experts,
                                                    bool(getattr(self.kernels, "qvnni", False)))
        return out, margins

    def _meta(self, rows: Rows, block_size: int, dev) -> FastAttnMeta:
        # With the C++ kernels, a prefill chunk whose queries x keys stay within
        # KERNEL_PREFILL_WORK runs row by row in the decode kernel (each row attends
        # its own prefix); a larger one goes to SDPA, which is faster there.
        kernel = self.kernels is not None and dev.type == "cpu"
        prefill, dec_rows, dec_tables, dec_ctx = [], [], [], []
        for start, end, table in rows.seqs:
            ctx = rows.positions[end - 1] + 1
            if end - start == 1 or (kernel and (end - start) * ctx <= KERNEL_PREFILL_WORK):
                first = len(dec_rows)
                dec_rows.extend(range(start, end))
                dec_tables.append((first, first + end - start, table))
                dec_ctx.extend(p + 1 for p in rows.positions[start:end])
            else:
                slots = slot_tensor(table, ctx, block_size, dev)
                qpos = torch.tensor(rows.positions[start:end], device=dev)
                mask = torch.arange(ctx, device=dev)[None, :] <= qpos[:, None]
                prefill.append((start, end, slots, mask))
        lmax = max(dec_ctx, default=0)
        width = -(-lmax // block_size)
        tables = seq_block_tables(dec_tables, len(dec_rows), width)
        meta = FastAttnMeta(prefill, torch.tensor(dec_rows, dtype=torch.int64, device=dev), tables,
                            torch.tensor(dec_ctx, dtype=torch.int64))
        if self.kernels is None or dev.type != "cpu":
            # Torch attention: one padded [B, Lmax] slot matrix built in a few tensor ops.
            slots = tables[:, :, None] * block_size + torch.arange(block_size)
            meta.decode_slots = slots.view(len(dec_rows), width * block_size)[:, :lmax].contiguous().to(dev)
            meta.decode_mask = (torch.arange(lmax)[None, :] < meta.decode_lens[:, None]).to(dev)
        return meta

    def attention(self, q, k_cache, v_cache, meta: FastAttnMeta, scale: float):
        if not meta.prefill:   # every row attended one by one, in row order
            return self._decode_attention(q, k_cache, v_cache, meta, scale)
        nb, bs, hkv, d = k_cache.shape
        kflat, vflat = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
        out = torch.empty_like(q)
        # index_select, not advanced indexing: the same gather, an order of magnitude
        # cheaper on CPU.
        for start, end, slots, mask in meta.prefill:
            k = kflat.index_select(0, slots).transpose(0, 1)[None]
            v = vflat.index_select(0, slots).transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k, v,
                                               attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1)
        if len(meta.decode_rows):
            out.index_copy_(0, meta.decode_rows, self._decode_attention(q.index_select(0, meta.decode_rows),
                                                                        k_cache, v_cache, meta, scale))
        return out

    def _decode_attention(self, q, k_cache, v_cache, meta: FastAttnMeta, scale: float):
        """One query row per sequence. The CPU kernel reads the KV blocks in place.
        Otherwise the padded context is gathered in one copy and SDPA reads K and V
        through strided [B, Hkv, L, D] views of it: on CPU a layout or dtype
        conversion of the gathered context cost 10x the attention itself (15 ms
        against 1.2 ms per layer at batch 32 and 300 keys)."""
        k = self._kernel(q)
        if k is not None:
            return k.decode_attention(q, k_cache, v_cache, meta.decode_tables, meta.decode_lens, scale)
        nb, bs, hkv, d = k_cache.shape
        b, lmax = meta.decode_slots.shape
        flat = meta.decode_slots.view(-1)
        keys = k_cache.view(nb * bs, hkv, d).index_select(0, flat).view(b, lmax, hkv, d).transpose(1, 2)
        values = v_cache.view(nb * bs, hkv, d).index_select(0, flat).view(b, lmax, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q[:, :, None, :], keys, values,
                                           attn_mask=meta.decode_mask[:, None, None, :], scale=scale,
                                           enable_gqa=True)
        return o[:, :, 0, :]

    def lm_head(self, model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        """float32 logits whose top-2 are exact for greedy rows, at a bf16 matmul's
        cost (greedy_logits); sampled rows get the full float32 lm_head."""
        if self.dense_head is not None:
            return self.dense_head(hidden)
        if model.dtype == torch.float32 or not any(greedy):
            return float_logits(self, model, hidden)
        return mixed_lm_head(model, hidden, greedy, lambda h: float_logits(self, model, h), self.candidate_head(model))

    @torch.inference_mode()
    def hidden(self, model, kv, rows: Rows) -> torch.Tensor:
        """Run the rows; the final hidden states of the sample rows, then the extra rows."""
        return self.hidden_and_router(model, kv, rows)[0]

    @torch.inference_mode()
    def hidden_and_router(self, model, kv, rows: Rows) -> tuple:
        """hidden's result, and a mixture of experts' router margins of the sample rows
        (None for a dense model)."""
        dev = model.device
        meta = self._meta(rows, kv.block_size, dev)
        hidden = model(torch.tensor(rows.input_ids, device=dev), torch.tensor(rows.positions, device=dev),
                       torch.tensor(rows.slots, device=dev), meta, kv, self)
        return hidden[rows.sample_rows + rows.extra_rows], _sample_rows(meta.router_margin, rows)

    @torch.inference_mode()
    def choice_logits(self, model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        """The logits the sampler chooses from (exact top-2 for greedy rows)."""
        logits = self.lm_head(model, hidden, greedy)
        if self.logit_noise:
            logits += (torch.randn(logits.shape, generator=self._noise_gen) * self.logit_noise).to(logits.device)
        return logits

    @torch.inference_mode()
    def full_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits (logprobs need the whole distribution)."""
        return self.dense_head(hidden) if self.dense_head is not None else float_logits(self, model, hidden)

    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        return self.choice_logits(model, self.hidden(model, kv, rows), rows.greedy)


@dataclass
class InvariantAttnMeta:
    block_tables: torch.Tensor   # [R, W] per row
    positions: torch.Tensor      # [R]
    split: int
    real: Optional[int] = None   # rows 0..real-1 are real, the rest padding (None: all)
    router_margin: Optional[torch.Tensor] = None   # as FastAttnMeta's

    @cached_property
    def key_counts(self) -> torch.Tensor:
        """[R] keys each row attends (its position + 1): once per forward, not per layer."""
        return self.positions + 1


def default_invariant_rows(isa: str) -> int:
    """Rows per group on a CPU with these ISA flags. Every group re-reads the
    weights, so where bf16 matmuls are native (avx512_bf16, amx_bf16) a group's
    cost barely grows with its rows: on an AVX-512 BF16 EPYC (SmolLM2-135M, bench/
    mixed.py) a 32-row group costs about 80 ms against 60 ms for 16 rows, and
    32-row groups gave the better mixed-traffic figures at 10, 50 and 100%
    VERIFIED. Where bf16 is emulated, cost is linear in rows and a small group
    wastes less on padding. The row count is part of the reference's description
    (kernel_plan), as the CPU kind already is."""
    flags = set(isa.split(","))   # comma-separated: the record's ISA list, or every cpuinfo flag
    return 32 if flags & {"avx512_bf16", "amx_bf16"} else 8   # cpuinfo flags


class InvariantPlan(CpuKernelOps):
    """One forward over all of a step's invariant rows; a row's bits depend only on
    its token, its position and its sequence's KV.

    Matmuls, by `matmul` (the weights `packed` were packed for it):
      cpu_dpbf16 / ref_avx2: VDPBF16PS (kernels/cpu_ops.cpp) or the reference's
        AVX2 matmul on the shared packed weights (plans.cpu_linear), whose every
        output is one fixed chain over K: row-invariant at any row count, so it
        runs on the real rows, unpadded;
      onednn_packed / torch_mm: oneDNN's packed copy, or torch.mm on the plain
        weight, on row groups of exactly `rows` rows (the forward is padded to a
        multiple of them), so every call has the same M and the library picks the
        same kernel and blocking.
    The kernels give different bits, so the description names which.

    With `kernels` (plans.cpu_ops), RMSNorm (with the residual add before it),
    RoPE with the KV store, the SiLU gate and attention are C++ loops that compute
    each row (attention: each row and KV head) start to finish in one thread,
    from that row's data only: invariant by construction, at any row count.
    Attention visits the row's keys block by block with an online softmax, so its
    bits also depend on the KV block size. Without them, RMSNorm is torch's (one
    reduction per row), the SiLU gate runs per row group (a vectorized exp differs
    in its last bit for a tensor's tail, so which elements fall in the tail must
    not depend on the batch), and attention is reference.split_attention per
    group, splitting keys at multiples of `split`; the forward is then padded to
    row groups whatever the matmul.

    Greedy rows take the lm_head through greedy_top2 / greedy_logits (exact float32
    top-2, whatever the candidate search's kernel); sampled rows the float32
    lm_head in groups of `rows`. The start-up self-check proves each piece on the
    machine."""
    name = INVARIANT
    version = 4   # bumped whenever the canonical bits' description changes
    sparse_greedy = True   # choose() gives the same tokens and margins as the dense path

    def __init__(self, rows: int = 8, split: int = 64, packed: dict | None = None, kernels=None,
                 block_size: int = BLOCK_SIZE, matmul: Optional[str] = None):
        self.rows = rows
        self.split = split
        self.packed = packed if packed is not None else {}   # packing's invariant_packed
        self.matmul = matmul or (ONEDNN_PACKED if self.packed else TORCH_MM)
        self.kernels = kernels   # plans.cpu_ops' module, or None for torch ops
        self.block_size = block_size   # the KV cache's (the kernel attention's bits depend on it)
        self.rowwise = self.matmul in ROWWISE_MATMULS   # the matmul is row-invariant
        # Every per-row op row-invariant at any row count: no padding rows.
        self.grouped = not (self.rowwise and kernels is not None)

    @property
    def group_rows(self) -> int:
        """Rows per padded group of a forward (the route policy prices passes by
        them), or 0 when a forward runs on its real rows only."""
        return self.rows if self.grouped else 0

    @staticmethod
    def candidate_head(model):
        """The bf16 lm_head for the greedy candidate search (packed where the model
        has it). Only which ids become candidates depends on it, never the result."""
        return packing.of(model).lm_head_bf16

    def describe(self, dtype: str = BFLOAT16) -> str:
        """What the canonical bits depend on, besides weights, dtype and device kind."""
        parts = [f"rows={self.rows}"]
        parts.append(f"matmul={self.matmul if self.packed and dtype == BFLOAT16 else TORCH_MM}")
        if self.kernels is not None:
            # The kernels' digest: their source, compiler, its flags and torch (the CPU is in
            # device_kind).
            digest = getattr(self.kernels, "digest", "?")
            parts += [f"attention=cpu_paged(block={self.block_size})", "norm_rope_silu=cpu", f"cpu_ops={digest}"]
        else:
            parts += [f"attention=split({self.split})", "norm_rope_silu=torch"]
        if dtype != FLOAT32:
            parts.append("greedy_lm_head=bf16+exact_top2")
        return f"{self.name}-v{self.version}({','.join(parts)})"

    @staticmethod
    def selfcheck_weights(model) -> list:
        """The matrices this plan multiplies by, for its self-check: one layer's (every
        layer has the same shapes) and the lm_head it takes logits from."""
        layer = model.layers[0]
        return [layer.qkv, layer.o, *model.first_mlp(), packing.lm_head_f32(model)]

    def _check_rows(self, n: int) -> None:
        if n % self.rows:
            raise ValueError(f"the invariant plan needs a multiple of {self.rows} rows, got {n}")

    def _grouped(self, fn, x: torch.Tensor, *args) -> torch.Tensor:
        """fn over row groups of exactly `rows` rows; x has a multiple of `rows` rows."""
        n, c = x.shape[0], self.rows
        self._check_rows(n)
        if n == c:
            return fn(x, *args)
        return torch.cat([fn(x[g:g + c], *args) for g in range(0, n, c)])

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        fn = self.packed.get(id(w))
        if fn is not None:
            return fn(x) if self.rowwise else self._grouped(fn, x)
        n, c = x.shape[0], self.rows
        self._check_rows(n)
        out = torch.empty(n, w.shape[0], dtype=x.dtype, device=x.device)
        wt = w.t()
        for g in range(0, n, c):
            torch.mm(x[g:g + c], wt, out=out[g:g + c])   # the product F.linear computes, in place
        return out

    def _torch_silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._grouped(ref.silu_mul, gate_up)

    def attention(self, q, k_cache, v_cache, meta: InvariantAttnMeta, scale: float):
        k = self._kernel(q)
        if k is not None:   # per row: padding rows are skipped (their output is zeros)
            n = q.shape[0] if meta.real is None else meta.real
            out = k.decode_attention(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.key_counts[:n], scale)
            if n == q.shape[0]:
                return out
            return torch.cat([out, out.new_zeros((q.shape[0] - n,) + tuple(q.shape[1:]))])
        c = self.rows
        out = torch.empty_like(q)
        for g in range(0, q.shape[0], c):
            out[g:g + c] = ref.split_attention(q[g:g + c], k_cache, v_cache, meta.block_tables[g:g + c],
                                               meta.positions[g:g + c], meta.split, scale)
        return out

    def _pad(self, n: int) -> int:
        return -(-n // self.rows) * self.rows

    def _full_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        padded = torch.zeros(self._pad(n), hidden.shape[1], dtype=hidden.dtype, device=hidden.device)
        padded[:n] = hidden
        return float_logits(self, model, padded)[:n]

    @torch.inference_mode()
    def hidden(self, model, kv, rows: Rows) -> torch.Tensor:
        """All rows in one forward: every row writes its KV before any row's attention
        reads it, and attention masks by position, so a sequence's chunk sees its own
        earlier rows as a prefill does. Returns the final hidden states of the sample
        rows, then the extra rows."""
        return self.hidden_and_router(model, kv, rows)[0]

    @torch.inference_mode()
    def hidden_and_router(self, model, kv, rows: Rows) -> tuple:
        """hidden's result, and a mixture of experts' router margins of the sample rows
        (None for a dense model)."""
        n, dev = len(rows), model.device
        if not n:
            return torch.zeros(0, model.cfg.hidden_size, dtype=model.dtype, device=dev), None
        pad = self._pad(n) - n if self.grouped else 0
        pos = rows.positions + [0] * pad
        tables = seq_block_tables(rows.seqs, n + pad, max(pos) // kv.block_size + 1)
        pos_t = torch.tensor(pos, device=dev)
        meta = InvariantAttnMeta(tables.to(dev), pos_t, self.split, n)
        hidden = model(torch.tensor(rows.input_ids + [0] * pad, device=dev), pos_t,
                       torch.tensor(rows.slots + [-1] * pad, device=dev), meta, kv, self)
        return hidden[rows.sample_rows + rows.extra_rows], _sample_rows(meta.router_margin, rows)

    @torch.inference_mode()
    def choice_logits(self, model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        if not hidden.shape[0]:
            return torch.zeros(0, model.cfg.vocab_size, device=hidden.device)
        greedy = greedy or [False] * hidden.shape[0]
        if model.dtype == torch.float32 or not any(greedy):
            return self._full_logits(model, hidden)
        return mixed_lm_head(model, hidden, greedy, lambda h: self._full_logits(model, h))

    @torch.inference_mode()
    def full_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        """Full float32 logits in fixed row groups: a row's values do not depend on
        the other rows (logprobs of VERIFIED tokens)."""
        return self._full_logits(model, hidden)

    def logits(self, model, kv, rows: Rows) -> torch.Tensor:
        return self.choice_logits(model, self.hidden(model, kv, rows), rows.greedy)


def _sample_rows(router_margin: Optional[torch.Tensor], rows: Rows) -> Optional[torch.Tensor]:
    """The sample rows' router margins, or None (a dense model)."""
    return None if router_margin is None else router_margin[rows.sample_rows]
