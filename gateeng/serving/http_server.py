"""An HTTP listener with bounded connections: uvicorn serving one ASGI app on a
thread and event loop of its own. The OpenAI front and the /metrics endpoint each
run on one.

Every connection is bounded before it is held (ConnectionLimits):
- at most `max_connections` open at once; one past it is answered a bare 503 and
  closed at once (no parsing, no task, no traceback), and the refusals are logged
  at most once a minute with their count;
- a connection must deliver a request's headers within `header_timeout_s` of
  opening, or of starting the next request on a kept-alive connection, or it is
  closed (a client that sends nothing, or trickles its headers, holds no slot);
- an idle kept-alive connection is closed after `keep_alive_timeout_s`.
The body's own deadline and size are the app's (it alone knows the limit); the
headers' size is h11's (16 KiB by default).
"""
from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import threading
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateeng.config import ConnectionLimits
from gateeng.logs import LOGGER

log = LOGGER.getChild("http")
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
           b"Retry-After: 1\r\nContent-Length: 29\r\n\r\ntoo many connections; retry\r\n")
HEADER_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")
LOG_EVERY_S = 60.0


def ensure_descriptors(needed: int) -> int:
    """Raise the soft open-file limit to `needed` where the hard limit allows, so that
    the listeners at their connection limits still leave gRPC, health and the model's
    files their descriptors; refuse to start (ValueError) where it does not. Returns
    the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < needed:
        if hard != resource.RLIM_INFINITY and hard < needed:
            raise ValueError(f"the connection limits need {needed} open files (the HTTP and metrics "
                             f"max-connections plus a reserve for gRPC and the model's files), but the hard "
                             f"limit is {hard}: lower --http-max-connections or raise `ulimit -n`")
        resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
        log.info("raised the open-file limit from %d to %d for the connection limits", soft, needed)
        soft = needed
    return soft


class _Admission:
    """The open-connection count of one listener, and its refusal log. Touched only
    from the listener's own event loop."""

    def __init__(self, name: str, limit: int):
        self.name, self.limit, self.open = name, limit, 0
        self.refused, self.refused_since_log, self.logged_at = 0, 0, -LOG_EVERY_S

    def admit(self) -> bool:
        if self.open < self.limit:
            self.open += 1
            return True
        self.refused += 1
        self.refused_since_log += 1
        now = time.monotonic()
        if now - self.logged_at >= LOG_EVERY_S:
            log.warning("%s: %d connection(s) refused in the last %.0f s: %d are open, the limit "
                        "(--%s-max-connections)", self.name, self.refused_since_log,
                        min(now - self.logged_at, LOG_EVERY_S), self.open, self.name)
            self.logged_at, self.refused_since_log = now, 0
        return False

    def release(self) -> None:
        self.open -= 1


def _protocol(admission: _Admission, header_timeout_s: float):
    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with admission and a header deadline."""
        admitted = False
        header_timer = None

        def connection_made(self, transport):
            if not admission.admit():
                self.transport = transport
                transport.write(REFUSED)
                transport.close()
                return
            self.admitted = True
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc):
            if not self.admitted:
                return
            self.admitted = False
            admission.release()
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data):
            if not self.admitted:
                return
            between = self.cycle is None or self.cycle.response_complete
            before = self.cycle
            super().data_received(data)
            if self.cycle is not before:        # a request's headers arrived whole
                self._disarm()
            elif between and self.header_timer is None:
                self._arm()                     # the next request on a kept-alive connection began

        def _arm(self):
            self.header_timer = self.loop.call_later(header_timeout_s, self._headers_late)

        def _disarm(self):
            if self.header_timer is not None:
                self.header_timer.cancel()
                self.header_timer = None

        def _headers_late(self):
            self.header_timer = None
            if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(HEADER_TIMEOUT)
                self.transport.close()

    return BoundedH11Protocol


class HttpServer:
    """uvicorn serving `app` on a thread and event loop of its own, so that what HTTP
    costs a loop (reading and parsing large JSON bodies, slow clients) never delays
    gRPC calls and health checks, whose loop is the server's. The socket is bound at
    construction (so `port` is known); `start` begins serving. Signals stay with the
    gRPC server, which drains everything."""

    def __init__(self, app, host: str, port: int, limits: ConnectionLimits, name: str):
        class _Server(uvicorn.Server):
            def capture_signals(self):       # the gateeng Server owns SIGTERM / SIGINT
                return contextlib.nullcontext()

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.admission = _Admission(name, limits.max_connections)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                                http=_protocol(self.admission, limits.header_timeout_s),
                                timeout_keep_alive=limits.keep_alive_timeout_s)
        self.server = _Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])),
                                       name=f"gateeng-{name}", daemon=True)

    def start(self) -> None:
        self.thread.start()

    async def stop(self) -> None:
        """Stop accepting, let the answers in progress finish (at most
        timeout_graceful_shutdown), and wait for the thread to end."""
        self.server.should_exit = True
        if self.thread.is_alive():
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join)
