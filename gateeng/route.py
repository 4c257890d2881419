"""The route of each VERIFIED decode: speculative or direct, chosen per step.

Both routes give the reference bits, because the invariant plan is row-invariant:
  speculative: decode on the fast plan, the gate decides when to replay the
    unverified tokens on the invariant plan (one extra pass then);
  direct: replay the unverified tokens and decode the next one on the invariant
    plan now (no fast row, and no later replay).
The adaptive policy compares the step's cost under a few assignments, from
measured per-plan pass costs (seconds as a linear function of rows; invariant
rows count in whole groups) and the measured trigger rate, and picks the
cheapest. Direct wins when an invariant pass runs this step anyway and has room
(padding rows are paid for already), or when most of the batch is VERIFIED (the
fast pass disappears); speculative wins when a direct decode would add an
invariant pass of its own. Pure Python; the engine feeds it measurements.
"""
from __future__ import annotations

from typing import Optional

ROUTES = ("adaptive", "speculative", "direct")


class CostModel:
    """seconds ~ base + per_row * rows, fitted online by recursive least squares
    with forgetting, starting from a prior; 0 rows cost nothing."""

    def __init__(self, base: float, per_row: float, forget: float = 0.97):
        self.theta = [base, per_row]
        self.p = [[1e-2, 0.0], [0.0, 1e-4]]   # prior spread: 0.1 s on the base, 0.01 s per row
        self.forget = forget

    def cost(self, rows: int) -> float:
        return 0.0 if rows <= 0 else max(0.0, self.theta[0] + self.theta[1] * rows)

    def observe(self, rows: int, seconds: float) -> None:
        x = (1.0, float(rows))
        p, lam = self.p, self.forget
        px = (p[0][0] * x[0] + p[0][1] * x[1], p[1][0] * x[0] + p[1][1] * x[1])
        denom = lam + x[0] * px[0] + x[1] * px[1]
        k = (px[0] / denom, px[1] / denom)
        err = seconds - (self.theta[0] + self.theta[1] * x[1])
        self.theta = [self.theta[0] + k[0] * err, self.theta[1] + k[1] * err]
        self.p = [[(p[i][j] - k[i] * px[j]) / lam for j in range(2)] for i in range(2)]
        # Bound the covariance: with constant row counts one direction is never
        # excited, and forgetting would otherwise blow it up.
        self.p = [[min(max(v, -1.0), 1.0) for v in row] for row in self.p]


class RoutePolicy:
    def __init__(self, mode: str = "adaptive", group_rows: int = 1, fast: Optional[CostModel] = None,
                 invariant: Optional[CostModel] = None, trigger_rate: float = 0.15, replay_delay: int = 0):
        if mode not in ROUTES:
            raise ValueError(f"verified route must be one of {', '.join(ROUTES)}, got {mode!r}")
        self.mode = mode
        self.group_rows = max(1, group_rows)
        # Priors (seconds) until the first passes are measured: an invariant pass costs
        # more per row than a fast one, so a lone VERIFIED request starts speculative.
        self.fast = fast or CostModel(0.02, 0.001)
        self.invariant = invariant or CostModel(0.03, 0.002)
        self.trigger_rate = trigger_rate
        self.replay_delay = replay_delay   # the scheduler's max_verify_delay

    # ---- measurements ----------------------------------------------------------
    def observe_pass(self, kind: str, rows: int, seconds: float) -> None:
        if kind == "fast":
            self.fast.observe(rows, seconds)
        else:
            self.invariant.observe(self._padded(rows), seconds)

    def observe_speculation(self, tokens: int, triggers: int, weight: float = 0.05) -> None:
        """Exponential average of gate triggers per speculated token."""
        if tokens:
            self.trigger_rate += weight * min(1.0, tokens / 8) * (triggers / tokens - self.trigger_rate)

    # ---- the choice --------------------------------------------------------------
    def _padded(self, rows: int) -> int:
        return -(-rows // self.group_rows) * self.group_rows

    def step_cost(self, fast_rows: int, inv_rows: int, speculative: int) -> float:
        """A step's estimated cost: both passes, plus the share of a future replay
        pass the speculated tokens will need. Replays of different requests share
        a pass, and a margin-triggered one may wait `replay_delay` steps for others,
        so a pass is needed once per 1 + replay_delay steps in which any of them
        triggers."""
        span = 1 + self.replay_delay
        p_pass = 1.0 - (1.0 - min(self.trigger_rate, 1.0)) ** (speculative * span)
        replay = p_pass / span * self.invariant.cost(self.group_rows) if speculative else 0.0
        return self.fast.cost(fast_rows) + self.invariant.cost(self._padded(inv_rows)) + replay

    def choose(self, fast_rows: int, inv_rows: int, direct_rows: list, budget: int) -> list:
        """Which of the step's speculative VERIFIED decodes go direct.

        fast_rows / inv_rows: the step's rows on each plan as planned (the
        candidates' one fast row each included); direct_rows: rows each candidate
        needs on the direct route; budget: token budget left this step.
        """
        n = len(direct_rows)
        if self.mode == "speculative" or not n:
            return [False] * n
        order = sorted(range(n), key=lambda i: direct_rows[i])
        # Greedy prefixes, shortest replays first: take k candidates direct.
        best_k, best_cost, extra = 0, self.step_cost(fast_rows, inv_rows, n), 0
        for k, i in enumerate(order, start=1):
            extra += direct_rows[i] - 1
            if extra > budget:
                break
            moved = sum(direct_rows[j] for j in order[:k])
            cost = self.step_cost(fast_rows - k, inv_rows + moved, n - k)
            if self.mode == "direct" or cost < best_cost:
                best_k, best_cost = k, cost
        chosen = set(order[:best_k])
        return [i in chosen for i in range(n)]
