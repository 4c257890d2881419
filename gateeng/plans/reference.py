"""ReferencePlan: the invariant plan of a bf16 model on CPU, whose every operation is
the reference's (gateeng-ref-1, kernels/SPEC.md), computed by kernels/ref_ops.cpp.

Each op's bits are the spec's on every machine and every build of the kernels
(plans.reference_ops), so a VERIFIED answer depends on the model, its dtype and
the reference version only: not on the CPU kind, the compiler, torch, the thread
count, the KV block size or the batch. Each op computes a row start to finish
from that row's data (attention: from its own keys), so forwards run on their real
rows, unpadded, at any count.

The weights are the model's one packed copy, in the reference matmul's layout,
which the fast plan multiplies too (plans.cpu_linear). Logits are the reference matmul's binary32
sums over the lm_head: a greedy token is their argmax (lowest id among ties), taken
from the few ids that can hold it where the fast plan's int8 logits bound the rest
(greedy_choice), else from the dense logits; a sampled one is chosen by the
reference sampler (plans.sampler with these ops) from the dense logits.
"""
from __future__ import annotations

import math

import torch

from gateeng.config import BFLOAT16, BLOCK_SIZE, SOFTMAX_TOPK
from gateeng.plans import cpu_linear, head, packing
from gateeng.plans.generic import InvariantAttnMeta, InvariantPlan
from gateeng.plans.kernel_names import REFERENCE


class ReferenceBase(InvariantPlan):
    """What every implementation of the reference shares: its name, unpadded rows,
    dense binary32 logits, and the row-wise ops of `self.ops`, a kernel module with
    the reference's rms_norm, add, silu_mul and decode_attention (ref_ops.cpp's
    build, or kernels/triton_reference.py). Subclasses give the matmul, the residual
    add with its norm, RoPE with the KV store, and the logits."""
    sparse_greedy = False   # logits are dense binary32 sums: argmax them directly

    def __init__(self, ops, block_size: int = BLOCK_SIZE):
        super().__init__(rows=0, split=64, block_size=block_size)
        self.ops = ops
        self.grouped = False   # every op is row-invariant at any row count: no padding rows

    @property
    def group_rows(self) -> int:
        return 0

    @staticmethod
    def applies(model) -> bool:
        """Whether the reference is defined for this model: bf16 weights whose every
        matmul has an even K (the kernels take K in pairs)."""
        ks = [w.shape[1] for w in model.projections()]
        return model.dtype == torch.bfloat16 and all(k % 2 == 0 for k in ks)

    @staticmethod
    def selfcheck_weights(model) -> list:
        layer = model.layers[0]
        return [layer.qkv, layer.o, *model.first_mlp(), model.lm_head]

    def describe(self, dtype: str = BFLOAT16) -> str:
        """The reference's version: what its bits depend on besides the model and dtype."""
        return REFERENCE

    @staticmethod
    def reference_version(model) -> str:
        """The reference's version for `model`: kernel_plan names the quantized types it
        multiplies (kernels/SPEC.md, "Quantized weights")."""
        stored = ", ".join(sorted(packing.of(model).stored_types))
        return f"{REFERENCE} ({stored} weights)" if stored else REFERENCE

    def add(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.ops.add(x, b)

    def rms_norm(self, x, w, eps):
        return self.ops.rms_norm(x, w, eps)

    def silu_mul(self, gate_up):
        return self.ops.silu_mul(gate_up)

    def attention(self, q, k_cache, v_cache, meta: InvariantAttnMeta, scale: float):
        return self.ops.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.key_counts, scale)

    def route(self, logits: torch.Tensor, moe) -> tuple:
        """Each row's k experts (ascending ids [M, k]), binary32 weights [M, k] and router
        margin [M] by the spec's routing rule (kernels/SPEC.md, "Mixture of experts")."""
        return tuple(self.ops.moe_route(logits, moe.top_k, moe.routing == SOFTMAX_TOPK, moe.norm_topk_prob))

    def combine(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """bf16 of each row's binary32 weighted sum of its experts' outputs, in order."""
        return self.ops.moe_combine(y, weights)

    @torch.inference_mode()
    def choice_logits(self, model, hidden: torch.Tensor, greedy: list) -> torch.Tensor:
        return self.full_logits(model, hidden)


class ReferencePlan(ReferenceBase):
    """The reference on the CPU build `ops` (plans.reference_ops), on the model's one
    packed copy of its weights (plans.packing.pack_shared: every build's layout is the
    same), packed here where the model has none."""

    def __init__(self, model, ops, block_size: int = BLOCK_SIZE, kernels=None):
        super().__init__(ops, block_size)
        self._packed = {id(w): packing.of(model).shared.get(id(w)) or cpu_linear.shared_pack(w, ops)
                        for w in model.projections() + [model.lm_head] + model.routers()}
        self._lm_head = id(model.lm_head)
        # Greedy rows choose from a few exact logits (greedy_choice) where the fast plan's
        # int8 logits bound them and plans.cpu_ops' candidate search is at hand (`kernels`).
        self._int8_head = packing.of(model).int8_head if kernels is not None and model.tp is None else None
        self._kernels = kernels
        self.sparse_greedy = self._int8_head is not None
        if self.sparse_greedy:   # its weight bound, made at start-up rather than on a request's step
            packing.lm_head_abs_sum(model)
        self._version = self.reference_version(model)
        # Each routing layer in one C++ call (moe_layer), keyed by id of expert 0's gate_up;
        # a tensor-parallel shard's experts sum over the ranks (model.shard): not here.
        self._moe_layers = {} if model.tp is not None else {
            id(layer.experts[0][0]): self._moe(model, layer) for layer in model.step_layers
            if layer.experts is not None}
        # Every layer in one C++ call (decode_layers); a tensor-parallel shard sums its
        # row-parallel matmuls over the ranks between ops: not here.
        self._layers = None if model.tp is not None else [self._layer(model, layer) for layer in model.step_layers]

    def _matrix(self, w):
        """A weight as ref_ops' Matrix takes it: its packed parts, their sizes and lanes."""
        parts = cpu_linear.parts(self._packed[id(w)])
        return self.ops.Matrix([q.data for q in parts], [q.n for q in parts], [q.per for q in parts])

    def _moe(self, model, layer):
        """A routing layer's router, experts and rule as ref_ops' MoeLayer takes them."""
        moe = model.cfg.moe
        return self.ops.MoeLayer(self._matrix(layer.router), [self._matrix(g) for g, _ in layer.experts],
                                 [self._matrix(d) for _, d in layer.experts], moe.top_k,
                                 moe.routing == SOFTMAX_TOPK, moe.norm_topk_prob)

    def _layer(self, model, layer):
        """A decoder layer as ref_ops' DecoderLayer takes it (decode_layers)."""
        routing = layer.experts is not None
        return self.ops.DecoderLayer(
            self._matrix(layer.qkv), layer.qkv_bias, layer.q_norm, layer.k_norm, self._matrix(layer.o),
            layer.o_bias, layer.post_norm, None if routing else self._matrix(layer.gate_up),
            None if routing else self._matrix(layer.down),
            self._moe_layers[id(layer.experts[0][0])] if routing else None, layer.next_norm)

    def decode_layers(self, model, h, x, cos, sin, kv, slots, meta):
        """Every decoder layer in one C++ call (ref_ops.cpp decode_layers): the functions
        the per-op forward calls, in its order, so the same bits, without about ten
        Python calls a layer (3-9% of a one- or two-row pass of the embedded model on a
        2-core AVX2 EPYC; too little to see beside a mixture of experts' experts). Each
        row attends its own keys, prefill rows too, so every pass of this plan takes it,
        but a tensor-parallel shard's."""
        if self._layers is None:
            return None
        x, margins = self.ops.decode_layers(h, x, self._layers, cos, sin, kv.k, kv.v, slots.all, meta.block_tables,
                                            meta.key_counts, model.cfg.num_heads, model.cfg.rms_norm_eps,
                                            1.0 / math.sqrt(model.cfg.head_dim))
        if self._moe_layers:   # the rows' smallest router margin, as the per-op forward leaves it
            meta.router_margin = margins
        return x

    def describe(self, dtype: str = BFLOAT16) -> str:
        return self._version

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return cpu_linear.side_by_side(self._packed[id(w)], lambda q: self.ops.linear(x, q.data, q.n, False, q.per))

    def moe_layer(self, model, x, layer):
        """A routing layer in one C++ call (ref_ops.cpp moe_layer): router_logits, route,
        each active expert's gate_up, silu_mul and down over its rows, and combine, the
        same kernels the per-op path calls one by one, so the same bits, without a
        Python call per expert. (output, router margins)."""
        moe = self._moe_layers.get(id(layer.experts[0][0]))
        return None if moe is None else tuple(self.ops.moe_layer(x, moe))

    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A router's logits: the binary32 dots x @ w.T, not rounded to bf16."""
        x = x.contiguous()
        return cpu_linear.side_by_side(self._packed[id(w)], lambda q: self.ops.linear(x, q.data, q.n, True, q.per))

    def linear_partial(self, x: torch.Tensor, w: torch.Tensor, per: int, blocks: int) -> torch.Tensor:
        """A tensor-parallel rank's binary32 subtree sums of x @ w.T, where w is the
        rank's slice of K holding `blocks` of the whole K's blocks of `per` pairs
        (kernels/SPEC.md, "Tensor parallelism")."""
        x = x.contiguous()
        return cpu_linear.side_by_side(self._packed[id(w)],
                                       lambda q: self.ops.linear_partial(x, q.data, q.n, per, blocks))

    def combine_partials(self, partials: torch.Tensor) -> torch.Tensor:
        """The ranks' subtree sums [size, M, N], in rank order, combined by the tree's
        top levels and rounded to bf16: the bits of linear on one device."""
        return self.ops.combine_partials(partials, False)

    def add_rms_norm(self, h, add, w, eps):
        return tuple(self.ops.add_rms_norm(h, add, w, eps))

    def rope_store(self, qkv, cos, sin, kv, layer, slots, num_heads):
        return self.ops.rope_store(qkv, cos, sin, kv.k[layer], kv.v[layer], slots.all, num_heads)

    @torch.inference_mode()
    def full_logits(self, model, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        return cpu_linear.side_by_side(self._packed[self._lm_head],
                                       lambda q: self.ops.linear(hidden, q.data, q.n, True, q.per))

    @torch.inference_mode()
    def greedy_choice(self, model, hidden: torch.Tensor) -> tuple[list, list]:
        """Greedy rows' tokens and margins, those the reference sampler takes from
        full_logits (the lowest id of the largest logit, and its lead over the rest),
        from the exact logits of a few ids. The fast plan's int8 logits lie within
        head.int8_logit_bound of the reference's for every id, so every id whose int8
        logit, rounded to bf16, is within twice that bound (and the bf16 rounding) of
        the row's second-largest is a candidate (cpu_ops greedy_candidates): both exact
        top-2 ids are among them, and every other id lies below both. The candidates'
        exact logits, in id order, go through the sampler's argmax_margin: the dense
        result, bit for bit. A row the bound does not cover (a non-finite value, a block
        of tiny inputs) or with too many candidates takes the dense logits."""
        hidden = hidden.contiguous()
        rows = hidden.shape[0]
        amax = hidden.float().abs().view(rows, -1, 32).amax(-1)   # the int8 kernels' input blocks
        if not bool(torch.isfinite(amax).all()) or bool(((amax > 0) & (amax < 2.0 ** -100)).any()):
            return self._dense_choice(model, hidden)
        slack = 2 * head.int8_logit_bound(hidden, packing.lm_head_abs_sum(model))
        r, ids, ok = self._kernels.greedy_candidates(self._int8_head(hidden).to(torch.bfloat16), slack)
        if not bool(ok):
            return self._dense_choice(model, hidden)
        (p,) = cpu_linear.parts(self._packed[self._lm_head])
        tokens, margins = [], []
        for i, found in enumerate(ids.split(torch.bincount(r, minlength=rows).tolist())):
            if found.numel() < 2 or found.numel() > p.n // 8:
                tok, mar = self._dense_choice(model, hidden[i:i + 1])
            else:
                blocks = torch.unique(found // 16)   # the packed column blocks holding them, in order
                logits = self.ops.linear(hidden[i:i + 1], p.data.index_select(0, blocks), 16 * blocks.numel(),
                                         True, p.per)[0]
                exact = logits.index_select(0, torch.searchsorted(blocks, found // 16) * 16 + found % 16)
                best, lead = self.ops.argmax_margin(exact[None].contiguous())
                tok, mar = [int(found[int(best[0])])], [float(lead[0])]
            tokens += tok
            margins += mar
        return tokens, margins

    def _dense_choice(self, model, hidden: torch.Tensor) -> tuple[list, list]:
        tok, mar = self.ops.argmax_margin(self.full_logits(model, hidden))
        return tok.tolist(), mar.tolist()
