"""The open-connection count of one listener (the HTTP front, /metrics, the gRPC
accept gate), and its log of the connections it turned away: at most one line a
minute, with the counts since the last one."""
from __future__ import annotations

import time

from gateeng.logs import LOGGER

log = LOGGER.getChild("connections")
LOG_EVERY_S = 60.0


class Admission:
    """Touched only from the listener's own event loop. `admit` takes a slot or says
    no; `release` gives one back. A listener that makes room by closing a connection
    that has not spoken yet (the gRPC gate) says so with `evicted`."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit, self.open = name, limit, 0
        self.refused = self.evicted = 0               # since start
        self._refused_since_log = self._evicted_since_log = 0
        self.logged_at = -LOG_EVERY_S

    def admit(self) -> bool:
        if self.open < self.limit:
            self.open += 1
            return True
        return False

    def refuse(self) -> None:
        self.refused += 1
        self._refused_since_log += 1
        self._maybe_log()

    def evicted_one(self) -> None:
        self.evicted += 1
        self._evicted_since_log += 1
        self._maybe_log()

    def release(self) -> None:
        self.open -= 1

    def _maybe_log(self) -> None:
        now = time.monotonic()
        if now - self.logged_at < LOG_EVERY_S:
            return
        evicted = (f", {self._evicted_since_log} silent one(s) closed to make room"
                   if self._evicted_since_log else "")
        log.warning("%s: %d connection(s) refused%s in the last %.0f s: %d are open, the limit "
                    "(--%s-max-connections)", self.name, self._refused_since_log, evicted,
                    min(now - self.logged_at, LOG_EVERY_S), self.open, self.name)
        self.logged_at, self._refused_since_log, self._evicted_since_log = now, 0, 0
