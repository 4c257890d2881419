"""Start-up pricing of both plans for the adaptive route policy.

Each plan's cost model learns only from that plan's own passes, so a plan the
policy stops using keeps the price it last saw. Priced from traffic alone, a
plan's first passes set that price, and they pay one-time set-up (kernel builds,
oneDNN primitives, allocator growth): on torch ops a 20-row fast pass was once
priced at 216 ms where it takes about 110, and with every VERIFIED decode then
going direct, the fast plan never ran again to correct it. So before serving,
the engine times decode passes of both plans at a few row counts on throwaway
sequences, discards each shape's first pass, and feeds the rest to the cost
models; traffic refines them from there.
"""
from __future__ import annotations

from typing import Callable

from gateeng.request import DeterminismParams, Request, SamplingParams
from gateeng.scheduler import Kind, ScheduledSeq, StepPlan

PRICE_ROWS = (1, 8, 32)   # spans the decode batches the fit is asked about
REPEATS = 2               # timed passes per plan and row count, after the discarded one


def price_plans(observe: Callable[[str, int, float], None], time_pass: Callable[[Kind, int], float],
                row_counts=PRICE_ROWS, repeats: int = REPEATS) -> None:
    """observe(kind name, rows, seconds) for `repeats` timed decode passes of each plan
    at each row count; time_pass(kind, rows) runs one and returns its seconds. A
    shape's first pass is not observed: its one-time set-up is no decode's cost."""
    for rows in row_counts:
        for kind in (Kind.FAST, Kind.INVARIANT):
            time_pass(kind, rows)
            for _ in range(repeats):
                observe(kind.value, rows, time_pass(kind, rows))


def decode_pass_timer(runner, blocks) -> Callable[[Kind, int], float]:
    """time_pass for price_plans: one decode pass of `rows` throwaway sequences, each
    one KV block long and decoding its last position, through the runner and timed as a
    step's pass is (rows, the plan's forward, the lm_head, sampling). The blocks are
    taken from the free list and given back unregistered, so the KV accounting and
    the prefix cache are as before."""
    bs = blocks.block_size

    def time_pass(kind: Kind, rows: int) -> float:
        reqs = []
        try:
            for i in range(rows):
                req = Request(f"price-{i}", [0] * bs, SamplingParams(), DeterminismParams())
                req.block_table.append(blocks.allocate())
                reqs.append(req)
            runner.run(StepPlan([ScheduledSeq.plan(r, bs - 1, bs, kind) for r in reqs]))
            return runner.last_seconds[kind]
        finally:
            for req in reqs:
                blocks.release_all(req.block_table)
    return time_pass
