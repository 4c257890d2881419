"""The asyncio server in-process on a tiny random model: liveness under many
streams, queue bounds, request ownership, drain and engine death."""
import asyncio
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gateeng.config import EngineConfig, ServerConfig
from gateeng.serving.server import REQUEST_ID_HEADER, Server
from gateeng.v1 import engine_pb2 as pb
from gateeng.v1 import engine_pb2_grpc as pb_grpc
from tests.tiny import tiny_loaded

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING


def tiny_config(**kw):
    base = dict(dtype="float32", num_kv_blocks=512, max_model_len=128, block_size=4, attention_split=8,
                invariant_rows=8, max_num_batched_tokens=64, max_num_seqs=64)
    base.update(kw)
    return EngineConfig(**base)


class Running:
    """A Server on its own thread and event loop, as `gateeng serve` runs it."""

    def __init__(self, config, drain_seconds=30.0, loaded=None, settings=None, admin_token=None, credentials=None):
        settings = settings or ServerConfig(port=0, metrics_port=None, http_port=None, drain_seconds=drain_seconds)
        self.server = Server(config, settings, loaded=loaded or tiny_loaded("float32"), admin_token=admin_token)
        self.exit_code = None
        self.loop = None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        deadline = time.time() + 60
        while self.server.gateway.engine is None or self.server.port == 0:
            assert time.time() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.05)
        self.target = f"127.0.0.1:{self.server.port}"
        self.credentials = credentials          # gRPC channel credentials, for a server with TLS
        wait_for(self.target, SERVING, credentials=credentials)

    def health(self, timeout=1.0):
        return health(self.target, timeout, self.credentials)

    def _main(self):
        async def main():
            self.loop = asyncio.get_running_loop()
            return await self.server.run()
        self.exit_code = asyncio.run(main())

    def stop(self, timeout=60):
        self.loop.call_soon_threadsafe(self.server.request_stop)
        self.thread.join(timeout)
        return self.exit_code


def channel(target, credentials=None):
    # Its own connection (no shared subchannel), as a separate client process has.
    options = [("grpc.use_local_subchannel_pool", 1)]
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=options)
    return grpc.insecure_channel(target, options=options)


def health(target, timeout=1.0, credentials=None):
    return health_pb2_grpc.HealthStub(channel(target, credentials)).Check(
        health_pb2.HealthCheckRequest(service="gateeng.v1.Engine"), timeout=timeout).status


def wait_for(target, want, timeout=60, credentials=None):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if health(target, credentials=credentials) == want:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"health never reached {want}")


def request(max_tokens=40, rid="", **det):
    return pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6, 7]), request_id=rid,
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                              determinism=pb.Determinism(**det))


def test_health_answers_while_200_streams_are_open():
    srv = Running(tiny_config())
    try:
        stub = pb_grpc.EngineStub(channel(srv.target))
        calls = [stub.Generate(request(100, mode=2 if i % 2 else 1), timeout=300) for i in range(200)]
        done = {}

        def drain(i, call):
            try:
                done[i] = [ev for ev in call][-1].complete
            except grpc.RpcError as e:
                done[i] = e.code()
        threads = [threading.Thread(target=drain, args=(i, c)) for i, c in enumerate(calls)]
        for t in threads:
            t.start()
        checks = []
        while any(t.is_alive() for t in threads):
            checks.append(health(srv.target, timeout=1.0))    # a timeout raises and fails the test
            time.sleep(0.05)
        for t in threads:
            t.join()
        assert len(checks) >= 3 and set(checks) == {SERVING}
        codes = [d for d in done.values() if not isinstance(d, pb.CompleteResponse)]
        assert codes == [], codes                            # max_queue 256: everyone is admitted
        assert all(d.usage.completion_tokens == 100 for d in done.values())
        counts = srv.server.gateway.engine.counts
        assert (counts.running, counts.waiting, counts.kv_usage) == (0, 0, 0.0)
    finally:
        assert srv.stop() == 0


def test_a_full_queue_answers_resource_exhausted_with_a_retry_hint():
    srv = Running(tiny_config(max_num_seqs=2, max_queue=3))
    try:
        stub = pb_grpc.EngineStub(channel(srv.target))
        futures = [stub.Complete.future(request(60), timeout=120) for _ in range(12)]
        ok, refused = [], []
        for f in futures:
            try:
                ok.append(f.result())
            except grpc.RpcError as e:
                refused.append(e)
        assert refused and ok
        assert all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert all(dict(e.trailing_metadata())["grpc-retry-pushback-ms"] == "1000" for e in refused)
        assert "retry" in refused[0].details()
        assert all(r.usage.completion_tokens == 60 for r in ok)
    finally:
        srv.stop()


def test_a_client_can_abort_only_its_own_requests():
    # Long requests, so that they are still running on a busy host when the other calls come.
    srv = Running(tiny_config(max_model_len=512))
    try:
        mine, other = pb_grpc.EngineStub(channel(srv.target)), pb_grpc.EngineStub(channel(srv.target))
        call = mine.Generate(request(500, rid="job-1"), timeout=120)
        events = iter(call)
        next(events)
        server_id = dict(call.initial_metadata())[REQUEST_ID_HEADER]
        assert server_id.startswith("req-") and len(server_id) >= 36 and server_id != "job-1"   # 128 random bits
        anonymous = mine.Generate(request(500), timeout=120)
        anon_events = iter(anonymous)
        next(anon_events)
        anon_id = dict(anonymous.initial_metadata())[REQUEST_ID_HEADER]
        assert anon_id.startswith("req-") and len(anon_id) >= 36     # 128 random bits
        # Another connection sees neither id, exactly as if it did not exist ...
        assert not other.Abort(pb.AbortRequest(request_id="job-1")).found
        assert not other.Abort(pb.AbortRequest(request_id=anon_id)).found
        # ... and may use the same client id for its own request.
        assert other.Complete(request(4, rid="job-1"), timeout=60).request_id == "job-1"
        with pytest.raises(grpc.RpcError) as ei:
            mine.Complete(request(4, rid="job-1"), timeout=60)
        assert ei.value.code() == grpc.StatusCode.ALREADY_EXISTS
        assert not other.Abort(pb.AbortRequest(request_id=server_id)).found
        assert mine.Abort(pb.AbortRequest(request_id="job-1")).found
        assert mine.Abort(pb.AbortRequest(request_id=anon_id)).found
        for evs in (events, anon_events):
            final = [ev for ev in evs][-1].complete
            assert final.finish_reason == pb.ABORT
    finally:
        srv.stop()


def test_requests_cut_by_the_drain_end_with_unavailable():
    srv = Running(tiny_config(max_model_len=512), drain_seconds=0.2)
    stub = pb_grpc.EngineStub(channel(srv.target))
    call = stub.Generate(request(500), timeout=120)
    events = iter(call)
    next(events)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    with pytest.raises(grpc.RpcError) as ei:
        for _ in events:
            pass
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "retry" in ei.value.details()
    stopper.join()
    assert srv.exit_code == 0


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_death_turns_health_not_serving_and_exits_nonzero(monkeypatch):
    srv = Running(tiny_config())
    stub = pb_grpc.EngineStub(channel(srv.target))
    assert stub.Complete(request(4), timeout=60).usage.completion_tokens == 4
    watch = health_pb2_grpc.HealthStub(channel(srv.target)).Watch(
        health_pb2.HealthCheckRequest(service="gateeng.v1.Engine"), timeout=60)
    statuses = iter(watch)
    assert next(statuses).status == SERVING
    engine = srv.server.gateway.engine

    def broken(plan):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(engine.core.runner, "run", broken)
    with pytest.raises(grpc.RpcError) as ei:
        stub.Complete(request(4), timeout=60)
    assert ei.value.code() == grpc.StatusCode.INTERNAL and "injected fault" in ei.value.details()
    assert next(statuses).status == NOT_SERVING
    srv.thread.join(60)
    assert srv.exit_code == 1


def test_a_server_that_owns_its_process_freezes_the_start_up_heap_once_the_engine_is_up(monkeypatch):
    import gc
    from gateeng.tools import cli
    froze = []
    # The real gc.freeze would exempt this test process's objects for good.
    monkeypatch.setattr(gc, "freeze", lambda: froze.append(True))
    srv = Running(tiny_config(), settings=ServerConfig(port=0, metrics_port=None, http_port=None, freeze_heap=True))
    try:
        assert froze == [True]
        stub = pb_grpc.EngineStub(channel(srv.target))
        assert stub.Complete(request(4), timeout=60).usage.completion_tokens == 4
    finally:
        srv.stop()
    serve = cli.build_parser()
    assert cli.server_config(serve.parse_args(["serve"])).freeze_heap          # `gateeng serve`: on
    assert not cli.server_config(serve.parse_args(["serve", "--no-heap-freeze"])).freeze_heap
    assert not ServerConfig().freeze_heap   # servers started in a shared process: off
