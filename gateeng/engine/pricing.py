"""Start-up pricing of both plans for the adaptive route policy.

Each plan's cost model learns only from that plan's own passes, so a plan the
policy stops using keeps the price it last saw. Priced from traffic alone, a
plan's first passes set that price, and they pay one-time set-up (kernel builds,
oneDNN primitives, allocator growth): on torch ops a 20-row fast pass was once
priced at 216 ms where it takes about 110, and with every VERIFIED decode then
going direct, the fast plan never ran again to correct it. So before serving,
the engine times decode passes of both plans at a few row counts on throwaway
sequences, discards each shape's first pass, and feeds the fastest of the rest
to the cost models; traffic refines them from there.
"""
from __future__ import annotations

from typing import Callable

from gateeng.request import DeterminismParams, Request, SamplingParams
from gateeng.step import Kind, ScheduledSeq, StepPlan

PRICE_ROWS = (1, 8, 32)   # spans the decode batches the fit is asked about
REPEATS = 3               # timed passes per plan and row count, after the discarded one
CONTEXT = 128             # keys each priced decode attends: a chat turn's context


def price_plans(observe: Callable[[str, int, float], None], time_pass: Callable[[Kind, int], float],
                row_counts=PRICE_ROWS, repeats: int = REPEATS) -> None:
    """observe(kind name, rows, seconds) once per plan and row count, with the fastest
    of `repeats` timed decode passes; time_pass(kind, rows) runs one and returns its
    seconds. A shape's first pass is left out: its one-time set-up is no decode's
    cost. The fastest, because a shared host's noise only ever adds time, and a
    stalled pass here would price a plan wrong until traffic corrects it, which for
    a plan the policy then avoids is never."""
    for rows in row_counts:
        for kind in (Kind.FAST, Kind.INVARIANT):
            time_pass(kind, rows)
            observe(kind.value, rows, min(time_pass(kind, rows) for _ in range(repeats)))


def decode_pass_timer(runner, blocks, context: int = CONTEXT) -> Callable[[Kind, int], float]:
    """time_pass for price_plans: one decode pass of `rows` throwaway sequences, each
    decoding position context - 1 (attention reads `context` keys), through the runner
    and timed as a step's pass is (rows, the plan's forward, the lm_head, sampling).
    The sequences share the blocks of their earlier positions, which are only read,
    and each writes its own last block. Every block comes from the free list and goes
    back unregistered, so the KV accounting and the prefix cache are as before."""
    bs = blocks.block_size

    def time_pass(kind: Kind, rows: int) -> float:
        shared, own, reqs = [], [], []
        try:
            shared.extend(blocks.allocate() for _ in range(_shared_blocks(context, bs)))
            for i in range(rows):
                own.append(blocks.allocate())
                req = Request(f"price-{i}", [0] * context, SamplingParams(), DeterminismParams())
                req.block_table = shared + [own[-1]]
                reqs.append(req)
            runner.run(StepPlan([ScheduledSeq.plan(r, context - 1, context, kind) for r in reqs]))
            return runner.last_seconds[kind]
        finally:
            for block in own + shared:
                blocks.release(block)
    return time_pass


def rows_that_fit(blocks, context: int = CONTEXT) -> int:
    """The most rows a priced pass can hold in the free blocks: the shared blocks, and
    one block per row. At least one while the blocks are all free, since a context
    that fits the cache (resolve_max_model_len) fits them."""
    return blocks.num_free - _shared_blocks(context, blocks.block_size)


def _shared_blocks(context: int, block_size: int) -> int:
    """The blocks of positions before a priced row's last, which its sequences share."""
    return (context - 1) // block_size
