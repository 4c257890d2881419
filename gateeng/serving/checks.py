"""The request checks both fronts share, after each has read its own wire format:
the bounds on stop strings and messages, and the determinism field. Every
refusal is a BadRequest whose message names the field and what is allowed
(refusals.from_engine makes it INVALID_ARGUMENT / HTTP 400).
"""
from __future__ import annotations

import math
from typing import Optional

from gateeng.config import GateBounds
from gateeng.request import DeterminismParams, Mode, StreamPolicy

MAX_REQUEST_ID_BYTES = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_BYTES = 256
MAX_STOP_TOKEN_IDS = 64
MAX_MESSAGES = 256


class BadRequest(ValueError):
    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


def stop_strings(stop: tuple, field: str = "sampling.stop") -> tuple:
    """At most MAX_STOP_STRINGS strings of at most MAX_STOP_STRING_BYTES bytes."""
    if len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"{field} has {len(stop)} strings; at most {MAX_STOP_STRINGS}", param=field)
    for s in stop:
        if len(s.encode()) > MAX_STOP_STRING_BYTES:
            raise BadRequest(f"a {field} string is {len(s.encode())} bytes; at most {MAX_STOP_STRING_BYTES}",
                             param=field)
    return tuple(stop)


def determinism(mode: Mode, tau: Optional[float], window: Optional[int], stream_policy: StreamPolicy,
                bounds: GateBounds) -> DeterminismParams:
    """A request's determinism, with its gate overrides checked against the server's
    bounds: tau a finite number >= 0, W an integer, both within GateBounds."""
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))):
        raise BadRequest("determinism.margin_threshold must be a number", param="determinism")
    if tau is not None and not math.isfinite(tau):
        raise BadRequest(f"determinism.margin_threshold must be a finite number >= 0, got {tau}",
                         param="determinism")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int)):
        raise BadRequest("determinism.max_window must be an integer", param="determinism")
    try:
        bounds.check(tau, window)
    except ValueError as e:
        raise BadRequest(str(e), param="determinism") from None
    return DeterminismParams(mode=mode, margin_threshold=tau, max_window=window, stream_policy=stream_policy)
