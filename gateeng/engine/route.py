"""The route of each VERIFIED decode: speculative or direct, chosen per step.

Both routes give the reference bits, because the invariant plan is row-invariant:
  speculative: decode on the fast plan, the gate decides when to replay the
    unverified tokens on the invariant plan (one extra pass then);
  direct: replay the unverified tokens and decode the next one on the invariant
    plan now (no fast row, and no later replay).
The adaptive policy compares the step's cost under a few assignments, from
measured per-plan pass costs (fast: seconds as a linear function of rows;
invariant: seconds per row group where the plan pads to groups, else linear in
rows like the fast plan) and the measured trigger rate, and picks the cheapest.
Every VERIFIED token costs one invariant row on either route (a speculated token
is replayed), so the routes differ in padding, pass overhead and fast rows:
direct wins when an invariant pass runs this step anyway and has room (its
padding rows are paid for), or when most of the batch is VERIFIED (the fast pass
disappears); speculative wins for a VERIFIED minority, whose tokens are then
replayed several to a row group instead of opening a group per step. OFF
sequences (decodes and prefill chunks) may run on either plan (they promise
nothing about their bits), so the adaptive policy also moves them into a step's
invariant pass where that is cheaper (`off_to_move`). Pure Python; the engine
feeds it measurements.
"""
from __future__ import annotations

from typing import Optional

from gateeng.config import ADAPTIVE, DIRECT, ROUTE_POLICIES, SPECULATIVE
from gateeng.step import PlanKind

DIRECT_PREFERENCE = 0.05   # relative cost margin within which direct is preferred


class CostModel:
    """seconds ~ base + per_row * rows, fitted online by recursive least squares
    with forgetting, starting from a prior; 0 rows cost nothing. The fit runs in
    milliseconds, where a pass's timing noise is of order one unit (the unit
    variance RLS assumes).

    A shared host now and then stalls a pass for several times its cost. Plain
    least squares follows such an outlier: one 80 ms pass where 28 ms was usual
    turned the fit from 12 ms + 0.8 ms per row into -32 ms + 3.1 ms per row, and a
    steady row count corrects the slope only slowly, so the route policy priced
    rows wrong for many steps. Once `WARM_UP` passes are in (the prior may be far
    off), a pass's residual is therefore bounded by `CLIP` of its predicted cost
    (Huber-style; the same outlier then leaves 6 ms + 1.1 ms per row); a real
    change of cost still comes through, over a few more passes. And every update
    keeps base >= 0 and per_row >= 0 (`_nonnegative`)."""

    WARM_UP = 8
    CLIP = 0.25

    def __init__(self, base: float, per_row: float, forget: float = 0.97):
        self.theta = [base, per_row]   # seconds
        self.p = [[1e4, 0.0], [0.0, 1e2]]   # prior spread (ms^2): 100 ms on the base, 10 ms per row
        self.forget = forget
        self.seen = 0

    def cost(self, rows: int) -> float:
        return 0.0 if rows <= 0 else max(0.0, self.theta[0] + self.theta[1] * rows)

    def describe(self) -> str:
        return f"{self.theta[0] * 1e3:.1f} ms + {self.theta[1] * 1e3:.2f} ms/row"

    def observe(self, rows: int, seconds: float) -> None:
        self.theta = [t * 1e3 for t in self.theta]
        self._update(rows, seconds * 1e3)
        self.theta = [t * 1e-3 for t in self.theta]

    def _update(self, rows: int, y: float) -> None:
        x = (1.0, float(rows))
        p, lam = self.p, self.forget
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = lam + x[0] * px[0] + x[1] * px[1]
        k = (px[0] / denom, px[1] / denom)
        predicted = self.theta[0] + self.theta[1] * x[1]
        err = y - predicted
        self.seen += 1
        if self.seen > self.WARM_UP:
            bound = self.CLIP * max(abs(predicted), 1.0)   # at least 1 ms: the unit of the fit
            err = min(max(err, -bound), bound)
        self.theta = _nonnegative([self.theta[0] + k[0] * err, self.theta[1] + k[1] * err], x[1])
        self.p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(2)] for i in range(2)]
        # Bound the covariance: with constant row counts one direction is never
        # excited, and forgetting would otherwise blow it up.
        self.p = [[min(max(v, -1e4), 1e4) for v in row] for row in self.p]


def _nonnegative(theta: list, rows: float) -> list:
    """theta with base >= 0 and per_row >= 0, the invariant every update of a CostModel
    keeps: a pass never costs less than nothing, nor less for more rows. Least squares
    over a few steady row counts can leave it (a stall, then one row count for a
    while, had fitted -32 ms + 3.1 ms per row), and a plan priced below its cost at
    small row counts draws work it cannot do for as long as traffic keeps away the
    row counts that would correct it. Where it is left, the fit's cost at the rows
    just observed, where the evidence is, is kept and carried by the other parameter
    alone."""
    base, per_row = theta
    if base >= 0 and per_row >= 0:
        return theta
    here = max(0.0, base + per_row * rows)
    if per_row < 0 or rows <= 0:
        return [here, 0.0]
    return [0.0, here / rows]


class GroupCost:
    """seconds ~ per_group * groups, for the invariant plan: each row group re-reads
    every weight, so the cost is proportional to the groups (measured: 134 ms for
    2 groups, 317 ms for 5, on an AVX-512 BF16 CPU) and one exponential average
    identifies it from any pass. Until the first pass is measured, `prior()` gives
    the cost of a group (the first measurement then replaces it)."""

    def __init__(self, per_group: Optional[float], group_rows: int, weight: float = 0.2, prior=None):
        self.per_group = per_group   # None: not measured yet
        self.group_rows = group_rows
        self.weight = weight
        self.prior = prior
        self.seen = 0   # passes observed

    def groups(self, rows: int) -> int:
        return -(-rows // self.group_rows)

    def group_cost(self) -> float:
        return self.per_group if self.per_group is not None else self.prior()

    def cost(self, rows: int) -> float:
        return self.groups(rows) * self.group_cost()

    def row_cost(self) -> float:
        """What one more row costs, averaged over a group."""
        return self.group_cost() / self.group_rows

    def opening_cost(self) -> float:
        """What a pass opened for a few rows costs beyond them: half a group of padding."""
        return self.group_cost() / 2

    def room(self, rows: int) -> int:
        """Padding rows a pass of `rows` rows has free."""
        return self.groups(rows) * self.group_rows - rows

    def describe(self) -> str:
        return f"{self.group_cost() * 1e3:.1f} ms per {self.group_rows}-row group"

    def observe(self, rows: int, seconds: float) -> None:
        if rows > 0:
            self.seen += 1
            per = seconds / self.groups(rows)   # >= 0: an average of these never goes negative
            self.per_group = per if self.per_group is None else self.per_group + self.weight * (per - self.per_group)


class PassCost(CostModel):
    """seconds ~ base + per_row * rows for an invariant plan without row groups (its
    kernels are row-invariant at any row count): priced like the fast plan, whose
    prior it starts from. No padding, so no room."""

    def row_cost(self) -> float:
        return max(0.0, self.theta[1])

    def opening_cost(self) -> float:
        return max(0.0, self.theta[0])

    @staticmethod
    def room(rows: int) -> int:
        return 0


class RoutePolicy:
    def __init__(self, mode: str = ADAPTIVE, group_rows: int = 1, fast: Optional[CostModel] = None,
                 invariant=None, trigger_rate: float = 0.15, replay_delay: int = 0):
        """group_rows: the invariant plan's padded row group, or 0 when it runs on
        its real rows only (then its passes are priced as base + per row)."""
        if mode not in ROUTE_POLICIES:
            raise ValueError(f"verified route must be one of {', '.join(ROUTE_POLICIES)}, got {mode!r}")
        self.mode = mode
        self.group_rows = max(0, group_rows)
        # Priors until the first passes are measured. An invariant pass is assumed to
        # cost what a fast pass of as many rows costs (on CPU both plans run the same
        # kernels but for the matmul, bench/step_profile.py): a guess that sends
        # decodes direct is corrected by the very next step's measurement, whereas one
        # that keeps them speculative would be corrected only by the replay passes,
        # several steps apart.
        self.fast = fast or CostModel(0.02, 0.001)
        if invariant is not None:
            self.invariant = invariant
        elif self.group_rows:
            self.invariant = GroupCost(None, self.group_rows, prior=lambda: self.fast.cost(self.group_rows))
        else:
            self.invariant = PassCost(*self.fast.theta)
        self.trigger_rate = trigger_rate
        self.replay_delay = replay_delay   # the scheduler's max_verify_delay

    # ---- measurements ----------------------------------------------------------
    def observe_pass(self, kind: str, rows: int, seconds: float) -> None:
        if kind == PlanKind.FAST.value:
            self.fast.observe(rows, seconds)
        else:
            self.invariant.observe(rows, seconds)

    def observe_speculation(self, tokens: int, triggers: int, weight: float = 0.05) -> None:
        """Exponential average of gate triggers per speculated token."""
        if tokens:
            self.trigger_rate += weight * min(1.0, tokens / 8) * (triggers / tokens - self.trigger_rate)

    def describe(self) -> str:
        return f"fast {self.fast.describe()}, invariant {self.invariant.describe()}"

    # ---- the choice --------------------------------------------------------------
    def step_cost(self, fast_rows: int, inv_rows: int, speculative: int) -> float:
        """A step's estimated cost: both passes, plus what the speculated tokens will
        cost later. Every speculated token is replayed once (one invariant row), and
        the replays need a pass of their own: replays of different requests share
        one, and a margin-triggered replay may wait `replay_delay` steps for others,
        so half a group of padding rows is paid once per 1 + replay_delay steps in
        which any of them triggers."""
        cost = self.fast.cost(fast_rows) + self.invariant.cost(inv_rows)
        if speculative:
            span = 1 + self.replay_delay
            p_pass = 1.0 - (1.0 - min(self.trigger_rate, 1.0)) ** (speculative * span)
            cost += speculative * self.invariant.row_cost() + p_pass / span * self.invariant.opening_cost()
        return cost

    def off_to_move(self, fast_rows: int, inv_rows: int, off_rows: tuple) -> int:
        """How many of the step's OFF sequences on the fast plan (decodes and prefill
        chunks; `off_rows` holds their rows, in the order they would move) to run on
        the step's invariant pass instead. OFF promises nothing about its bits, so
        either plan serves it; an invariant pass that runs anyway has padding rows
        paid for, and when every fast row moves, the fast pass disappears.
        Candidates: none, the longest prefix that fits the padding, all."""
        return self._off_move(fast_rows, inv_rows, off_rows)[0]

    def _off_move(self, fast_rows: int, inv_rows: int, off_rows: tuple) -> tuple:
        """off_to_move's count, and the rows those sequences take along."""
        if self.mode != ADAPTIVE or not inv_rows or not off_rows:
            return 0, 0
        room, fit, used = self.invariant.room(inv_rows), 0, 0
        while fit < len(off_rows) and used + off_rows[fit] <= room:
            used += off_rows[fit]
            fit += 1
        moved = {0: 0, fit: used, len(off_rows): sum(off_rows)}   # k sequences -> their rows

        def cost(k: int) -> float:
            return self.fast.cost(fast_rows - moved[k]) + self.invariant.cost(inv_rows + moved[k])
        k = min(moved, key=lambda k: (cost(k), k))
        return k, moved[k]

    def _with_off(self, fast_rows: int, inv_rows: int, off_rows: tuple) -> tuple:
        rows = self._off_move(fast_rows, inv_rows, off_rows)[1]
        return fast_rows - rows, inv_rows + rows

    def choose(self, fast_rows: int, inv_rows: int, direct_rows: list, budget: int,
               waiting_rows: tuple = (), off_rows: tuple = ()) -> list:
        """Which of the step's speculative VERIFIED decodes go direct.

        fast_rows / inv_rows: the step's rows on each plan as planned (every
        candidate's and waiting replay's one fast row included); direct_rows: rows
        each candidate needs on the direct route; waiting_rows: the same for
        requests whose margin-triggered replay is waiting, which the scheduler
        moves into any invariant pass the step ends up with; off_rows: the rows of
        the OFF sequences on the fast plan, which then may move too (off_to_move);
        budget: token budget left this step.
        """
        n = len(direct_rows)
        if self.mode == SPECULATIVE or not n:
            return [False] * n
        order = sorted(range(n), key=lambda i: direct_rows[i])
        moved = [0]   # rows the k shortest candidates take onto the invariant plan
        for i in order:
            moved.append(moved[-1] + direct_rows[i])

        def cost(k: int) -> float:
            fast, inv, spec = fast_rows - k, inv_rows + moved[k], n - k
            if inv and waiting_rows:   # the waiting replays join, dropping their fast rows
                fast, inv = fast - len(waiting_rows), inv + sum(waiting_rows)
            else:
                spec += len(waiting_rows)
            fast, inv = self._with_off(fast, inv, off_rows)
            return self.step_cost(fast, inv, spec)

        # Prefixes, shortest replays first: k candidates direct, as many as the budget
        # allows. Direct also shortens VERIFIED latency (no wait for a replay), so the
        # largest k within DIRECT_PREFERENCE of the cheapest wins.
        costs, extra = [cost(0)], sum(w - 1 for w in waiting_rows)
        for i in order:
            extra += direct_rows[i] - 1
            if extra > budget:
                break
            costs.append(cost(len(costs)))
        if self.mode == DIRECT:
            best_k = len(costs) - 1
        else:
            cheapest = min(costs)
            best_k = max(k for k, c in enumerate(costs) if c <= cheapest * (1 + DIRECT_PREFERENCE))
        chosen = set(order[:best_k])
        return [i in chosen for i in range(n)]
