"""No request outlives its client: a call cancelled, or past its deadline, at any
moment (before its prompt is tokenized, while the tokenizer pool submits it, or
while it decodes) is aborted, and its slot and KV blocks are freed."""
import asyncio
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from gateeng.config import EngineConfig, ServerConfig
from gateeng.engine.aio import stream_request
from gateeng.engine.engine import Engine
from gateeng.model.loader import LoadedModel
from gateeng.request import SamplingParams
from gateeng.v1 import engine_pb2 as pb
from gateeng.v1 import engine_pb2_grpc as pb_grpc
from tests.test_server_async import Running
from tests.tiny import ByteTokenizer, hf_tiny, tiny_loaded

CONTEXT = 1024
# Long enough that a request nobody aborts still decodes seconds after its call ended.
GHOST_TOKENS = 1000


class SlowTokenizer(ByteTokenizer):
    """Takes a few milliseconds per prompt, as a long prompt does on a real
    tokenizer: 1 ms and 10 ms deadlines then pass while the pool is inside submit."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        time.sleep(self.seconds)
        return super().encode(text, add_special_tokens, split_special_tokens)


class GatedTokenizer(ByteTokenizer):
    """Blocks inside encode until the test lets it go."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def encode(self, text, add_special_tokens=False, split_special_tokens=False):
        self.entered.set()
        assert self.release.wait(30)
        return super().encode(text, add_special_tokens, split_special_tokens)


def long_context_loaded(tokenizer) -> LoadedModel:
    loaded = tiny_loaded("float32", hf_tiny(max_positions=CONTEXT))
    loaded.tokenizer = tokenizer
    return loaded


def small_config(**kw):
    base = dict(dtype="float32", num_kv_blocks=2 * CONTEXT // 4 + 16, max_model_len=CONTEXT, block_size=4,
                attention_split=8, invariant_rows=8, max_num_batched_tokens=64, max_num_seqs=2, max_queue=2)
    base.update(kw)
    return EngineConfig(**base)


def idle(engine) -> bool:
    c = engine.counts
    return engine.num_in_flight == 0 and (c.running, c.waiting, c.kv_usage) == (0, 0, 0.0)


def wait_idle(engine, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if idle(engine):
            return True
        time.sleep(0.01)
    return idle(engine)


# ---- the engine's asyncio iterator, one moment at a time ---------------------------
@pytest.mark.parametrize("moment", ["before the pool starts it", "inside submit", "after submit"])
def test_cancelling_stream_request_at_any_moment_aborts_the_request(moment):
    tokenizer = GatedTokenizer()
    engine = Engine(small_config(), long_context_loaded(tokenizer))
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        if moment == "before the pool starts it":   # the one worker is busy elsewhere
            busy = threading.Event()
            pool.submit(busy.wait, 30)

        async def main():
            stream = stream_request(engine, pool, "a prompt", SamplingParams(max_tokens=GHOST_TOKENS,
                                                                             ignore_eos=True), None, None)

            async def follow():
                async for _ in stream:
                    pass
            task = asyncio.ensure_future(follow())
            if moment == "inside submit":
                while not tokenizer.entered.is_set():
                    await asyncio.sleep(0.001)
            elif moment == "after submit":
                tokenizer.release.set()
                while engine.counts.running == 0:
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0.05)               # decoding now
            else:
                await asyncio.sleep(0.02)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            tokenizer.release.set()
            if moment == "before the pool starts it":
                busy.set()
        asyncio.run(main())
        pool.shutdown(wait=True)                        # submit, where it ran, has returned
        assert wait_idle(engine, 1.0), (engine.num_in_flight, engine.counts)
    finally:
        tokenizer.release.set()
        pool.shutdown(wait=False)
        engine.shutdown()


# ---- a storm of calls that go away, against a real server ---------------------------
def generate_request(rng):
    return pb.GenerateRequest(text="storm " * rng.randint(1, 6),
                              sampling=pb.SamplingParams(max_tokens=GHOST_TOKENS, ignore_eos=True),
                              determinism=pb.Determinism(mode=rng.choice([1, 2])))


async def storm(target, calls: int, seed: int) -> dict:
    """`calls` Generate and Complete calls over a few connections: a third with a 1 ms
    deadline, a third with 10 ms, a third cancelled by the client 0-30 ms in."""
    rng = random.Random(seed)
    channels = [grpc.aio.insecure_channel(target, options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(4)]
    stubs = [pb_grpc.EngineStub(ch) for ch in channels]
    outcomes: dict = {}

    async def one(i):
        stub, req = stubs[i % len(stubs)], generate_request(rng)
        kind = i % 3
        timeout = {0: 0.001, 1: 0.010, 2: None}[kind]
        call = stub.Generate(req, timeout=timeout) if i % 2 else stub.Complete(req, timeout=timeout)
        if kind == 2:
            asyncio.get_running_loop().call_later(rng.uniform(0, 0.03), call.cancel)
        try:
            if i % 2:
                async for _ in call:
                    pass
            else:
                await call
            outcome = "answered"
        except asyncio.CancelledError:
            outcome = "CANCELLED"
        except grpc.aio.AioRpcError as e:
            outcome = e.code().name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    tasks = []
    for i in range(calls):
        tasks.append(asyncio.ensure_future(one(i)))
        await asyncio.sleep(rng.uniform(0, 0.004))
    await asyncio.gather(*tasks)
    for ch in channels:
        await ch.close()
    return outcomes


def test_a_storm_of_cancels_and_short_deadlines_leaves_no_request_behind():
    srv = Running(small_config(), loaded=long_context_loaded(SlowTokenizer(0.003)),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=None, drain_seconds=0))
    try:
        engine = srv.server.gateway.engine
        outcomes = asyncio.run(storm(srv.target, 200, seed=7))
        assert "answered" not in outcomes, outcomes     # every call went away before its end
        assert outcomes.get("DEADLINE_EXCEEDED") and outcomes.get("CANCELLED"), outcomes
        assert wait_idle(engine, 1.0), f"left behind: {engine.num_in_flight} in flight, {engine.counts}"

        stub = pb_grpc.EngineStub(grpc.insecure_channel(srv.target))
        info = stub.GetServerInfo(pb.GetServerInfoRequest(), timeout=5)
        assert (info.requests_running, info.requests_waiting, info.kv_cache_usage) == (0, 0, 0.0)
        answer = stub.Complete(pb.GenerateRequest(text="after the storm",
                                                  sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)),
                               timeout=10)
        assert answer.finish_reason == pb.LENGTH and answer.usage.completion_tokens == 8
    finally:
        srv.stop(timeout=30)
