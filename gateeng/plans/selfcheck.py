"""Start-up proof, on random inputs, that the invariant plan is batch-invariant here.

Each check computes the same row alone and among other rows (at another row
index, in a call with more row groups, and for attention: inside one chunk and
among chunks of other sequences) and demands identical bits. The matmul check
runs on the model's own weight shapes when the engine passes them, since the
kernel a library picks depends on the shape. If any check fails, VERIFIED
requests are refused.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from gateeng.plans.generic import InvariantAttnMeta, InvariantPlan
from gateeng.plans.head import exact_logits


@dataclass
class SelfCheckResult:
    passed: bool
    failures: list = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> str:
        if self.passed:
            return f"invariant plan self-check passed ({self.seconds:.2f}s)"
        return "invariant plan self-check FAILED: " + "; ".join(self.failures)


def _rows_alone_vs_mixed(fn, x: torch.Tensor, gen) -> list:
    """fn maps a [k * C, ...] batch (k row groups) to [k * C, ...]; x holds one group.
    Row 0's bits must be the same alone (other rows zero), among random rows, at
    another index, and in a call with three groups."""
    c = x.shape[0]
    full = fn(x)
    fails = []
    alone = torch.zeros_like(x)
    alone[0] = x[0]
    if not torch.equal(fn(alone)[0], full[0]):
        fails.append("alone vs batch")
    moved = torch.randn(x.shape, generator=gen).to(dtype=x.dtype, device=x.device)
    moved[c - 1] = x[0]
    if not torch.equal(fn(moved)[c - 1], full[0]):
        fails.append("moved to another row")
    more = torch.randn((3 * c,) + tuple(x.shape[1:]), generator=gen).to(dtype=x.dtype, device=x.device)
    more[2 * c + 1] = x[0]
    if not torch.equal(fn(more)[2 * c + 1], full[0]):
        fails.append("in a call with more row groups")
    return fails


def run_selfcheck(plan: InvariantPlan, hidden: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype, block_size: int, seed: int = 0, device="cpu",
                  weights: Optional[list] = None) -> SelfCheckResult:
    """`weights`: the [N, K] matrices the plan's linear will see (the model's own);
    a random [2 * hidden, hidden] one when not given."""
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    c, failures = plan.rows or 8, []   # GPU plans have no fixed row count: any batch of rows

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    for w in weights or [randn(hidden * 2, hidden)]:
        x = torch.randn(c, w.shape[1], generator=gen).to(dtype=w.dtype, device=device)
        for f in _rows_alone_vs_mixed(lambda x: plan.linear(x, w), x, gen):
            failures.append(f"matmul {tuple(w.shape)}: {f}")
    for f in _rows_alone_vs_mixed(plan.silu_mul, randn(c, 2 * hidden), gen):
        failures.append(f"silu: {f}")
    nw = randn(hidden)
    for f in _rows_alone_vs_mixed(lambda x: plan.rms_norm(x, nw, 1e-5), randn(c, hidden), gen):
        failures.append(f"rmsnorm: {f}")

    # Exact logits (greedy rows' top-2): one (row, id) pair alone vs among many. Only
    # a plan that takes greedy tokens from them (sparse_greedy) depends on it; a plan
    # with dense logits argmaxes its own matmul's output, checked above. (On CUDA,
    # torch's sum changes its split with the number of pairs: a dense plan must not
    # be refused for a path it never runs.)
    if getattr(plan, "sparse_greedy", False):
        h, wf = randn(c, hidden), torch.randn(97, hidden, generator=gen).to(device)
        r, v = torch.meshgrid(torch.arange(c, device=device), torch.arange(97, device=device), indexing="ij")
        many = exact_logits(h, wf, r.reshape(-1), v.reshape(-1))
        for i in (0, 97 * c // 2 + 5, 97 * c - 1):
            one = exact_logits(h, wf, r.reshape(-1)[i:i + 1], v.reshape(-1)[i:i + 1])
            if not torch.equal(one[0], many[i]):
                failures.append("exact logits: one pair alone vs among many")
                break

    # Attention: sequence A of length L in a paged cache; its query rows are run
    # (1) all in one group, (2) one at a time among rows of another sequence B,
    # in a call with three groups of rows.
    split = plan.split
    length = max(2 * split, c) + block_size // 2 + 1   # c query rows, over more than two splits
    nblocks = 2 * (-(-length // block_size)) + 1
    k_cache, v_cache = randn(nblocks, block_size, num_kv_heads, head_dim), randn(nblocks, block_size, num_kv_heads, head_dim)
    perm = (torch.randperm(nblocks - 1, generator=gen) + 1).to(device)
    table_a, table_b = perm[:nblocks // 2], perm[nblocks // 2:]
    q = randn(length, num_heads, head_dim)
    scale = head_dim ** -0.5
    qpos = torch.arange(length - c, length, device=device)
    tables_a = table_a[None].expand(c, -1).contiguous()
    chunk = plan.attention(q[qpos], k_cache, v_cache, InvariantAttnMeta(tables_a, qpos, split), scale)
    for i, rows in ((0, c), (c // 2, 3 * c), (c - 1, c)):
        p = int(qpos[i])
        tables = table_b[None].expand(rows, -1).clone()
        pos = torch.randint(0, len(table_b) * block_size, (rows,), generator=gen).to(device)
        qs = randn(rows, num_heads, head_dim)
        j = (i + 3) % rows
        tables[j, :len(table_a)] = table_a
        pos[j] = p
        qs[j] = q[p]
        mixed = plan.attention(qs, k_cache, v_cache, InvariantAttnMeta(tables, pos, split), scale)
        if not torch.equal(mixed[j], chunk[i]):
            failures.append(f"attention: query at position {p} differs between one chunk and a mixed batch "
                            f"of {rows} rows")
            break
    return SelfCheckResult(not failures, failures, time.perf_counter() - t0)
