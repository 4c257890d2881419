"""The serving process: one gateway (gateway.py) with the gRPC front and, with
--http-port, the OpenAI-compatible HTTP front over it, and the /metrics endpoint.
Every listener is bounded: gRPC behind its accept gate (grpc_gate.py), the HTTP
front and /metrics in http_server.py. At start the open-file limit is raised to what
their limits need plus the descriptors kept for the model's files, and where it
cannot be, their limits are lowered alike to fit; so no flood on one listener
starves another, health or the model's files. With TLS files (tls.py) both fronts
speak TLS; with an API key, both refuse calls without it (auth.py).

Lifetime: the fronts listen (health NOT_SERVING) while the model loads and the
self-check runs; then health turns SERVING. SIGTERM / SIGINT drain: health turns
NOT_SERVING, new requests are refused UNAVAILABLE, running ones get up to
--drain-seconds. When the engine loop dies, health turns NOT_SERVING for good
and the process exits non-zero so a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import gc
import signal
from typing import Callable, Optional

from prometheus_client import make_asgi_app

from gateeng.config import GRPC_FDS_PER_CONNECTION, RESERVED_FDS, EngineConfig, ServerConfig
from gateeng.engine.engine import Engine
from gateeng.logs import LOGGER
from gateeng.serving import tls
from gateeng.serving.auth import HttpApiKey
from gateeng.serving.gateway import REQUEST_ID_HEADER, Gateway
from gateeng.serving.grpc_api import GrpcFront
from gateeng.serving.http_server import HttpServer, ensure_descriptors
from gateeng.serving.metrics import Metrics

__all__ = ["REQUEST_ID_HEADER", "Server"]
log = LOGGER.getChild("server")


def _fit_descriptors(settings: ServerConfig) -> ServerConfig:
    """`settings`, with the listeners' connection limits lowered where the open-file
    limit (raised as far as the hard limit allows) cannot hold them all and the
    descriptors kept for the model's files; the start-up log says which."""
    needed = settings.descriptors_needed()
    soft = ensure_descriptors(needed)
    fitted = settings.fitted(soft)
    limits = (f"gRPC {fitted.grpc_limits.max_connections} (x{GRPC_FDS_PER_CONNECTION} descriptors each)"
              + (f", HTTP {fitted.http_limits.max_connections}" if fitted.http_port is not None else "")
              + (f", metrics {fitted.metrics_limits.max_connections}" if fitted.metrics_port is not None else ""))
    if fitted is not settings:
        log.warning("the open-file limit is %d, below the %d the connection limits need (`ulimit -n`): "
                    "connections at most %s, %d descriptors kept for the model's files", soft, needed, limits,
                    RESERVED_FDS)
    else:
        log.info("connections at most %s; %d descriptors kept for the model's files (open-file limit %s)",
                 limits, RESERVED_FDS, soft)
    return fitted


class Server:
    """Owns the gateway, both fronts, the metrics endpoint and the engine's lifetime.
    `run()` returns the process exit code: 0 after a drain, 1 if the engine died."""

    def __init__(self, config: EngineConfig, settings: Optional[ServerConfig] = None,
                 admin_token: Optional[str] = None, loaded=None, api_key: Optional[str] = None,
                 engine_factory: Optional[Callable[[], Engine]] = None, metrics: Optional[Metrics] = None):
        """`engine_factory` builds what the fronts serve (by default an Engine on
        `config`; gateeng.fleet passes one that builds a Fleet of replicas), and
        `metrics` is the endpoint's (by default its own registry)."""
        self.config, self.loaded, self.admin_token, self.api_key = config, loaded, admin_token, api_key
        self.engine_factory = engine_factory or (lambda: Engine(self.config, loaded=self.loaded))
        settings = settings or ServerConfig()
        settings.validate()
        settings.bounds.check(config.margin_threshold, config.max_window, what="the server default")
        self.tls = tls.load(settings.tls)
        self.settings = settings = _fit_descriptors(settings)
        self.host, self.port, self.drain_seconds = settings.host, settings.port, settings.drain_seconds
        self.metrics = metrics or Metrics()
        self.gateway = Gateway(settings, self.metrics)
        self.metrics_port = None
        self.metrics_http: Optional[HttpServer] = None
        if settings.metrics_port is not None:
            self.metrics_http = HttpServer(make_asgi_app(self.metrics.registry), settings.metrics_host or self.host,
                                           settings.metrics_port, settings.metrics_limits, "metrics")
            self.metrics_http.start()
            self.metrics_port = self.metrics_http.port
        self.exit_code = 0
        self._stop: Optional[asyncio.Event] = None
        self.grpc: Optional[GrpcFront] = None
        self.http: Optional[HttpServer] = None   # the OpenAI front, when settings.http_port is set

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin the drain (thread-safe only from the loop; signals use this)."""
        self.exit_code = max(self.exit_code, exit_code)
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.grpc = front = GrpcFront(self.gateway, self.host, self.port, self.admin_token, self.api_key,
                                      self.settings.grpc_limits, self.tls)
        self.port = front.port
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (RuntimeError, ValueError):   # not the main thread (tests run servers in threads)
                pass
        await front.start()
        log.info("listening on port %d (health NOT_SERVING while the model loads)", self.port)
        if self.api_key:
            log.info("API key required on every gRPC Engine call and HTTP path but /health and /metrics")
        if self.settings.http_port is not None:
            from gateeng.serving.http_api import OpenAIFront
            app = OpenAIFront(self.gateway).app
            if self.api_key:
                app = HttpApiKey(app, self.api_key, lambda r: self.gateway.count(r, "http"))
            self.http = HttpServer(app, self.host, self.settings.http_port, self.settings.http_limits, "http",
                                   tls=self.tls.context if self.tls is not None else None)
            self.http.start()
            log.info("OpenAI-compatible HTTP on port %d", self.http.port)
        try:
            engine = await loop.run_in_executor(None, self.engine_factory)
        except Exception:
            if self.http is not None:
                await self.http.stop()
            await front.stop(0)
            await self._stop_metrics()
            raise
        engine.on_death.append(lambda exc: loop.call_soon_threadsafe(self._on_engine_death, exc))
        # An engine whose health comes and goes (a fleet: SERVING while a replica serves)
        # says so through on_health; one Engine serves until it dies (on_death).
        for_health = getattr(engine, "on_health", None)
        if for_health is not None:
            for_health.append(lambda serving: asyncio.run_coroutine_threadsafe(
                front.set_serving(serving and not self._stop.is_set()), loop))
        if self.settings.freeze_heap:
            # The model, the tokenizer and the libraries live as long as the process, and
            # a full collection walks all of them: about 300k objects, 160 ms with every
            # stream stalled. From here on only the objects the requests make are
            # collected.
            gc.collect()
            gc.freeze()
        self.metrics.attach(engine, self.gateway.model_name(engine))
        self.gateway.engine = engine
        log.info(engine.selfcheck.describe())
        if not self._stop.is_set():
            await front.set_serving(True)
            scheme = "https" if self.tls is not None else "http"
            log.info("serving %s: gRPC%s on port %d, OpenAI API on %s, metrics on %s", engine.loaded.source,
                     " over TLS" if self.tls is not None else "", self.port,
                     f"{scheme}://{self.host}:{self.http.port}/v1" if self.http is not None else "off",
                     f"http://{self.settings.metrics_host or self.host}:{self.metrics_port}/metrics"
                     if self.metrics_port else "off")
        await self._stop.wait()
        await front.set_serving(False)
        self.gateway.draining = True
        drain = 0.0 if self.exit_code else self.drain_seconds
        await loop.run_in_executor(None, engine.shutdown, drain)
        if self.http is not None:
            await self.http.stop()
        await front.stop(grace=2)
        await self._stop_metrics()
        self.gateway.close()
        return self.exit_code

    async def _stop_metrics(self) -> None:
        if self.metrics_http is not None:
            await self.metrics_http.stop()

    def _on_signal(self, signum) -> None:
        log.info("signal %d: draining (up to %.0fs) and stopping", signum, self.drain_seconds)
        self.request_stop(0)

    def _on_engine_death(self, exc: BaseException) -> None:
        log.error("the engine loop died: %r; health is NOT_SERVING and the server exits with status 1", exc)
        self.request_stop(1)
