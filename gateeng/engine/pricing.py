"""Start-up pricing of both plans for the adaptive route policy.

Each plan's cost model learns only from that plan's own passes, so a plan the
policy stops using keeps the price it last saw. Priced from traffic alone, a
plan's first passes set that price, and they pay one-time set-up (kernel builds,
oneDNN primitives, allocator growth): a first pass can cost twice a later one,
and with every VERIFIED decode then going direct, the fast plan would never run
again to correct it. So before serving, the engine times decode passes of both
plans at a few row counts on throwaway sequences, discards each shape's first
pass, and feeds the fastest of the rest to the cost models; traffic refines them
from there.

The passes are timed once per machine, build, model and plan settings and kept
(route_costs.py): on a busy host timing them takes tens of seconds of every
start. A set of timings whose fit is negative, falls with rows or misses the
timings is refused (`refusal`): a host's stall can fit a negative intercept and
a huge per-row cost, which would steer the route for the server's life. A refused
set leaves the policy at its priors, both plans priced alike, which sends
neither plan's work away from it for good: traffic runs and measures both. Its
fit is never used. The refusal is kept, as are timings taken on a busy host, and
a later start on a busy host takes them at once, while one on a quiet host times
the passes again (`_serve_kept`).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Optional

from gateeng.engine import route_costs
from gateeng.logs import log
from gateeng.request import DeterminismParams, Request, SamplingParams
from gateeng.step import PlanKind, ScheduledSeq, StepPlan

PRICE_ROWS = (1, 8, 32)   # spans the decode batches the fit is asked about
REPEATS = 3               # timed passes per plan and row count, after the discarded one
# Where the fit of the fastest passes so far is refused, more rounds are timed (a
# busy host's stalls only add time, so the fastest of more passes is nearer the
# cost), up to this many rounds and while the extra rounds have taken less than
# EXTRA_SECONDS.
MAX_REPEATS = 12
EXTRA_SECONDS = 10.0
CONTEXT = 128             # keys each priced decode attends: a chat turn's context
# A timed pass's noise on a quiet host, in seconds: the unit the cost models fit in.
# Differences within it are no evidence of anything.
NOISE = 1e-3
# How far a fit may miss a timing it was fitted to, as a fraction of that timing. A
# decode pass is not quite linear in its rows: on a quiet host the embedded model's
# fast passes at 1/8/32 rows missed their line by up to 17%, and a host busy with
# other work bends the line further without making it wrong about which plan costs
# more. Half a timing is no longer a price of that pass.
FIT_TOLERANCE = 0.5
# The share of the CPU time its threads asked for that a start's passes got: 0.99 on
# a quiet host (OpenMP's threads spin rather than sleep between regions), 0.5 beside
# two busy processes on two cores, 0.6-0.7 beside one. Timings taken below it were
# taken on a busy host: they serve, and are kept, but a later start that finds the
# host quiet times them again.
QUIET_SHARE = 0.85
AGAIN = "--recalibrate-route times them again"   # what every line about kept costs tells an operator


def price_plans(time_pass: Callable[[PlanKind, int], float], row_counts=PRICE_ROWS, repeats: int = REPEATS,
                sound: Callable[[list], bool] = lambda measured: True) -> list:
    """[(kind name, rows, seconds)], once per plan and row count, with the fastest of
    `repeats` timed decode passes, or of more while `sound(measured)` is False (up to
    MAX_REPEATS rounds and EXTRA_SECONDS); time_pass(kind, rows) runs one and returns
    its seconds. A shape's first pass is left out: its one-time set-up is no decode's
    cost. The fastest, because a shared host's noise only ever adds time, and a
    stalled pass here would price a plan wrong until traffic corrects it, which for
    a plan the policy then avoids is never. The rounds go round the shapes, so that
    a stall of the host, which lasts a while, lands on one pass of several shapes
    rather than on every pass of one."""
    shapes = [(kind, rows) for rows in row_counts for kind in (PlanKind.FAST, PlanKind.INVARIANT)]
    for shape in shapes:
        time_pass(*shape)
    best = {shape: math.inf for shape in shapes}
    extra_until = math.inf
    for done in range(1, max(repeats, MAX_REPEATS) + 1):
        for shape in shapes:
            best[shape] = min(best[shape], time_pass(*shape))
        measured = [(kind.value, rows, best[(kind, rows)]) for kind, rows in shapes]
        if done == repeats:
            extra_until = time.perf_counter() + EXTRA_SECONDS
        if done >= repeats and (sound(measured) or time.perf_counter() > extra_until):
            break
    return measured


def refusal(measured: list, group_rows: int) -> Optional[str]:
    """Why the cost models' fit of `measured` ([(kind, rows, seconds)]) is refused, or
    None when it is sound: each plan's timings must rise with rows, and their least
    squares fit (seconds per row group where the invariant plan pads to `group_rows`,
    else base + per row) must be non-negative and within FIT_TOLERANCE (or NOISE) of
    every timing."""
    for kind in (PlanKind.FAST.value, PlanKind.INVARIANT.value):
        points = sorted((rows, seconds) for k, rows, seconds in measured if k == kind)
        if not points:
            return f"no {kind} pass was timed"
        bad = [s for _, s in points if not (math.isfinite(s) and s > 0)]
        if bad:
            return f"a {kind} pass took {bad[0]!r} s"
        for (r0, s0), (r1, s1) in zip(points, points[1:]):
            if s1 < s0 - max(NOISE, FIT_TOLERANCE * s0):
                return f"the {kind} plan's passes got cheaper with more rows ({_ms(s0)} at {r0}, {_ms(s1)} at {r1})"
        groups = group_rows if kind == PlanKind.INVARIANT.value else 0
        if groups:
            per_group = _group_fit(points, groups)
            cost, fit = (lambda r: -(-r // groups) * per_group), f"{_ms(per_group)} per {groups}-row group"
        else:
            base, per_row = _line_fit(points)
            cost, fit = (lambda r: base + per_row * r), f"{_ms(base)} + {_ms(per_row, 2)}/row"
            if base < -NOISE:
                return f"the {kind} plan's fit {fit} is negative"
            if per_row * (points[-1][0] - points[0][0]) < -NOISE:
                return f"the {kind} plan's fit {fit} falls with rows"
        for rows, seconds in points:
            if abs(cost(rows) - seconds) > max(NOISE, FIT_TOLERANCE * seconds):
                return f"the {kind} plan's fit {fit} gives {_ms(cost(rows))} at {rows} rows, where it took {_ms(seconds)}"
    return None


def seed(route, time_pass: Callable[[PlanKind, int], float], row_counts: list, context: int, facts: dict,
         threads: int, probe: Callable[[], Optional[float]], measure_again: bool = False) -> None:
    """Seeds `route` (a RoutePolicy with nothing observed) with decode-pass costs of both
    plans: those kept for `facts` and these rows and keys (route_costs), or, where
    none are or `measure_again`, timed now (time_pass: decode_pass_timer's) and
    kept. Whether the host is busy: `threads`, the CPU threads a pass runs on (0: not
    judged, as for a GPU's passes), and `probe()`, the share of the CPU this process
    gets now (plans.host_load; None: not judged). Logs one line that says where the
    costs came from."""
    facts = dict(facts, rows=list(row_counts), context=context, repeats=REPEATS)
    stored = None if measure_again else route_costs.load(facts)
    if stored is None or not _serve_kept(route, stored, probe):
        _time_and_keep(route, time_pass, row_counts, context, facts, threads)


def _serve_kept(route, stored: route_costs.Stored, probe: Callable[[], Optional[float]]) -> bool:
    """Seeds `route` from kept timings and logs it, or says why they are timed again
    (False). Timings taken on a quiet host serve. Those refused leave the policy at
    its priors, and those taken on a busy host serve, as long as the host is busy
    (`probe`: the CPU share this process gets now): on a host busy enough for that,
    timing them at every start is what made starts slow, and on a quiet one they are
    timed again."""
    why = stored.refused or refusal(stored.measured, route.group_rows)
    if why is not None and not stored.refused:
        log(f"the route costs in {stored.path} are refused ({why}); timing them again")
        return False
    if why is None and _quiet(stored.cpu_share):
        _observe(route, stored.measured)
        log(f"route costs from {stored.path} (decode passes timed {stored.when}; {AGAIN}): {route.describe()}")
        return True
    taken = f"timed {stored.when} " + (f"were refused ({why})" if why else
                                        f"on a busy host got {stored.cpu_share:.0%} of the CPU")
    if _quiet(probe()):
        log(f"the decode passes {taken} ({stored.path}); this host is quiet now: timing them again")
        return False
    if why:
        log(f"route costs: both plans priced alike until traffic measures them: the decode passes {taken}, "
            f"and this host is busy too ({stored.path}; {AGAIN}): {route.describe()}")
    else:
        _observe(route, stored.measured)
        log(f"route costs from {stored.path} (the decode passes {taken}, and this host is busy too; {AGAIN}): "
            f"{route.describe()}")
    return True


def _time_and_keep(route, time_pass, row_counts: list, context: int, facts: dict, threads: int) -> None:
    """Times the passes, seeds `route` where their fit is sound, keeps them, logs it."""
    t0 = time.perf_counter()
    measured, share = _cpu_share(lambda: price_plans(time_pass, row_counts,
                                                     sound=lambda m: refusal(m, route.group_rows) is None), threads)
    took = f"{time.perf_counter() - t0:.1f} s" + ("" if _quiet(share) else f", a busy host: {share:.0%} of the CPU")
    what = f"decode passes at row counts {'/'.join(map(str, row_counts))}, {context} keys ({took})"
    why = refusal(measured, route.group_rows)
    if why is None:
        _observe(route, measured)
    path = route_costs.save(facts, measured, share, refused=why or "")
    kept = f", kept in {path}" if path else ""
    if why is not None:
        log(f"route costs from {what} refused: {why} (timed: {describe(measured)}{kept}; {AGAIN}); both plans "
            f"are priced alike until traffic measures them: {route.describe()}")
    else:
        log(f"route costs from {what}{kept}: {route.describe()}")


def describe(measured: list) -> str:
    """'fast 7.9/13.1/30.2 ms at 1/8/32 rows, invariant ...'"""
    out = []
    for kind in (PlanKind.FAST.value, PlanKind.INVARIANT.value):
        points = sorted((rows, seconds) for k, rows, seconds in measured if k == kind)
        out.append(f"{kind} {'/'.join(f'{s * 1e3:.1f}' for _, s in points)} ms at "
                   f"{'/'.join(str(r) for r, _ in points)} rows")
    return ", ".join(out)


def _cpu_share(run: Callable, threads: int) -> tuple:
    """(run(), the share of the CPU time `threads` threads could have had that this
    process got meanwhile; None where threads is 0)."""
    cpu, wall = time.process_time(), time.perf_counter()
    result = run()
    wall = time.perf_counter() - wall
    return result, (time.process_time() - cpu) / (wall * threads) if threads and wall > 0 else None


def _quiet(share) -> bool:
    return share is None or share >= QUIET_SHARE


def _observe(route, measured: list) -> None:
    for kind, rows, seconds in measured:
        route.observe_pass(kind, rows, seconds)


def _line_fit(points: list) -> tuple:
    """(base, per_row): least squares over (rows, seconds); one row count: all base."""
    n = len(points)
    mean_r = sum(r for r, _ in points) / n
    mean_s = sum(s for _, s in points) / n
    spread = sum((r - mean_r) ** 2 for r, _ in points)
    if spread == 0:
        return mean_s, 0.0
    per_row = sum((r - mean_r) * (s - mean_s) for r, s in points) / spread
    return mean_s - per_row * mean_r, per_row


def _group_fit(points: list, group_rows: int) -> float:
    """Seconds per row group: least squares through zero over (groups, seconds)."""
    groups = [(-(-r // group_rows), s) for r, s in points]
    return sum(g * s for g, s in groups) / sum(g * g for g, _ in groups)


def _ms(seconds: float, digits: int = 1) -> str:
    return f"{seconds * 1e3:.{digits}f} ms"


def decode_pass_timer(runner, blocks, context: int = CONTEXT) -> Callable[[PlanKind, int], float]:
    """time_pass for price_plans: one decode pass of `rows` throwaway sequences, each
    decoding position context - 1 (attention reads `context` keys), through the runner
    and timed as a step's pass is (rows, the plan's forward, the lm_head, sampling).
    The sequences share the blocks of their earlier positions, which are only read,
    and each writes its own last block. Every block comes from the free list and goes
    back unregistered, so the KV accounting and the prefix cache are as before."""
    bs = blocks.block_size

    def time_pass(kind: PlanKind, rows: int) -> float:
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
