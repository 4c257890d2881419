"""The gRPC listener's accept gate: gRPC's public port is ours, and every connection
is bounded before gRPC holds it.

gRPC's server counts no connections of ours and cannot be asked which of its
connections have not spoken yet, so the gate owns the listening socket, on a thread
and event loop of its own, and gRPC listens on a Unix socket in a private directory
that only the gate reaches:
- at most `max_connections` are open at once. One past it closes the oldest
  connection that has not yet sent its first bytes, if there is one (a client that
  sends nothing holds no slot a real client needs: a health probe, whose first bytes
  follow its connect at once, always gets in), else it is itself closed at once
  (no read, no task); both are counted and logged at most once a minute;
- the gate takes at most config.ACCEPTS_PER_PASS connections from the kernel's queue
  per pass of its loop and decides each one as it takes it, so a flood never holds
  more descriptors than the limit and one pass's worth (an asyncio server with the
  listen backlog gRPC needs would take 1,024 before deciding any: under a limit of
  1,024 open files it runs out, and the splice of a probe with it);
- a connection must send the HTTP/2 preface (with TLS: a TLS handshake record)
  within `handshake_timeout_s` of opening, or it is closed; anything else is closed
  at its first bytes. gRPC's own handshake timeout, the same value, then bounds the
  TLS handshake and HTTP/2 settings, and its idle timeout closes a connection with
  no call in flight for `idle_timeout_s` (grpc_api.grpc_options);
- an admitted connection is spliced byte for byte to gRPC's socket. The gate's end
  is bound to a name of its own (the client's address in it), so gRPC tells
  connections apart, as the Abort ownership rule needs.
Each open connection holds three descriptors (config.GRPC_FDS_PER_CONNECTION).
"""
from __future__ import annotations

import asyncio
import collections
import os
import socket
import threading
from typing import Optional

from gateeng.config import ACCEPTS_PER_PASS, LISTEN_BACKLOG, GrpcLimits
from gateeng.logs import LOGGER
from gateeng.serving.admission import Admission

log = LOGGER.getChild("grpc")
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
TLS_HANDSHAKE = b"\x16\x03"       # a TLS record: type handshake, version 3.x
HIGH_WATER = 256 * 1024            # bytes buffered toward one side before the other is paused
ACCEPT_RETRY_S = 1.0               # after an accept that failed (out of descriptors): asyncio's own delay


class _Upstream(asyncio.Protocol):
    """The gate's connection to gRPC, for one client connection."""

    def __init__(self, client: "_Client"):
        self.client = client
        self.transport = None

    def connection_made(self, transport):
        self.transport = transport
        transport.set_write_buffer_limits(HIGH_WATER)

    def data_received(self, data):
        self.client.transport.write(data)

    def pause_writing(self):
        self.client.transport.pause_reading()

    def resume_writing(self):
        self.client.transport.resume_reading()

    def connection_lost(self, exc):
        self.client.transport.close()


class _Client(asyncio.Protocol):
    """One client connection: admitted or refused at accept, its first bytes checked
    within the handshake deadline, then spliced to gRPC."""

    def __init__(self, gate: "GrpcGate"):
        self.gate = gate
        self.transport = None
        self.upstream: Optional[_Upstream] = None
        self.first = b""            # the bytes read while its first ones are checked
        self.pending = None         # then the bytes read while the splice to gRPC is made
        self.admitted = False
        self.timer = None

    def connection_made(self, transport):
        self.transport = transport
        if not self.admitted:        # closed to make room before its transport was made
            transport.abort()
            return
        transport.set_write_buffer_limits(HIGH_WATER)
        self.timer = self.gate.loop.call_later(self.gate.limits.handshake_timeout_s, transport.abort)

    def data_received(self, data):
        if self.upstream is not None:
            self.upstream.transport.write(data)
            return
        if self.first is None:       # checked, and the splice to gRPC is being made
            self.pending.append(data)
            return
        self.first += data
        want = TLS_HANDSHAKE if self.gate.tls else PREFACE
        n = min(len(self.first), len(want))
        if self.first[:n] != want[:n]:
            self.transport.abort()   # not gRPC, or plain text to a TLS port (or TLS to a plain one)
            return
        if n == len(want):
            self.timer.cancel()
            self.gate.spoke(self)
            self.pending, self.first = [self.first], None
            self.transport.pause_reading()
            self.gate.loop.create_task(self._splice())

    async def _splice(self):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.bind(self.gate.name_for(self.transport.get_extra_info("peername")))
            await self.gate.loop.sock_connect(sock, self.gate.upstream_path)
            _, upstream = await self.gate.loop.create_unix_connection(lambda: _Upstream(self), sock=sock)
        except OSError as e:
            sock.close()
            log.warning("gRPC gate: cannot reach the gRPC server: %s", e)
            self.transport.abort()
            return
        if self.transport.is_closing():
            upstream.transport.close()
            return
        self.upstream = upstream
        for data in self.pending:
            upstream.transport.write(data)
        self.pending = None
        self.transport.resume_reading()

    def pause_writing(self):
        if self.upstream is not None:
            self.upstream.transport.pause_reading()

    def resume_writing(self):
        if self.upstream is not None:
            self.upstream.transport.resume_reading()

    def eof_received(self):
        if self.upstream is not None and self.upstream.transport.can_write_eof():
            self.upstream.transport.write_eof()
            return True              # half-closed: gRPC may still answer
        return False

    def connection_lost(self, exc):
        if self.timer is not None:
            self.timer.cancel()
        if self.admitted:
            self.admitted = False
            self.gate.release(self)
        if self.upstream is not None:
            self.upstream.transport.close()


class GrpcGate:
    """The accept gate of one gRPC listener: binds `host:port` at construction (so
    `port` is known), and on `start` admits connections and splices them to the gRPC
    server listening at the Unix socket `upstream_path`. `tls`: the port speaks TLS
    (gRPC terminates it), so a connection's first bytes must be a TLS handshake."""

    def __init__(self, host: str, port: int, upstream_path: str, limits: GrpcLimits, tls: bool):
        self.limits, self.upstream_path, self.tls = limits, upstream_path, tls
        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.sock.listen(LISTEN_BACKLOG)
        self.port = self.sock.getsockname()[1]
        self.sock.setblocking(False)
        self.admission = Admission("grpc", limits.max_connections)
        self.silent: collections.OrderedDict = collections.OrderedDict()   # admitted, not yet spoken; oldest first
        self.clients: set = set()
        self._named = 0
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._accepting = False
        self._ready = threading.Event()
        self._done: Optional[asyncio.Event] = None
        self.thread = threading.Thread(target=lambda: asyncio.run(self._main()), name="gateeng-grpc-gate",
                                       daemon=True)

    # ---- on the gate's loop ------------------------------------------------------
    def _accept(self) -> None:
        """Take up to ACCEPTS_PER_PASS connections from the kernel's queue, each admitted
        (its transport made on a task) or closed at once."""
        for _ in range(ACCEPTS_PER_PASS):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:         # out of descriptors: the connections wait in the kernel's queue
                log.warning("gRPC gate: cannot accept a connection (%s); trying again in %g s", e, ACCEPT_RETRY_S)
                self._pause_accepting()
                self.loop.call_later(ACCEPT_RETRY_S, self._resume_accepting)
                return
            client = _Client(self)
            if not self.admit(client):
                conn.close()
                continue
            self.loop.create_task(self._connect(client, conn))

    async def _connect(self, client: _Client, conn: socket.socket) -> None:
        try:
            await self.loop.connect_accepted_socket(lambda: client, conn)
        except OSError as e:             # the client left before its transport was made
            log.debug("gRPC gate: a connection closed as it was accepted: %s", e)
            conn.close()
            if client.admitted:
                client.admitted = False
                self.release(client)

    def _pause_accepting(self) -> None:
        if self._accepting:
            self.loop.remove_reader(self.sock.fileno())
            self._accepting = False

    def _resume_accepting(self) -> None:
        if not self._accepting and self._done is not None and not self._done.is_set() and self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self._accept)
            self._accepting = True

    def admit(self, client: _Client) -> bool:
        if not self.admission.admit():
            if not self.silent:
                self.admission.refuse()
                return False
            oldest, _ = self.silent.popitem(last=False)
            oldest.admitted = False
            self.admission.release()
            self.clients.discard(oldest)
            if oldest.transport is not None:     # else connection_made closes it
                oldest.transport.abort()
            self.admission.evicted_one()
            self.admission.admit()
        client.admitted = True
        self.silent[client] = None
        self.clients.add(client)
        return True

    def spoke(self, client: _Client) -> None:
        self.silent.pop(client, None)

    def release(self, client: _Client) -> None:
        self.silent.pop(client, None)
        self.clients.discard(client)
        self.admission.release()

    def name_for(self, peer) -> bytes:
        """A Unix socket name of the gate's own for one connection: gRPC sees it as the
        peer (unix-abstract:gateeng-<pid>-<n>-<client address>)."""
        self._named += 1
        where = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) and len(peer) >= 2 else "?"
        return f"\0gateeng-{os.getpid()}-{self._named}-{where}".encode()[:107]

    async def _main(self):
        self.loop = asyncio.get_running_loop()
        self._done = asyncio.Event()
        self._resume_accepting()
        self._ready.set()
        await self._done.wait()
        self._stop_accepting()
        for client in list(self.clients):
            if client.transport is not None:
                client.transport.abort()
        await asyncio.sleep(0)

    def _stop_accepting(self):
        """Close the listening socket: new connections are refused by the kernel."""
        self._pause_accepting()
        self.sock.close()

    # ---- from any thread -----------------------------------------------------------
    def start(self) -> None:
        self.thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the gRPC accept gate did not start")

    def stop_accepting(self) -> None:
        """Refuse new connections (the kernel answers them); those open keep going."""
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop_accepting)

    async def stop(self) -> None:
        """Close every connection and wait for the gate's thread to end."""
        if self.loop is not None and self.thread.is_alive():
            self.loop.call_soon_threadsafe(self._stop_accepting)
            self.loop.call_soon_threadsafe(self._done.set)
            await asyncio.get_running_loop().run_in_executor(None, self.thread.join)
        else:
            self.sock.close()
