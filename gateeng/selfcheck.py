"""Start-up proof, on random data, that the invariant plan is batch-invariant here.

Each check computes the same row alone and among other rows (and at another row
index, and for attention: inside one chunk and among chunks of other sequences)
and demands identical bits. If any check fails, VERIFIED requests are refused.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from gateeng.plan import InvariantAttnMeta, InvariantPlan


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
    """fn maps a fixed-shape [C, ...] batch to [C, ...]; compare row r's bits when it
    sits alone (other rows zero), among random rows, and at another index."""
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
    return fails


def run_selfcheck(plan: InvariantPlan, hidden: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, dtype, block_size: int, seed: int = 0, device="cpu") -> SelfCheckResult:
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    c, failures = plan.rows or 8, []   # GPU plans have no fixed row count: any batch of rows

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    w = randn(hidden * 2, hidden)
    for f in _rows_alone_vs_mixed(lambda x: plan.linear(x, w), randn(c, hidden), gen):
        failures.append(f"matmul: {f}")
    nw = randn(hidden)
    for f in _rows_alone_vs_mixed(lambda x: plan.rms_norm(x, nw, 1e-5), randn(c, hidden), gen):
        failures.append(f"rmsnorm: {f}")

    # Attention: sequence A of length L in a paged cache; its query rows are run
    # (1) all in one group, (2) one at a time among rows of another sequence B.
    split = plan.split
    length = 2 * split + block_size // 2 + 1
    nblocks = 2 * (-(-length // block_size)) + 1
    k_cache, v_cache = randn(nblocks, block_size, num_kv_heads, head_dim), randn(nblocks, block_size, num_kv_heads, head_dim)
    perm = (torch.randperm(nblocks - 1, generator=gen) + 1).to(device)
    table_a, table_b = perm[:nblocks // 2], perm[nblocks // 2:]
    q = randn(length, num_heads, head_dim)
    scale = head_dim ** -0.5
    qpos = torch.arange(length - c, length, device=device)
    tables_a = table_a[None].expand(c, -1).contiguous()
    chunk = plan.attention(q[qpos], k_cache, v_cache, InvariantAttnMeta(tables_a, qpos, split), scale)
    for i in (0, c // 2, c - 1):
        p = int(qpos[i])
        tables = table_b[None].expand(c, -1).clone()
        pos = torch.randint(0, len(table_b) * block_size, (c,), generator=gen).to(device)
        qs = randn(c, num_heads, head_dim)
        j = (i + 3) % c
        tables[j, :len(table_a)] = table_a
        pos[j] = p
        qs[j] = q[p]
        mixed = plan.attention(qs, k_cache, v_cache, InvariantAttnMeta(tables, pos, split), scale)
        if not torch.equal(mixed[j], chunk[i]):
            failures.append(f"attention: query at position {p} differs between one chunk and a mixed batch")
            break
    return SelfCheckResult(not failures, failures, time.perf_counter() - t0)
