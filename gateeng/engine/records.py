"""Plain records that cross from the engine thread to observers (metrics, the
server). They are built once per step from the plan, the runner's output and the
scheduler's state after update, and nothing changes them afterwards, so an
observer on another thread never reads live engine state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateeng.request import DeterminismStats, Mode


@dataclass(frozen=True)
class Counts:
    """The scheduler's occupancy after a step (or after new requests arrived)."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    preemptions: int = 0          # since start


@dataclass(frozen=True)
class SeqRecord:
    request_id: str
    mode: Mode
    kind: str                     # "fast" | "invariant"
    replay: bool
    decode: bool                  # sampled one new token after the prompt
    margin: Optional[float]       # the sampled token's margin (last row)
    route: Optional[str] = None   # VERIFIED decodes: config.SPECULATIVE | config.DIRECT


@dataclass(frozen=True)
class PrefixLookup:
    """A request's first admission, whose prompt the prefix cache was asked for. A
    recompute after preemption looks again but is not counted (gateeng_preemptions_total
    counts those), so the hits add up to the answers' cached_tokens."""
    mode: Mode
    queried: int                  # prompt tokens looked up
    hit: int                      # of those, served from the cache (Completion.cached_tokens)


@dataclass(frozen=True)
class StepRecord:
    seqs: tuple                   # SeqRecord per scheduled sequence
    counted: DeterminismStats     # the verification stage's increments to VERIFIED counters this step, summed
    mismatches: tuple             # (request.Reason that replayed it, fast margin of the wrong token)
    plan_seconds: dict            # "fast" / "invariant" -> seconds of that plan's pass
    counts: Counts
    lookups: tuple = ()           # PrefixLookup per request admitted for the first time this step


@dataclass(frozen=True)
class RequestTimes:
    """A finished request's phases, on the engine's clock. Each phase is timed once the
    request reached it and ends where the next one begins (or at the finish), so
    queue + prefill + decode == e2e, and queue + prefill is the time to first token."""
    e2e: float                    # arrival to finish
    queue: float                  # arrival to first admission (to the finish, if never admitted)
    prefill: Optional[float]      # first admission to first token sent; None if never admitted
    decode: Optional[float]       # first token sent to finish; None if no token was sent

    @classmethod
    def between(cls, arrival: float, scheduled: Optional[float], first_token: Optional[float],
                finished: float) -> "RequestTimes":
        # A recompute after preemption stays inside the phase it interrupted.
        if scheduled is None:
            return cls(finished - arrival, finished - arrival, None, None)
        if first_token is None:
            return cls(finished - arrival, scheduled - arrival, finished - scheduled, None)
        return cls(finished - arrival, scheduled - arrival, first_token - scheduled, finished - first_token)
