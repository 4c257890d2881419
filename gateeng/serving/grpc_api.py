"""The gRPC front on asyncio: gateeng.v1.Engine, grpc.health.v1 and reflection,
over the gateway (gateway.py).

No thread per call: every RPC is a coroutine on one event loop, so health checks
and new calls are answered at once however many streams are open. Tokenizing a
prompt runs on the gateway's thread pool, after the cheap checks (grpc_edge.py for
the protobuf, checks.py for what both fronts share).

Status codes a client can act on (refusals.py): INVALID_ARGUMENT (bad or unknown
fields), ALREADY_EXISTS (a request_id this connection has in flight),
RESOURCE_EXHAUSTED (queue full; trailing metadata `grpc-retry-pushback-ms` says
when to retry), FAILED_PRECONDITION (VERIFIED where the self-check failed; weights
in place where the server cannot swap them),
UNAUTHENTICATED (no API key where the server needs one, auth.py; admin),
PERMISSION_DENIED (admin), UNAVAILABLE (loading, draining, or the engine stopped;
retry on another replica), INTERNAL (an engine failure).

Ownership: a request belongs to the connection (gRPC peer) that submitted it.
Abort finds only that connection's requests, and request ids are namespaced per
connection, so no client can abort, or learn of, another's requests. The engine
runs each request under an unguessable server id (the one error logs name),
sent back in the initial metadata `gateeng-request-id` of every Generate call;
Abort takes either id, and the response's `request_id` is the client's own, or
the server id where the client set none. Cancelling a call, or letting its
deadline pass, aborts its request and frees its KV blocks.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import aclosing
from dataclasses import asdict
from typing import Optional

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from gateeng.config import GrpcLimits, validate_threshold, validate_window
from gateeng.engine.errors import EngineDead, WeightUpdateUnavailable
from gateeng.logs import LOGGER
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.reproducibility import Reproducibility, untrainable
from gateeng.request import FinishReason
from gateeng.serving import auth, grpc_edge, refusals
from gateeng.serving.grpc_client import sampling_proto
from gateeng.serving.grpc_gate import GrpcGate
from gateeng.serving.refusals import Kind, Refusal, internal_error
from gateeng.serving.gateway import REQUEST_ID_HEADER, Gateway
from gateeng.serving.tls import ServerTls
from gateeng.v1 import engine_pb2 as pb

log = LOGGER.getChild("server")
SERVICE = "gateeng.v1.Engine"
FINISH = {FinishReason.STOP: pb.STOP, FinishReason.LENGTH: pb.LENGTH, FinishReason.EOS: pb.EOS,
          FinishReason.ABORT: pb.ABORT}
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


def grpc_options(limits: GrpcLimits = GrpcLimits()) -> list:
    """Chosen, not inherited: keepalive that finds dead peers behind NATs and load
    balancers within a minute, and a 16 MiB message limit. It is well above
    --max-prompt-bytes, so an oversized prompt gets the edge's INVALID_ARGUMENT
    with the limit in it (parsing is cheap; tokenizing is what costs), while a
    message past 16 MiB is refused by gRPC itself before it is parsed. The
    connection bounds gRPC enforces itself: the TLS handshake and HTTP/2 settings
    within --grpc-handshake-timeout, and a connection with no call in flight for
    --grpc-idle-timeout is closed (the accept gate, grpc_gate.py, does the rest)."""
    return [
        ("grpc.server_handshake_timeout_ms", int(limits.handshake_timeout_s * 1000)),
        ("grpc.max_connection_idle_ms", int(limits.idle_timeout_s * 1000)),
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
            verify_passes=s.verify_passes, replayed_tokens=s.replayed_tokens, mismatches=s.mismatches,
            rolled_back_tokens=s.rolled_back_tokens, retractions=s.retractions,
            margin_threshold=c.margin_threshold, mismatches_margin=s.mismatches_margin,
            mismatches_window=s.mismatches_window, mismatches_finish=s.mismatches_finish,
            direct_steps=s.direct_steps, mismatches_direct=s.mismatches_direct,
            triggers_router=s.triggers_router, mismatches_router=s.mismatches_router),
        reproducibility=reproducibility_proto(c.reproducibility, c.seed), logprobs=logprobs_proto(c.logprobs),
        prompt_logprobs=logprobs_proto(c.prompt_logprobs), prompt_token_ids=pb.TokenIds(ids=c.prompt_ids),
        sampling=sampling_proto(c.sampling), finish_detail=c.finish_detail)


class EngineService:
    def __init__(self, gateway: Gateway, admin_token: Optional[str] = None):
        self.gateway = gateway
        self.admin_token = admin_token
        # (peer, client request id) -> engine id, for the calls in flight.
        self.owned: dict[tuple[str, str], str] = {}
        # Weight updates, one at a time (Engine.update_weights serializes them too).
        self.weights_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gateeng-weights")

    # ---- helpers --------------------------------------------------------------
    async def _refuse(self, context, refusal: Refusal):
        self.gateway.count(refusal, "grpc")
        if refusal.retry_after_s is not None:
            context.set_trailing_metadata((("grpc-retry-pushback-ms", str(refusal.retry_after_s * 1000)),))
        await context.abort(refusal.kind.grpc_code, refusal.message)

    async def _engine(self, context):
        try:
            return self.gateway.ready_engine()
        except Refusal as r:
            await self._refuse(context, r)

    async def _parse(self, cls, raw: bytes, context):
        try:
            return grpc_edge.parse(cls, raw)
        except grpc_edge.BadRequest as e:
            await self._refuse(context, refusals.from_engine(e))

    async def _run(self, raw: bytes, context):
        """Check, submit and follow one request: yields its events, ends with the
        Completion, and aborts the request if the call goes away first."""
        request = await self._parse(pb.GenerateRequest, raw, context)
        engine = await self._engine(context)
        peer = context.peer()
        try:
            grpc_edge.check_generate(request)
            sampling = grpc_edge.sampling_from_proto(request.sampling, engine.max_model_len)
            det = grpc_edge.determinism_from_proto(request.determinism, self.gateway.bounds)
        except (grpc_edge.BadRequest, Refusal) as e:
            await self._refuse(context, refusals.from_engine(e))
        key = (peer, request.request_id) if request.request_id else None
        if key is not None and key in self.owned:
            await self._refuse(context, Refusal(Kind.IN_FLIGHT, f"request_id {request.request_id!r} is already "
                                                                f"in flight on this connection"))
        engine_id = "req-" + secrets.token_hex(16)
        shown_id = request.request_id or engine_id
        if key is not None:
            self.owned[key] = engine_id
        self.owned[(peer, engine_id)] = engine_id
        # When the call ends (answered, cancelled, past its deadline), its request
        # ends too. The finally below does this when the handler unwinds; grpc may
        # instead leave a streaming handler suspended at its yield (cancelled while
        # sending), which would otherwise keep decoding until garbage collection.
        # A request still inside submit then is aborted by aio.stream_request.
        context.add_done_callback(lambda _: self._call_ended(engine, key, peer, engine_id))
        stream = None
        try:
            try:
                stream = await self.gateway.start(grpc_edge.prompt_from_proto(request), sampling, det, engine_id,
                                                  request.chat)
            except Refusal as r:
                await self._refuse(context, r)
            yield None, shown_id, engine_id   # submitted: the caller may send its metadata
            try:
                async for ev in stream:
                    cut = self.gateway.cut_by_drain(ev) if isinstance(ev, Completion) else None
                    if cut is not None:
                        await self._refuse(context, cut)
                    yield ev, shown_id, engine_id
            except EngineDead as exc:
                await self._refuse(context, refusals.from_engine(exc, submitted=True))
            except grpc.aio.AbortError:
                raise
            except Exception:
                log.exception("request %s failed", engine_id)
                await self._refuse(context, internal_error(engine_id))
        finally:
            self._forget(key, peer, engine_id)
            if stream is not None:
                await stream.aclose()     # aborts the request if the call went away first

    def _forget(self, key, peer: str, engine_id: str) -> None:
        if key is not None and self.owned.get(key) == engine_id:
            del self.owned[key]
        self.owned.pop((peer, engine_id), None)

    def _call_ended(self, engine, key, peer: str, engine_id: str) -> None:
        self._forget(key, peer, engine_id)
        engine.abort(engine_id)           # a no-op for a request that has finished

    # ---- RPCs -------------------------------------------------------------------
    async def Generate(self, raw: bytes, context):
        async with aclosing(self._run(raw, context)) as run:   # unwound however this handler ends
            async for ev, shown_id, engine_id in run:
                if ev is None:
                    await context.send_initial_metadata(((REQUEST_ID_HEADER, engine_id),))
                elif isinstance(ev, Chunk):
                    yield pb.GenerateResponse(chunk=pb.Chunk(token_ids=ev.token_ids, text=ev.text,
                                                             position=ev.position,
                                                             logprobs=logprobs_proto(ev.logprobs)))
                elif isinstance(ev, Rollback):
                    yield pb.GenerateResponse(rollback=pb.Rollback(position=ev.position))
                else:
                    yield pb.GenerateResponse(complete=complete_proto(ev, shown_id))

    async def Complete(self, raw: bytes, context):
        async with aclosing(self._run(raw, context)) as run:
            async for ev, shown_id, _ in run:
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
        why = untrainable(asdict(e.reproducibility))
        source = e.loaded.source if self.gateway.settings.expose_model_path else ""
        return pb.ModelInfo(name=self.gateway.model_name(), source=source, fingerprint=e.loaded.fingerprint,
                            dtype=e.config.dtype,
                            vocab_size=mc.vocab_size, max_model_len=e.max_model_len, num_layers=mc.num_layers,
                            hidden_size=mc.hidden_size, eos_token_ids=sorted(e.stop.eos),
                            architecture=mc.architecture,
                            has_chat_template=bool(getattr(e.tokenizer, "chat_template", None)),
                            weight_version=e.weight_version, trainable=not why, untrainable_reason=why)

    async def GetServerInfo(self, raw: bytes, context):
        await self._parse(pb.GetServerInfoRequest, raw, context)
        e = await self._engine(context)
        counts = e.counts   # an immutable record the engine thread replaces
        return pb.ServerInfo(engine_version=e.version, device_kind=e.reproducibility.device_kind,
                             kernel_plan=e.config.plan,
                             self_check_passed=e.selfcheck.passed, self_check=e.selfcheck.describe(),
                             gate=pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window),
                             requests_running=counts.running, requests_waiting=counts.waiting,
                             kv_cache_usage=counts.kv_usage, max_queue=e.config.max_queue,
                             reproducibility=reproducibility_proto(e.reproducibility, None))

    async def _admin(self, context) -> None:
        """Refuse the call unless the server has an admin token and the call carries it."""
        if not self.admin_token:
            await self._refuse(context, Refusal(Kind.DENIED, "admin RPCs are disabled: start the server with "
                                                             "GATEENG_ADMIN_TOKEN or --admin-token-file"))
        # With an API key set, the call carries it too, in another `authorization` entry (auth.py).
        values = [v for k, v in context.invocation_metadata() if k == "authorization"]
        if not auth.bearer_matches(values, self.admin_token):
            await self._refuse(context, Refusal(Kind.UNAUTHENTICATED,
                                                "admin RPC needs metadata `authorization: Bearer <admin token>`"))

    async def UpdateGateConfig(self, raw: bytes, context):
        await self._admin(context)
        request = await self._parse(pb.UpdateGateConfigRequest, raw, context)
        e = await self._engine(context)
        try:
            tau = validate_threshold(request.margin_threshold) if request.HasField("margin_threshold") else None
            w = validate_window(request.max_window) if request.HasField("max_window") else None
            self.gateway.bounds.check(tau, w, what="UpdateGateConfig")
            if w is not None and w + 1 > e.config.max_num_batched_tokens:
                raise ValueError(f"max_window must be below the step token budget {e.config.max_num_batched_tokens}")
        except ValueError as err:
            await self._refuse(context, refusals.from_engine(err))
        if tau is not None:
            e.set_margin_threshold(tau)
        if w is not None:
            e.set_max_window(w)
        log.info("gate config now tau=%s W=%s", e.margin_threshold, e.max_window)
        return pb.GateConfig(margin_threshold=e.margin_threshold, max_window=e.max_window)

    async def UpdateWeights(self, raw: bytes, context):
        await self._admin(context)
        request = await self._parse(pb.UpdateWeightsRequest, raw, context)
        e = await self._engine(context)
        # Reading, checking and packing take seconds: on their own thread, never the
        # event loop's. A call that goes away meanwhile does not stop the update.
        try:
            result = await asyncio.get_running_loop().run_in_executor(self.weights_pool, e.update_weights,
                                                                      request.path)
        except (ValueError, WeightUpdateUnavailable, EngineDead) as err:   # WeightsRefused is a ValueError
            await self._refuse(context, refusals.from_engine(err))
        return pb.UpdateWeightsResponse(model_fingerprint=result.model_fingerprint,
                                        weight_version=result.weight_version, seconds=result.seconds,
                                        requests_ended=result.requests_ended)

    def handler(self) -> grpc.GenericRpcHandler:
        """Handlers that take raw bytes, so a malformed request is INVALID_ARGUMENT
        (grpc_edge.parse) rather than the INTERNAL a failed deserializer gives."""
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
            "UpdateWeights": grpc.unary_unary_rpc_method_handler(self.UpdateWeights,
                                                                 response_serializer=out(pb.UpdateWeightsResponse)),
        }
        return grpc.method_handlers_generic_handler(SERVICE, methods)


class GrpcFront:
    """The gRPC server: the Engine service, health (NOT_SERVING until the gateway
    says otherwise) and reflection, on one port. With `api_key`, every Engine call
    needs it (auth.py); health and reflection stay open."""

    def __init__(self, gateway: Gateway, host: str, port: int, admin_token: Optional[str] = None,
                 api_key: Optional[str] = None, limits: GrpcLimits = GrpcLimits(), tls: Optional[ServerTls] = None):
        self.service = EngineService(gateway, admin_token)
        self.health = health_aio.HealthServicer()
        interceptors = [auth.GrpcApiKey(api_key, SERVICE, lambda r: gateway.count(r, "grpc"))] if api_key else []
        self.server = grpc.aio.server(options=grpc_options(limits), interceptors=interceptors)
        self.server.add_generic_rpc_handlers((self.service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self.server)
        # gRPC listens where only the accept gate reaches it (a private directory);
        # the public port is the gate's.
        self.socket_dir = tempfile.mkdtemp(prefix="gateeng-grpc-")
        path = os.path.join(self.socket_dir, "grpc.sock")
        bound = (self.server.add_secure_port(f"unix:{path}", tls.grpc_credentials()) if tls is not None
                 else self.server.add_insecure_port(f"unix:{path}"))
        if bound == 0:
            raise OSError(f"gRPC cannot listen on unix:{path}")
        try:
            self.gate = GrpcGate(host, port, path, limits, tls=tls is not None)
        except OSError:
            shutil.rmtree(self.socket_dir, ignore_errors=True)
            raise
        self.port = self.gate.port

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def start(self) -> None:
        await self.set_serving(False)
        await self.server.start()
        self.gate.start()

    async def stop(self, grace: Optional[float]) -> None:
        self.gate.stop_accepting()
        await self.server.stop(grace)
        await self.gate.stop()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        self.service.weights_pool.shutdown(wait=False)
