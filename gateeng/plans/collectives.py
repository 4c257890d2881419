"""The collectives of a tensor-parallel forward, on torch.distributed's default group
(gloo on CPU): the row-parallel sum (of a projection, or of a routing layer's
experts), a routing layer's choice, and the vocabulary-parallel logits.

The row-parallel sum takes the plan's rule. The reference (a plan with
`linear_partial`) sums its slice of K as that slice's subtree of the spec's dot;
the ranks' binary32 partials are gathered and combined by the tree's top levels in
rank order (`combine_partials`), which gives the bits of one device at every size
(kernels/SPEC.md, "Tensor parallelism"). Any other plan multiplies its slice and
takes the ordinary all-reduce, whose bits may change with the size.

Every rank calls these in the same order with tensors of the same shapes; the
group's timeout bounds every wait.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from gateeng.plans.tp_shapes import KSlice


def row_linear(plan, x: torch.Tensor, w: torch.Tensor, ks: KSlice, size: int) -> torch.Tensor:
    """x @ w.T summed over the ranks, where x and w hold this rank's slice of K (`ks`)."""
    return row_sum(plan, row_partial(plan, x, w, ks), size, x.dtype)


def row_partial(plan, x: torch.Tensor, w: torch.Tensor, ks: KSlice) -> torch.Tensor:
    """This rank's binary32 share of x @ w.T (x and w its slice of K, `ks`): the
    reference's subtree sums over its blocks, any other plan's product."""
    if _exact(plan):
        return plan.linear_partial(x, w, ks.per, ks.blocks)
    return plan.linear(x, w).float()


def row_sum(plan, partial: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """Every rank's row_partial [M, N] summed, in `dtype`: the reference's by the tree's
    top levels in rank order (the bits of one device), any other plan's by the
    all-reduce."""
    if _exact(plan):
        return plan.combine_partials(_gather(partial, size))
    dist.all_reduce(partial)
    return partial.to(dtype)


def same_routing(plan, chosen: torch.Tensor, weights: torch.Tensor) -> tuple:
    """A routing layer's choice (each row's expert ids [M, k], their binary32 weights)
    as every rank takes it. The reference's is the spec's arithmetic on inputs whose
    bits are the same on every rank, so every rank already made the same one. Any
    other plan's router dots carry no such promise (a rank's threads may round them
    differently), so every rank takes rank 0's."""
    if not _exact(plan):
        chosen, weights = chosen.contiguous(), weights.contiguous()
        dist.broadcast(chosen, 0)
        dist.broadcast(weights, 0)
    return chosen, weights


def expert_sum(plan, partials: torch.Tensor, weights: torch.Tensor, size: int, dtype: torch.dtype) -> torch.Tensor:
    """A routing layer's output [M, H] from this rank's binary32 shares [M, k, H] of
    each row's k experts' down projections (row_partial) and their weights [M, k].
    The reference sums each expert's output over the ranks first (row_sum: the bits of
    one device) and then combines the whole outputs in ascending expert order, as on
    one device; any other plan combines its shares (a weighted sum is linear) and
    takes one all-reduce of the result."""
    if _exact(plan):
        whole = row_sum(plan, partials.view(-1, partials.shape[-1]), size, dtype)
        return plan.combine(whole.view(partials.shape), weights)
    mine = plan.combine(partials, weights).float()
    dist.all_reduce(mine)
    return mine.to(dtype)


def vocab_logits(plan, model, hidden: torch.Tensor) -> torch.Tensor:
    """Every rank's float32 logits over its lm_head rows (the plan's full_logits on
    the shard), gathered on every rank into [rows, vocab] in vocabulary order. Each
    logit is one row's dot over the whole hidden size, as on one device, so the
    reference's are the bits of one device."""
    lay = model.tp.layout
    mine = plan.full_logits(model, hidden).float()
    per = lay.vocab_per_rank
    if mine.shape[1] < per:   # the last ranks' rows when the vocabulary does not split evenly
        mine = torch.cat([mine, mine.new_full((mine.shape[0], per - mine.shape[1]), float("-inf"))], 1)
    full = _gather(mine, lay.size).permute(1, 0, 2).reshape(mine.shape[0], lay.size * per)
    return full[:, :lay.vocab_size].contiguous()


def _exact(plan) -> bool:
    """Whether the plan sums a row-parallel projection as the reference's dot does."""
    return getattr(plan, "linear_partial", None) is not None


def _gather(mine: torch.Tensor, size: int) -> torch.Tensor:
    """[size, *mine.shape]: every rank's `mine`, in rank order."""
    mine = mine.contiguous()
    out = torch.empty((size * mine.shape[0],) + tuple(mine.shape[1:]), dtype=mine.dtype)
    dist.all_gather_single(out, mine)
    return out.view((size,) + tuple(mine.shape))
