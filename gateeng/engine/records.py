"""Plain records that cross from the engine thread to observers (metrics, the
server). They are built once per step from the plan, the runner's output and the
scheduler's state after update, and nothing changes them afterwards, so an
observer on another thread never reads live engine state.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gateeng.config import DIRECT
from gateeng.engine import gate
from gateeng.request import DeterminismStats, Mode

# A mismatch is attributed to the trigger that caught it, or to the direct route
# when the policy moved a request with unverified tokens onto the invariant plan.
MISMATCH_REASONS = gate.REASONS + (DIRECT,)


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
class StepRecord:
    seqs: tuple                   # SeqRecord per scheduled sequence
    counted: DeterminismStats     # the verification stage's increments to VERIFIED counters this step, summed
    mismatches: tuple             # (trigger reason, fast margin of the wrong token)
    plan_seconds: dict            # "fast" / "invariant" -> seconds of that plan's pass
    counts: Counts
