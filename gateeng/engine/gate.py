"""The margin gate: decide, per VERIFIED fast-path token, whether to verify now.

A pure function of the step result and the request's options, so it is testable
without a model. Reasons are checked in a fixed order and one reason is counted
per trigger.
"""
from __future__ import annotations

from typing import Optional

from gateeng.request import Reason


def margin_triggers(margin: float, tau: float) -> bool:
    """An exact tie (margin 0) always triggers, even with tau = 0, because the two
    plans may break it differently. A NaN margin triggers too."""
    return not (margin >= tau) or margin <= 0.0   # NaN fails ">="


def decide(margin: float, num_unverified: int, would_finish: bool, tau: float, window: int) -> Optional[Reason]:
    """Return the trigger reason, or None to keep decoding on the fast path."""
    if margin_triggers(margin, tau):
        return Reason.MARGIN
    if would_finish:
        # The verifier's token may differ and un-finish the request.
        return Reason.FINISH
    if num_unverified >= window:
        return Reason.WINDOW
    return None
