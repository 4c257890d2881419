"""The step contract: what the scheduler plans for one step (StepPlan, one
ScheduledSeq per request) and what compute returns for it (one SeqOutput per
scheduled request). The scheduler writes plans, the runner reads them and writes
outputs, the verification stage reads both; none of them imports another for it.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Optional

from gateeng import config
from gateeng.config import SPECULATIVE
from gateeng.request import Mode, Request

__all__ = ["PlanKind", "ScheduledSeq", "StepPlan", "SeqOutput"]


class PlanKind(enum.Enum):
    """Which plan computes a scheduled sequence: the fast one, or the invariant one."""
    FAST = config.FAST
    INVARIANT = config.INVARIANT


@dataclass(frozen=True)
class ScheduledSeq:
    """One request's share of a step, fixed when the step is planned (later updates
    to the request do not change it)."""
    request: Request
    start: int           # first position to compute
    end: int             # one past the last position
    kind: PlanKind
    replay: bool = False  # verify pass: a prediction for every row
    sample_rows: tuple = ()   # row offsets within the chunk that need a sampled token
    route: Optional[str] = None   # VERIFIED decodes: SPECULATIVE or DIRECT

    @classmethod
    def plan(cls, req: Request, start: int, end: int, kind: PlanKind, replay: bool = False,
             route: Optional[str] = None) -> "ScheduledSeq":
        if replay:
            rows = tuple(range(end - start))
        else:
            rows = (end - start - 1,) if end == len(req.tokens) else ()
        if route is None and req.mode is Mode.VERIFIED and kind is PlanKind.FAST and rows:
            route = SPECULATIVE
        return cls(req, start, end, kind, replay, rows, route)

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def decode(self) -> bool:
        """Samples one new token after the prompt (not a prefill chunk, not a replay)."""
        return bool(self.sample_rows) and not self.replay and self.start >= self.request.num_prompt


@dataclass
class StepPlan:
    seqs: list = field(default_factory=list)

    def of_kind(self, kind: PlanKind) -> list:
        return [s for s in self.seqs if s.kind is kind]


@dataclass(frozen=True)
class SeqOutput:
    """What the runner returns for one scheduled sequence: immutable, so observers
    may keep it. logprobs: a sampler.Logprobs per token where the request asked
    for them, else empty."""
    tokens: tuple
    margins: tuple
    logprobs: tuple = ()
    prompt_logprobs: tuple = ()   # for prompt tokens this chunk predicts, in order
    # A mixture of experts: per token, the smallest router margin (k-th minus (k+1)-th
    # ranking score) over the routing layers, in the plan's arithmetic; () for a dense model.
    router_margins: tuple = ()
