"""TrainingPlan: the reference's forward with a backward, for the trainer's policy.

Every op the model calls (LlamaModel.forward's plan protocol) runs forward on the
reference kernels (plans.reference_ops: kernels/SPEC.md's arithmetic), so the
forward's bits are the server's VERIFIED bits; its backward is ordinary torch
arithmetic evaluated at the forward's own inputs (the float32 derivative of the
plain op the kernel rounds; a matmul's weight gradient on bf16 inputs, _Linear). The reference's rounding is not differentiated:
each rounding step is taken as the identity, as in any mixed-precision training.

Conventions (they keep every gradient in float32):
- activations travel between ops as float32 tensors holding bf16 values (the
  kernels' outputs, widened exactly); an op narrows its inputs to bf16 (exact)
  for the kernel and widens its output;
- weights are the policy's float32 master parameters: each op rounds a master to
  bf16 once per forward (`weight`), as the server rounds it on loading, with a
  straight-through gradient to the master;
- the logits are the reference's binary32 sums, float32 as they are.

Invariant: a row's forward bits depend only on its token, its position and its own
sequence's keys, as in the reference: packing sequences into one call changes no
bit. The model calls rope_store and then attention for the same layer, and the
plan hands the layer's rotated keys and values from one to the other.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from gateeng.config import SOFTMAX_TOPK

BF16 = torch.bfloat16


class _Round(torch.autograd.Function):
    """bf16(master), widened to float32; the gradient passes straight to the master."""

    @staticmethod
    def forward(ctx, master):
        return master.detach().to(BF16).float()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Op(torch.autograd.Function):
    """Forward: `kernel(*inputs)` (the reference's bits). Backward: the derivative of
    `plain(*inputs)` (float32 torch ops) at the same inputs, recomputed."""

    @staticmethod
    def forward(ctx, kernel, plain, *inputs):
        ctx.plain = plain
        ctx.save_for_backward(*inputs)
        with torch.no_grad():
            return kernel(*inputs)

    @staticmethod
    def backward(ctx, *grads):
        inputs = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            xs = [x.detach().requires_grad_(n) for x, n in zip(inputs, needs)]
            outs = ctx.plain(*xs)
            outs = outs if isinstance(outs, tuple) else (outs,)
            pairs = [(o, g) for o, g in zip(outs, grads) if g is not None]
            wanted = [x for x in xs if x.requires_grad]
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if wanted and pairs else [])
        return (None, None, *[next(got) if n else None for n in needs])


class _Linear(torch.autograd.Function):
    """x @ w.T on the reference matmul (the packed copy of w's bf16 rounding).
    dx = g @ w in float32: it flows back through every layer. dw = g.T @ x on bf16
    inputs (x is bf16 already; g rounded once) with float32 accumulation, rounded to
    bf16: about twice as fast as float32 on CPUs with bf16 matmuls, and its error
    (2^-8 relative, once per weight) stays local to that weight's gradient."""

    @staticmethod
    def forward(ctx, x, w, prepared, kernels, logits):
        ctx.save_for_backward(x, w)
        out = kernels.linear(x.to(BF16), prepared, logits)
        return out if logits else out.float()

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        dx = g @ w if ctx.needs_input_grad[0] else None
        dw = (g.to(BF16).t() @ x.to(BF16)).float() if ctx.needs_input_grad[1] else None
        return dx, dw, None, None, None


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x [rows, heads, D] with cos, sin [rows, D]."""
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]


@dataclass
class TrainMeta:
    """One forward's attention layout: per row its block table and key count (the
    reference kernel's), and per sequence its rows (the backward's causal attention)."""
    tables: torch.Tensor       # [rows, W]
    key_counts: torch.Tensor   # [rows]
    spans: list                # (row_start, row_end) per sequence; positions 0.. within it


class TrainKV:
    """A bf16 paged KV cache the reference kernels write and read, one forward long."""

    def __init__(self, cfg, num_blocks: int, block_size: int, device):
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=BF16, device=device)
        self.v = torch.zeros(shape, dtype=BF16, device=device)
        self.block_size = block_size


class TrainingPlan:
    """The plan protocol LlamaModel.forward calls, on the reference kernels `kernels`
    (train/kernels.py), for one forward over the masters of `model` (their bf16
    roundings prepared for the kernels' matmul once)."""

    def __init__(self, model, kernels):
        self.ops = kernels
        self._rounded: dict = {}      # id(master) -> its bf16 rounding in float32 (autograd)
        self._packed: dict = {}       # id(master) -> that rounding as the kernels' matmul takes it
        self._pending = None          # (k, v) of the layer whose rope_store ran last
        self.lm_head = model.lm_head
        for w in model.projections() + [model.lm_head] + model.routers():
            self._packed[id(w)] = kernels.prepare(w.detach().to(BF16))

    def weight(self, master: torch.Tensor) -> torch.Tensor:
        """The master's bf16 rounding, widened, made once per forward."""
        out = self._rounded.get(id(master))
        if out is None:
            out = self._rounded[id(master)] = _Round.apply(master)
        return out

    def _op(self, kernel, plain, *inputs):
        return _Op.apply(kernel, plain, *inputs)

    # ---- LlamaModel.forward's plan protocol -------------------------------------
    def embed(self, model, ids: torch.Tensor) -> torch.Tensor:
        return self.weight(model.embed)[ids]

    def decode_layers(self, *args):
        return None                   # op by op: each op has its backward

    def moe_layer(self, *args):
        return None                   # routed, then expert by expert: each op has its backward

    def linear(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _Linear.apply(x, self.weight(w), self._packed[id(w)], self.ops, False)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's float32 logits (the reference's binary32 sums)."""
        return _Linear.apply(hidden, self.weight(self.lm_head), self._packed[id(self.lm_head)], self.ops, True)

    def add(self, x: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ops = self.ops
        return self._op(lambda x, b: ops.add(x.to(BF16), b.to(BF16)).float(), torch.add, x, self.weight(b))

    def rms_norm(self, x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
        ops = self.ops
        return self._op(lambda x, w: ops.rms_norm(x.to(BF16), w.to(BF16), eps).float(),
                        lambda x, w: _rms(x, w, eps), x, self.weight(w))

    def add_rms_norm(self, h: torch.Tensor, add: torch.Tensor, w: torch.Tensor, eps: float):
        ops = self.ops

        def kernel(h, add, w):
            out, normed = ops.add_rms_norm(h.to(BF16), add.to(BF16), w.to(BF16), eps)
            return out.float(), normed.float()

        def plain(h, add, w):
            s = h + add
            return s, _rms(s, w, eps)
        return self._op(kernel, plain, h, add, self.weight(w))

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        ops = self.ops

        def plain(gu):
            gate, up = gu.chunk(2, dim=-1)
            return F.silu(gate) * up
        return self._op(lambda gu: ops.silu_mul(gu.to(BF16)).float(), plain, gate_up)

    # A mixture of experts' routing layer (LlamaModel._moe). The choice of experts is
    # discrete: the backward goes straight through it, to the router by the chosen
    # experts' weights and to each expert by its rows.
    def router_logits(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A router's logits: the reference's binary32 dots, as the lm_head's."""
        return _Linear.apply(x, self.weight(w), self._packed[id(w)], self.ops, True)

    def route(self, logits: torch.Tensor, moe) -> tuple:
        """(each row's k experts, ascending ids [M, k]; their binary32 weights [M, k]; its
        router margin [M]) by the reference's rule; the weights' gradient is the float32
        rule's at the same choice (softmax over the experts, or over the chosen k)."""
        first = moe.routing == SOFTMAX_TOPK
        with torch.no_grad():
            ids, weights, margins = self.ops.moe_route(logits.detach(), moe.top_k, first, moe.norm_topk_prob)

        def plain(z):
            if not first:
                return torch.softmax(z.gather(-1, ids), -1)
            w = torch.softmax(z, -1).gather(-1, ids)
            return w / w.sum(-1, keepdim=True) if moe.norm_topk_prob else w
        return ids, self._op(lambda z: weights, plain, logits), margins

    def combine(self, y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's experts' outputs y [M, k, H] weighted and summed in ascending
        expert order, then rounded (the reference's combine)."""
        ops = self.ops
        return self._op(lambda y, w: ops.moe_combine(y.to(BF16), w).float(),
                        lambda y, w: (y * w[..., None]).sum(1), y, weights)

    def rope_store(self, qkv, cos, sin, kv: TrainKV, layer: int, slots, num_heads: int) -> torch.Tensor:
        """RoPE on the queries and keys; the kernel stores keys and values in the cache
        (for its attention) and the plan keeps them, widened, for the backward's."""
        ops, hkv, d = self.ops, kv.k.shape[-2], kv.k.shape[-1]
        where = slots.all
        cos16, sin16 = cos.to(BF16), sin.to(BF16)

        def kernel(qkv):
            q = ops.rope_store(qkv.to(BF16), cos16, sin16, kv.k[layer], kv.v[layer], where, num_heads)
            k = kv.k[layer].view(-1, hkv, d).index_select(0, where)
            v = kv.v[layer].view(-1, hkv, d).index_select(0, where)
            return q.float(), k.float(), v.float()

        def plain(qkv):
            q, k, v = qkv.split([num_heads * d, hkv * d, hkv * d], dim=-1)
            c, s = cos16.float(), sin16.float()
            return (_rotate(q.reshape(-1, num_heads, d), c, s), _rotate(k.reshape(-1, hkv, d), c, s),
                    v.reshape(-1, hkv, d))
        q, k, v = self._op(kernel, plain, qkv)
        self._pending = (k, v)
        return q

    def attention(self, q, k_cache, v_cache, meta: TrainMeta, scale: float) -> torch.Tensor:
        ops = self.ops
        k, v = self._pending
        self._pending = None

        def kernel(q, k, v):
            return ops.decode_attention(q.to(BF16), k_cache, v_cache, meta.tables, meta.key_counts, scale).float()

        def plain(q, k, v):
            outs = []
            for start, end in meta.spans:   # causal attention within each sequence, GQA
                o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None], k[start:end].transpose(0, 1)[None],
                                                   v[start:end].transpose(0, 1)[None], is_causal=True, scale=scale,
                                                   enable_gqa=True)
                outs.append(o[0].transpose(0, 1))
            return torch.cat(outs)
        return self._op(kernel, plain, q, k, v)


class _TokenLogprobs(torch.autograd.Function):
    """Each row's log-probability of its token: the reference's scores (logits / T
    with top-k and top-p; the logits themselves for `greedy`) and log_softmax, as a
    VERIFIED request reports them. Backward: (onehot - softmax(scores)) / T over the
    ids the filter kept; the filter's choice of ids is not differentiated."""

    @staticmethod
    def forward(ctx, logits, tokens, ops, temperature, top_k, top_p, greedy):
        # `ops`: a CPU build of the reference, which also samples for a CUDA server
        # (plans.gpu.host_sampler): the logits go to the host, the gradient back.
        rows, device = logits.shape[0], logits.device
        logits = logits.cpu()
        out = torch.empty(rows, dtype=torch.float32)
        scores = torch.empty_like(logits)
        for i in range(rows):
            z = logits[i].contiguous()
            s = z if greedy else ops.sample_scores(z, temperature, top_k, top_p)
            scores[i] = s
            out[i] = ops.log_softmax(s)[tokens[i]]
        ctx.save_for_backward(scores, tokens)
        ctx.scale = 1.0 if greedy else 1.0 / temperature
        ctx.device = device
        return out.to(device)

    @staticmethod
    def backward(ctx, g):
        scores, tokens = ctx.saved_tensors
        grad = -torch.softmax(scores, dim=-1)                # dropped ids (-inf) get exactly 0
        grad[torch.arange(len(tokens)), tokens] += 1.0
        return (grad * (g.cpu()[:, None] * ctx.scale)).to(ctx.device), None, None, None, None, None, None


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, ops, temperature: float, top_k: int, top_p: float,
                   greedy: bool) -> torch.Tensor:
    return _TokenLogprobs.apply(logits, tokens, ops, temperature, top_k, top_p, greedy)


def spans_meta(lengths: list, block_size: int) -> tuple:
    """(input positions, KV slots, TrainMeta, blocks needed) for sequences of these
    lengths packed one after another, each in blocks of its own."""
    positions, slots, tables, counts, spans = [], [], [], [], []
    block, row = 0, 0
    width = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        nblocks = -(-n // block_size)
        table = list(range(block, block + nblocks))
        for p in range(n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
            tables.append(table + [0] * (width - nblocks))
            counts.append(p + 1)
        spans.append((row, row + n))
        block, row = block + nblocks, row + n
    meta = TrainMeta(torch.tensor(tables, dtype=torch.int64), torch.tensor(counts, dtype=torch.int64), spans)
    return positions, slots, meta, block
