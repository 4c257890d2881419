"""gRPC server on asyncio: gateeng.v1.Engine, grpc.health.v1, reflection, and /metrics.

No thread per call: every RPC is a coroutine on one event loop, so health checks
and new calls are answered at once however many streams are open. The engine's
step loop keeps its own thread and hands events to the loop with
call_soon_threadsafe, never blocking it. Tokenizing a prompt runs on a small
thread pool, after the cheap size checks (edge.py).

Status codes a client can act on: INVALID_ARGUMENT (bad or unknown fields),
ALREADY_EXISTS (a request_id this connection has in flight), RESOURCE_EXHAUSTED
(queue full; trailing metadata `grpc-retry-pushback-ms` says when to retry),
FAILED_PRECONDITION (VERIFIED where the self-check failed), UNAUTHENTICATED /
PERMISSION_DENIED (admin), UNAVAILABLE (loading, draining, or the engine
stopped; retry on another replica), INTERNAL (an engine failure).

Ownership: a request belongs to the connection (gRPC peer) that submitted it.
Abort finds only that connection's requests, and request ids are namespaced per
connection, so no client can abort, or learn of, another's requests. The engine
runs each request under an unguessable server id, sent back in the initial
metadata `gateeng-request-id` of every Generate call. Cancelling a call, or
letting its deadline pass, aborts its request and frees its KV blocks.

Health is NOT_SERVING until the model is loaded and the self-check has run, while
draining, and for good once the engine loop dies; the process then exits
non-zero so a supervisor restarts it.
"""
from __future__ import annotations

import asyncio
import gc
import hmac
import logging
import secrets
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Optional

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from gateeng.engine import aio
from gateeng.serving import edge
from gateeng.config import EngineConfig, ServerConfig, validate_threshold, validate_window
from gateeng.serving.edge import BadRequest
from gateeng.engine.client import Engine
from gateeng.engine.errors import DeterminismUnavailable, EngineDead, QueueFull
from gateeng.serving.metrics import Metrics
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.reproducibility import Reproducibility
from gateeng.request import FinishReason
from gateeng.v1 import engine_pb2 as pb

log = logging.getLogger("gateeng.server")
SERVICE = "gateeng.v1.Engine"
FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH, FinishReason.EOS: pb.EOS,
          FinishReason.ABORT: pb.ABORT}
RETRY_PUSHBACK_MS = 1000
REQUEST_ID_HEADER = "gateeng-request-id"


MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def grpc_options() -> list:
    """Chosen, not inherited: keepalive that finds dead peers behind NATs and load
    balancers within a minute, and a 16 MiB message limit. It is well above
    --max-prompt-bytes, so an oversized prompt gets the edge's INVALID_ARGUMENT
    with the limit in it (parsing is cheap; tokenizing is what costs), while a
    message past 16 MiB is refused by gRPC itself before it is parsed."""
    return [
        ("grpc.so_reuseport", 0),
        ("grpc.keepalive_time_ms", 30_000),                      # ping an idle connection every 30 s
        ("grpc.keepalive_timeout_ms", 10_000),                   # and drop it if no ack in 10 s
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s
        ("grpc.http2.max_pings_without_data", 0),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ]


def reproducibility_proto(r: Reproducibility, seed: Optional[int]) -> pb.Reproducibility:
    return pb.Reproducibility(**asdict(r), fingerprint=r.fingerprint(), seed=seed or 0, seeded=seed is not None)


def logprobs_proto(entries) -> list:
    return [pb.Logprobs(token_id=e.token, logprob=e.logprob,
                        top=[pb.TokenLogprob(token_id=t, logprob=v) for t, v in e.top]) for e in entries]


def complete_proto(c: Completion, request_id: str) -> pb.CompleteResponse:
    s = c.stats
    return pb.CompleteResponse(
        request_id=request_id, token_ids=c.token_ids, text=c.text, finish_reason=FINISH[c.finish_reason],
        usage=pb.Usage(prompt_tokens=c.prompt_tokens, completion_tokens=c.completion_tokens,
                       cached_tokens=c.cached_tokens),
        determinism=pb.DeterminismReport(
            mode=c.mode.value, decode_steps=s.decode_steps, triggers_margin=s.triggers_margin,
            triggers_window=s.triggers_window, triggers_finish=s.triggers_finish,
            verify_passes=s.verify_passes, replayed_tokens=s.replayed_tokens, rollbacks=s.mismatches,
            rolled_back_tokens=s.rolled_back_tokens, retractions=s.retractions,
            margin_threshold=c.margin_threshold, rollbacks_margin=s.mismatches_margin,
            rollbacks_window=s.mismatches_window, rollbacks_finish=s.mismatches_finish,
            direct_steps=s.direct_steps, rollbacks_direct=s.mismatches_direct),
        reproducibility=reproducibility_proto(c.reproducibility, c.seed), logprobs=logprobs_proto(c.logprobs),
        prompt_logprobs=logprobs_proto(c.prompt_logprobs))


class EngineService:
    def __init__(self, settings: ServerConfig, metrics: Metrics, admin_token: Optional[str] = None):
        self.settings, self.bounds, self.metrics = settings, settings.bounds, metrics
        self.admin_token = admin_token
        self.engine: Optional[Engine] = None
        self.draining = False
        # (peer, client request id) -> engine id, for the calls in flight.
        self.owned: dict[tuple[str, str], str] = {}
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateeng-tokenize")

    # ---- helpers --------------------------------------------------------------
    async def _refuse(self, context, code: grpc.StatusCode, message: str):
        self.metrics.errors.labels(code.name).inc()
        await context.abort(code, message)

    def unavailable(self) -> Optional[str]:
        """Why no request can be served now (both fronts answer with it), or None."""
        if self.engine is None:
            return "the model is still loading; retry shortly"
        if self.engine.failure is not None:
            return "the engine stopped on an error and the server is restarting; retry on another replica"
        if self.draining:
            return "the server is shutting down; retry on another replica"
        return None

    async def _engine(self, context) -> Engine:
        reason = self.unavailable()
        if reason is not None:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, reason)
        return self.engine

    async def _parse(self, cls, raw: bytes, context):
        try:
            return edge.parse(cls, raw)
        except BadRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))

    async def _run(self, raw: bytes, context):
        """Check, submit and follow one request: yields its events, ends with the
        Completion, and aborts the request if the call goes away first."""
        request = await self._parse(pb.GenerateRequest, raw, context)
        engine = await self._engine(context)
        peer = context.peer()
        try:
            edge.check_generate(request, self.settings.prompt_bytes(engine.max_model_len), engine.max_model_len)
            sampling = edge.sampling_from_proto(request.sampling)
            det = edge.determinism_from_proto(request.determinism, self.bounds)
        except BadRequest as e:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
        key = (peer, request.request_id) if request.request_id else None
        if key is not None and key in self.owned:
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS,
                                f"request_id {request.request_id!r} is already in flight on this connection")
        engine_id = "req-" + secrets.token_hex(16)
        shown_id = request.request_id or engine_id
        prompt = edge.prompt_from_proto(request)
        if key is not None:
            self.owned[key] = engine_id
        self.owned[(peer, engine_id)] = engine_id
        stream = aio.stream_request(engine, self.tokenize_pool, prompt, sampling, det, engine_id, request.chat)
        try:
            try:
                await stream.__anext__()          # Submitted
            except DeterminismUnavailable as e:
                await self._refuse(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
            except QueueFull as e:
                context.set_trailing_metadata((("grpc-retry-pushback-ms", str(RETRY_PUSHBACK_MS)),))
                await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{e}; retry in about {RETRY_PUSHBACK_MS / 1000:g} s")
            except EngineDead as e:
                await self._refuse(context, grpc.StatusCode.UNAVAILABLE, f"{e}; retry on another replica")
            except ValueError as e:
                await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(e))
            self.metrics.count_overrides(det)
            yield None, shown_id          # submitted: the caller may send its metadata
            try:
                async for ev in stream:
                    if isinstance(ev, Completion) and ev.finish_reason is FinishReason.ABORT and self.draining:
                        await self._refuse(context, grpc.StatusCode.UNAVAILABLE,
                                           "the server shut down before the request finished; retry it on "
                                           "another replica")
                    yield ev, shown_id
            except EngineDead as e:
                await self._refuse(context, grpc.StatusCode.INTERNAL, str(e))
        finally:
            if key is not None:
                self.owned.pop(key, None)
            self.owned.pop((peer, engine_id), None)
            await stream.aclose()         # aborts the request if the call went away first

    # ---- RPCs -------------------------------------------------------------------
    async def Generate(self, raw: bytes, context):
        async for ev, shown_id in self._run(raw, context):
            if ev is None:
                await context.send_initial_metadata(((REQUEST_ID_HEADER, shown_id),))
            elif isinstance(ev, Chunk):
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ev.token_ids, text=ev.text, position=ev.position,
                                                         logprobs=logprobs_proto(ev.logprobs)))
            elif isinstance(ev, Rollback):
                yield pb.GenerateResponse(rollback=pb.Rollback(position=ev.position))
            else:
                yield pb.GenerateResponse(complete=complete_proto(ev, shown_id))

    async def Complete(self, raw: bytes, context):
        async for ev, shown_id in self._run(raw, context):
            if isinstance(ev, Completion):
                return complete_proto(ev, shown_id)

    async def Abort(self, raw: bytes, context):
        request = await self._parse(pb.AbortRequest, raw, context)
        engine = await self._engine(context)
        engine_id = self.owned.get((context.peer(), request.request_id))
        # Another connection's id answers exactly like an unknown one.
        return pb.AbortResponse(found=engine_id is not None and engine.abort(engine_id))

    async def GetModelInfo(self, raw: bytes, context):
        await self._parse(pb.GetModelInfoRequest, raw, context)
        e = await self._engine(context)
        mc = e.model_config
        return pb.ModelInfo(source=e.loaded.source, fingerprint=e.loaded.fingerprint, dtype=e.config.dtype,
                            vocab_size=mc.vocab_size, max_model_len=e.max_model_len, num_layers=mc.num_layers,
                            hidden_size=mc.hidden_size, eos_token_ids=sorted(e.stop.eos),
                            architecture=mc.architecture,
                            has_chat_template=bool(getattr(e.tokenizer, "chat_template", None)))

    async def GetServerInfo(self, raw: bytes, context):
        await self._parse(pb.GetServerInfoRequest, raw, context)
        e = await self._engine(context)
        counts = e.counts   # an immutable record the engine thread replaces
        return pb.ServerInfo(engine_version=e.version, device_kind=e.reproducibility.device_kind,
                             kernel_plan=e.config.plan,
                             self_check_passed=e.selfcheck.passed, self_check=e.selfcheck.describe(),
                             gate=pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window),
                             requests_running=counts.running, requests_waiting=counts.waiting,
                             kv_cache_usage=counts.kv_usage, max_queue=e.config.max_queue)

    async def UpdateGateConfig(self, raw: bytes, context):
        if not self.admin_token:
            await self._refuse(context, grpc.StatusCode.PERMISSION_DENIED,
                                "admin RPCs are disabled: start the server with GATEENG_ADMIN_TOKEN or "
                                "--admin-token-file")
        md = dict(context.invocation_metadata())
        if not hmac.compare_digest(md.get("authorization", "").encode(), f"Bearer {self.admin_token}".encode()):
            await self._refuse(context, grpc.StatusCode.UNAUTHENTICATED,
                                "admin RPC needs metadata `authorization: Bearer <admin token>`")
        request = await self._parse(pb.UpdateGateConfigRequest, raw, context)
        e = await self._engine(context)
        try:
            tau = validate_threshold(request.margin_threshold) if request.HasField("margin_threshold") else None
            w = validate_window(request.max_window) if request.HasField("max_window") else None
            self.bounds.check(tau, w, what="UpdateGateConfig")
            if w is not None and w + 1 > e.config.max_num_batched_tokens:
                raise ValueError(f"max_window must be below the step token budget {e.config.max_num_batched_tokens}")
        except ValueError as err:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if tau is not None:
            e.set_margin_threshold(tau)
        if w is not None:
            e.set_max_window(w)
        log.info("gate config now tau=%s W=%s", e.margin_threshold, e.max_window)
        return pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window)

    def handler(self) -> grpc.GenericRpcHandler:
        """Handlers that take raw bytes, so a malformed request is INVALID_ARGUMENT
        (edge.parse) rather than the INTERNAL a failed deserializer gives."""
        def out(cls):
            return cls.SerializeToString
        methods = {
            "Generate": grpc.unary_stream_rpc_method_handler(self.Generate,
                                                             response_serializer=out(pb.GenerateResponse)),
            "Complete": grpc.unary_unary_rpc_method_handler(self.Complete,
                                                            response_serializer=out(pb.CompleteResponse)),
            "Abort": grpc.unary_unary_rpc_method_handler(self.Abort, response_serializer=out(pb.AbortResponse)),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(self.GetModelInfo,
                                                                response_serializer=out(pb.ModelInfo)),
            "GetServerInfo": grpc.unary_unary_rpc_method_handler(self.GetServerInfo,
                                                                 response_serializer=out(pb.ServerInfo)),
            "UpdateGateConfig": grpc.unary_unary_rpc_method_handler(self.UpdateGateConfig,
                                                                    response_serializer=out(pb.GateConfig)),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)


class Server:
    """Owns the gRPC server, health, the metrics endpoint and the engine's lifetime.
    `run()` returns the process exit code: 0 after a drain, 1 if the engine died."""

    def __init__(self, config: EngineConfig, settings: Optional[ServerConfig] = None,
                 admin_token: Optional[str] = None, loaded=None):
        self.config, self.loaded = config, loaded
        self.settings = settings = settings or ServerConfig()
        settings.validate()
        settings.bounds.check(config.margin_threshold, config.max_window, what="the server default")
        self.host, self.port, self.drain_seconds = settings.host, settings.port, settings.drain_seconds
        self.metrics = Metrics()
        self.service = EngineService(settings, self.metrics, admin_token)
        self.health = health_aio.HealthServicer()
        self.metrics_port = None
        if settings.metrics_port is not None:
            http, _ = start_http_server(settings.metrics_port, addr=self.host, registry=self.metrics.registry)
            self.metrics_port = http.server_port
        self.exit_code = 0
        self._stop: Optional[asyncio.Event] = None
        self.http = None        # http_api.HttpServer when settings.http_port is set

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE):
            await self.health.set(name, status)

    def request_stop(self, exit_code: int = 0) -> None:
        """Begin the drain (thread-safe only from the loop; signals use this)."""
        self.exit_code = max(self.exit_code, exit_code)
        if self._stop is not None:
            self._stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server(options=grpc_options())
        server.add_generic_rpc_handlers((self.service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        self.port = server.add_insecure_port(f"{self.host}:{self.port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {self.host}:{self.port}")
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self._on_signal, sig)
            except (RuntimeError, ValueError):   # not the main thread (tests run servers in threads)
                pass
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await server.start()
        log.info("listening on port %d (health NOT_SERVING while the model loads)", self.port)
        if self.settings.http_port is not None:
            from gateeng.serving.http_api import HttpServer, OpenAIFront
            self.http = HttpServer(OpenAIFront(self, self.settings.served_model_name), self.host,
                                   self.settings.http_port)
            self.http.start()
            log.info("OpenAI-compatible HTTP on port %d", self.http.port)
        try:
            engine = await loop.run_in_executor(None, lambda: Engine(self.config, loaded=self.loaded))
        except Exception:
            if self.http is not None:
                await self.http.stop()
            await server.stop(0)
            raise
        engine.on_death.append(lambda exc: loop.call_soon_threadsafe(self._on_engine_death, exc))
        if self.settings.freeze_heap:
            # The model, the tokenizer and the libraries live as long as the process, and
            # a full collection walks all of them: about 300k objects, 160 ms with every
            # stream stalled. From here on only the objects the requests make are
            # collected.
            gc.collect()
            gc.freeze()
        self.metrics.attach(engine)
        self.service.engine = engine
        log.info(engine.selfcheck.describe())
        if not self._stop.is_set():
            await self._set_health(health_pb2.HealthCheckResponse.SERVING)
            log.info("serving %s on port %d, metrics on %s", engine.loaded.source, self.port,
                     f"http://{self.host}:{self.metrics_port}/metrics" if self.metrics_port else "off")
        await self._stop.wait()
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service.draining = True
        drain = 0.0 if self.exit_code else self.drain_seconds
        await loop.run_in_executor(None, engine.shutdown, drain)
        if self.http is not None:
            await self.http.stop()
        await server.stop(grace=2)
        self.service.tokenize_pool.shutdown(wait=False)
        return self.exit_code

    def _on_signal(self, signum) -> None:
        log.info("signal %d: draining (up to %.0fs) and stopping", signum, self.drain_seconds)
        self.request_stop(0)

    def _on_engine_death(self, exc: BaseException) -> None:
        log.error("the engine loop died: %r; health is NOT_SERVING and the server exits with status 1", exc)
        self.request_stop(1)
