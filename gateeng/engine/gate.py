"""The margin gate: decide, per VERIFIED fast-path token, whether to verify now.

A pure function of the step result and the request's options, so it is testable
without a model. Reasons are checked in a fixed order and one reason is counted
per trigger.
"""
from __future__ import annotations

import math
from typing import Optional

from gateeng.request import Reason


def margin_triggers(margin: float, tau: float) -> bool:
    """An exact tie (margin 0) always triggers, even with tau = 0, because the two
    plans may break it differently. A NaN margin triggers too."""
    return not (margin >= tau) or margin <= 0.0   # NaN fails ">="


def decide(margin: float, num_unverified: int, would_finish: bool, tau: float, window: int,
           router_margin: float = math.inf, router_tau: float = 0.0) -> Optional[Reason]:
    """Return the trigger reason, or None to keep decoding on the fast path.
    `router_margin`: a mixture of experts' smallest router margin of the token's
    forward (inf for a dense model); within `router_tau` (or a tie) the fast path may
    have chosen other experts than the reference."""
    if margin_triggers(margin, tau):
        return Reason.MARGIN
    if margin_triggers(router_margin, router_tau):
        return Reason.ROUTER
    if would_finish:
        # The verifier's token may differ and un-finish the request.
        return Reason.FINISH
    if num_unverified >= window:
        return Reason.WINDOW
    return None
