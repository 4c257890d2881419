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
- an idle kept-alive connection is closed after `keep_alive_timeout_s`;
- the loop takes at most config.ACCEPTS_PER_PASS connections from the kernel's queue
  per pass, so a flood holds at most that many descriptors beyond the limit (asyncio
  takes its server's `backlog` per pass, and lists the socket with it: the socket is
  listed again with LISTEN_BACKLOG once uvicorn has started).
The body's own deadline and size are the app's (it alone knows the limit); the
headers' size is h11's (16 KiB by default). With TLS (the OpenAI front with
--ssl-certfile), a connection is admitted before its handshake, which must end
within the header deadline: one that never finishes it holds no more than one that
sends nothing, and one past the limit costs no handshake.
"""
from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import ssl
import threading
from typing import Optional

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from gateeng.config import ACCEPTS_PER_PASS, LISTEN_BACKLOG, ConnectionLimits
from gateeng.logs import LOGGER
from gateeng.serving.admission import Admission

log = LOGGER.getChild("http")
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
           b"Retry-After: 1\r\nContent-Length: 29\r\n\r\ntoo many connections; retry\r\n")
HEADER_TIMEOUT = (b"HTTP/1.1 408 Request Timeout\r\nConnection: close\r\nContent-Length: 0\r\n\r\n")


def ensure_descriptors(needed: int) -> int:
    """Raise the soft open-file limit toward `needed`, as far as the hard limit allows,
    so that the listeners at their connection limits still leave each other, health and
    the model's files their descriptors. Returns the soft limit now in force: below
    `needed` where the hard limit is (ServerConfig.fitted then lowers the limits)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return needed if soft == resource.RLIM_INFINITY else soft
    target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
    if target > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        log.info("raised the open-file limit from %d to %d for the connection limits", soft, target)
    return target


def _protocol(admission: Admission, header_timeout_s: float, tls: Optional[ssl.SSLContext]):
    class BoundedH11Protocol(H11Protocol):
        """uvicorn's h11 protocol with admission and a header deadline; with `tls`, the
        TLS handshake runs after admission and within the header deadline, so a client
        that never finishes it holds no more than one that sends nothing."""
        admitted = False
        header_timer = None
        early = None     # TLS: bytes read after the handshake, before h11 had the connection

        def connection_made(self, transport):
            if not admission.admit():
                admission.refuse()
                self.transport = transport
                if tls is None:
                    transport.write(REFUSED)
                    transport.close()
                else:
                    transport.abort()           # no handshake for a connection past the limit
                return
            self.admitted = True
            if tls is None:
                super().connection_made(transport)
            else:
                self.transport, self.early = transport, []
                self.handshake = self.loop.create_task(self._handshake(transport))
            self._arm()

        async def _handshake(self, raw):
            try:
                secure = await self.loop.start_tls(raw, self, tls, server_side=True,
                                                   ssl_handshake_timeout=header_timeout_s,
                                                   ssl_shutdown_timeout=header_timeout_s)
            except (OSError, ssl.SSLError, asyncio.TimeoutError, ConnectionError, RuntimeError):
                raw.abort()
                self._lost_in_handshake()
                return
            early, self.early = self.early, None
            if not self.admitted:
                secure.abort()
                return
            super().connection_made(secure)
            for data in early:
                self.data_received(data)

        def _lost_in_handshake(self):
            if self.admitted:
                self.admitted = False
                admission.release()
                self._disarm()

        def connection_lost(self, exc):
            if self.early is not None:          # before or during the TLS handshake
                self._lost_in_handshake()
                return
            if not self.admitted:
                return
            self.admitted = False
            admission.release()
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data):
            if self.early is not None:
                self.early.append(data)
                return
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
            if self.early is not None:          # the TLS handshake is not done: nothing to answer
                self.transport.abort()
                self._lost_in_handshake()
            elif not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
                self.transport.write(HEADER_TIMEOUT)
                self.transport.close()

    return BoundedH11Protocol


class HttpServer:
    """uvicorn serving `app` on a thread and event loop of its own, so that what HTTP
    costs a loop (reading and parsing large JSON bodies, slow clients) never delays
    gRPC calls and health checks, whose loop is the server's. The socket is bound at
    construction (so `port` is known); `start` begins serving. Signals stay with the
    gRPC server, which drains everything."""

    def __init__(self, app, host: str, port: int, limits: ConnectionLimits, name: str,
                 tls: Optional[ssl.SSLContext] = None):
        class _Server(uvicorn.Server):
            def capture_signals(self):       # the gateeng Server owns SIGTERM / SIGINT
                return contextlib.nullcontext()

            async def startup(self, sockets=None):
                await super().startup(sockets=sockets)
                for sock in sockets or ():
                    sock.listen(LISTEN_BACKLOG)   # the kernel's queue; asyncio still takes backlog per pass

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.admission = Admission(name, limits.max_connections)
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=5,
                                http=_protocol(self.admission, limits.header_timeout_s, tls),
                                timeout_keep_alive=limits.keep_alive_timeout_s,
                                backlog=ACCEPTS_PER_PASS)
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
