"""gRPC server: gateeng.v1.Engine, grpc.health.v1, reflection, and /metrics.

Health is NOT_SERVING until the model is loaded and the invariant plan's
self-check has run. Errors map to status codes a client can act on:
INVALID_ARGUMENT (bad fields), RESOURCE_EXHAUSTED (queue full), FAILED_PRECONDITION
(VERIFIED where the self-check failed), UNAUTHENTICATED / PERMISSION_DENIED
(admin), UNAVAILABLE (loading or draining). A cancelled call or an expired
deadline aborts its request, which frees its KV blocks.
"""
from __future__ import annotations

import hmac
import logging
import math
import signal
import threading
from concurrent import futures
from dataclasses import asdict
from typing import Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import start_http_server

from gateeng.config import EngineConfig, validate_threshold, validate_window
from gateeng.engine import DeterminismUnavailable, Engine, QueueFull
from gateeng.metrics import Metrics
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.reproducibility import Reproducibility
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams, StreamPolicy
from gateeng.v1 import engine_pb2 as pb
from gateeng.v1 import engine_pb2_grpc as pb_grpc

log = logging.getLogger("gateeng.server")
SERVICE = "gateeng.v1.Engine"
FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH, FinishReason.EOS: pb.EOS,
          FinishReason.ABORT: pb.ABORT}
DEFAULT_MAX_TOKENS = 128


class BadRequest(ValueError):
    pass


def sampling_from_proto(sp: pb.SamplingParams) -> SamplingParams:
    def opt(name, default):
        return getattr(sp, name) if sp.HasField(name) else default
    return SamplingParams(temperature=opt("temperature", 0.0), top_p=opt("top_p", 1.0), top_k=opt("top_k", 0),
                          seed=opt("seed", None), max_tokens=opt("max_tokens", DEFAULT_MAX_TOKENS),
                          stop=tuple(sp.stop), stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos)


def determinism_from_proto(d: pb.Determinism) -> DeterminismParams:
    mode = Mode.VERIFIED if d.mode == pb.Determinism.MODE_VERIFIED else Mode.OFF
    tau = d.margin_threshold if d.HasField("margin_threshold") else None
    if tau is not None and not math.isfinite(tau):
        raise BadRequest(f"determinism.margin_threshold must be a finite number >= 0, got {tau}")
    return DeterminismParams(mode=mode, margin_threshold=tau,
                             max_window=d.max_window if d.HasField("max_window") else None,
                             stream_policy=StreamPolicy.EAGER if d.stream_policy == pb.Determinism.EAGER
                             else StreamPolicy.VERIFIED_ONLY)


def reproducibility_proto(r: Reproducibility, seed: Optional[int]) -> pb.Reproducibility:
    return pb.Reproducibility(**asdict(r), fingerprint=r.fingerprint(), seed=seed or 0, seeded=seed is not None)


class EngineService(pb_grpc.EngineServicer):
    def __init__(self, config: EngineConfig, admin_token: Optional[str] = None):
        self.config = config
        self.admin_token = admin_token
        self.engine: Optional[Engine] = None
        self.draining = False

    # ---- helpers --------------------------------------------------------------
    def _engine(self, context) -> Engine:
        if self.engine is None:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the model is still loading; retry shortly")
        if self.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down; retry on another replica")
        return self.engine

    def _submit(self, request: pb.GenerateRequest, context):
        engine = self._engine(context)
        which = request.WhichOneof("input")
        try:
            if which is None:
                raise BadRequest("set `text` or `token_ids` as the input")
            if which == "token_ids" and request.chat:
                raise BadRequest("`chat` applies a template to text; send `text` or set chat=false")
            prompt = request.text if which == "text" else list(request.token_ids.ids)
            return engine.submit(prompt, sampling_from_proto(request.sampling),
                                 determinism_from_proto(request.determinism),
                                 request.request_id or None, chat=request.chat)
        except DeterminismUnavailable as e:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except QueueFull as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

    def _complete_proto(self, c: Completion) -> pb.CompleteResponse:
        s = c.stats
        return pb.CompleteResponse(
            request_id=c.request_id, token_ids=c.token_ids, text=c.text, finish_reason=FINISH[c.finish_reason],
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
            reproducibility=reproducibility_proto(c.reproducibility, c.seed))

    def _events(self, handle, context):
        """Events of one request; aborts it if the client goes away."""
        context.add_callback(lambda: handle.done.is_set() or self.engine.abort(handle.request_id))
        for ev in handle:
            if isinstance(ev, Exception):
                context.abort(grpc.StatusCode.INTERNAL, f"engine failure: {ev}")
            yield ev

    # ---- RPCs -------------------------------------------------------------------
    def Generate(self, request, context):
        handle = self._submit(request, context)
        for ev in self._events(handle, context):
            if isinstance(ev, Chunk):
                yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ev.token_ids, text=ev.text, position=ev.position))
            elif isinstance(ev, Rollback):
                yield pb.GenerateResponse(rollback=pb.Rollback(position=ev.position))
            else:
                yield pb.GenerateResponse(complete=self._complete_proto(ev))

    def Complete(self, request, context):
        handle = self._submit(request, context)
        for ev in self._events(handle, context):
            if isinstance(ev, Completion):
                return self._complete_proto(ev)

    def Abort(self, request, context):
        return pb.AbortResponse(found=self._engine(context).abort(request.request_id))

    def GetModelInfo(self, request, context):
        e = self._engine(context)
        mc = e.model_config
        return pb.ModelInfo(source=e.loaded.source, fingerprint=e.loaded.fingerprint, dtype=e.config.dtype,
                            vocab_size=mc.vocab_size, max_model_len=e.max_model_len, num_layers=mc.num_layers,
                            hidden_size=mc.hidden_size, eos_token_ids=sorted(e.stop.eos))

    def GetServerInfo(self, request, context):
        e = self._engine(context)
        counts = e.counts   # an immutable record the engine thread replaces
        return pb.ServerInfo(engine_version=e.version, device_kind=e.reproducibility.device_kind,
                             kernel_plan=e.config.plan,
                             self_check_passed=e.selfcheck.passed, self_check=e.selfcheck.describe(),
                             gate=pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window),
                             requests_running=counts.running, requests_waiting=counts.waiting,
                             kv_cache_usage=counts.kv_usage, max_queue=e.config.max_queue)

    def UpdateGateConfig(self, request, context):
        if not self.admin_token:
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          "admin RPCs are disabled: start the server with --admin-token")
        md = dict(context.invocation_metadata())
        if not hmac.compare_digest(md.get("authorization", "").encode(), f"Bearer {self.admin_token}".encode()):
            context.abort(grpc.StatusCode.UNAUTHENTICATED,
                          "admin RPC needs metadata `authorization: Bearer <admin token>`")
        e = self._engine(context)
        try:
            tau = validate_threshold(request.margin_threshold) if request.HasField("margin_threshold") else None
            w = validate_window(request.max_window) if request.HasField("max_window") else None
            if w is not None and w + 1 > e.config.max_num_batched_tokens:
                raise ValueError(f"max_window must be below the step token budget {e.config.max_num_batched_tokens}")
        except ValueError as err:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        if tau is not None:
            e.set_margin_threshold(tau)
        if w is not None:
            e.set_max_window(w)
        log.info("gate config now tau=%s W=%s", e.margin_threshold, e.max_window)
        return pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window)


class Server:
    """Owns the gRPC server, health, metrics endpoint and the engine's lifetime."""

    def __init__(self, config: EngineConfig, host="127.0.0.1", port=50051, metrics_port: Optional[int] = 9400,
                 admin_token: Optional[str] = None, workers: int = 64, loaded=None):
        self.config, self.loaded = config, loaded
        self.service = EngineService(config, admin_token)
        self.health = health.HealthServicer()
        self.metrics = Metrics()
        self.grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=workers),
                                options=[("grpc.so_reuseport", 0)])
        pb_grpc.add_EngineServicer_to_server(self.service, self.grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc)
        names = (pb.DESCRIPTOR.services_by_name["Engine"].full_name,
                 health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.grpc)
        self.port = self.grpc.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"cannot listen on {host}:{port}")
        self.metrics_port = None
        if metrics_port is not None:
            http, _ = start_http_server(metrics_port, addr=host, registry=self.metrics.registry)
            self.metrics_port = http.server_port
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.stopped = threading.Event()

    def _set_health(self, status) -> None:
        for name in ("", SERVICE):
            self.health.set(name, status)

    def start(self) -> None:
        self.grpc.start()
        log.info("listening on port %d (health NOT_SERVING while the model loads)", self.port)
        engine = Engine(self.config, loaded=self.loaded)
        self.metrics.attach(engine)
        self.service.engine = engine
        log.info(engine.selfcheck.describe())
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s on port %d, metrics on %s", engine.loaded.source, self.port,
                 f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else "off")

    def stop(self, drain_seconds: float = 30.0) -> None:
        """Stop admitting, drain in-flight requests for up to drain_seconds, then stop."""
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.service.draining = True
        if self.service.engine is not None:
            self.service.engine.shutdown(drain_seconds)
        self.grpc.stop(grace=2).wait()
        self.stopped.set()

    def serve_forever(self, drain_seconds: float = 30.0) -> None:
        def on_term(signum, frame):
            log.info("signal %d: draining (up to %.0fs) and stopping", signum, drain_seconds)
            threading.Thread(target=self.stop, args=(drain_seconds,), daemon=True).start()
        signal.signal(signal.SIGTERM, on_term)
        signal.signal(signal.SIGINT, on_term)
        self.start()
        while not self.stopped.wait(0.5):
            pass
