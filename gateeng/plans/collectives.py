"""The two collectives of a tensor-parallel forward, on torch.distributed's default
group (gloo on CPU): the row-parallel sum, and the vocabulary-parallel logits.

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
    partial = getattr(plan, "linear_partial", None)
    if partial is not None:
        mine = partial(x, w, ks.per, ks.blocks)
        return plan.combine_partials(_gather(mine, size))
    y = plan.linear(x, w)
    total = y.float()
    dist.all_reduce(total)
    return total.to(y.dtype)


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


def _gather(mine: torch.Tensor, size: int) -> torch.Tensor:
    """[size, *mine.shape]: every rank's `mine`, in rank order."""
    mine = mine.contiguous()
    out = torch.empty((size * mine.shape[0],) + tuple(mine.shape[1:]), dtype=mine.dtype)
    dist.all_gather_single(out, mine)
    return out.view((size,) + tuple(mine.shape))
