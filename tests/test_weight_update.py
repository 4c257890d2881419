"""Weights in place (Engine.update_weights, the UpdateWeights RPC, `gateeng
update-weights`) on a tiny bf16 model, the reference's dtype: after an update a
server answers VERIFIED requests bit for bit as a fresh server started on the new
weights; a broken checkpoint is refused naming the tensor and changes nothing;
the RPC needs the admin token; requests in flight finish on the old weights or
end (abort) without ever mixing two versions; the metrics and the CLI follow."""
import json
import shutil
import struct
import threading
import time
import urllib.request

import grpc
import pytest
import torch
from safetensors.torch import load_file, save_file

from gateeng.config import EngineConfig, ServerConfig
from gateeng.engine import weights
from gateeng.engine.core import EngineCore
from gateeng.engine.errors import WeightUpdateUnavailable
from gateeng.model import loader
from gateeng.outputs import Chunk
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.tools import cli
from gateeng.v1 import engine_pb2 as pb
from test_server_async import Running
from tiny import ByteTokenizer, hf_tiny, tiny_loaded

TOKEN = "weights-t0ken"
VERIFIED = DeterminismParams(Mode.VERIFIED)
PROMPTS = [[5, 17, 200, 3, 9], list(range(40, 61))]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, temperature=0.8, seed=7)


def config(**kw):
    base = dict(dtype="bfloat16", num_kv_blocks=256, max_model_len=256, block_size=4, max_num_batched_tokens=64,
                max_num_seqs=16)
    base.update(kw)
    return EngineConfig(**base)


@pytest.fixture(scope="module", autouse=True)
def reference_runs():
    if not reference_ops.runnable():
        pytest.skip("no build of the reference runs here")


class Served(Running):
    """A Server with an admin token and the HTTP front, on its own thread and loop."""

    def __init__(self, cfg, loaded, token=TOKEN):
        super().__init__(cfg, loaded=loaded, settings=ServerConfig(port=0, metrics_port=None, http_port=0),
                         admin_token=token)
        self.http = f"http://127.0.0.1:{self.server.http.port}"

    def metric(self, name, **labels):
        return self.server.metrics.value(name, **labels)

    def models(self):
        return json.loads(urllib.request.urlopen(self.http + "/v1/models", timeout=10).read())["data"][0]


def bits(x: float) -> str:
    return struct.pack("<d", x).hex()


def answers(target) -> list:
    """VERIFIED answers, greedy and seeded: token ids, every logprob's bits, the record's fingerprint."""
    out = []
    with Client(target) as c:
        for params in (GREEDY, SEEDED):
            for prompt in PROMPTS:
                r = c.complete(prompt, params, VERIFIED)
                out.append((list(r.token_ids),
                            [(bits(lp.logprob), [(t.token_id, bits(t.logprob)) for t in lp.top]) for lp in r.logprobs],
                            r.reproducibility.model_fingerprint))
    return out


def perturbed(seed=1):
    hf = hf_tiny()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return hf


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory):
    """The perturbed tiny model as transformers saves it: config.json and safetensors, no tokenizer."""
    path = tmp_path_factory.mktemp("new")
    perturbed().save_pretrained(path, safe_serialization=True)
    assert not list(path.glob("tokenizer*"))
    return path


def fresh_loaded(path):
    """The new weights loaded as `--model` loads them at start-up (the byte tokenizer in place of a file)."""
    original = loader.Tokenizer.from_dir
    loader.Tokenizer.from_dir = classmethod(lambda cls, d: ByteTokenizer())
    try:
        return loader.load(str(path), "bfloat16")
    finally:
        loader.Tokenizer.from_dir = original


# ---- (a) an update serves what a fresh start on the new weights serves ----------------------

def test_update_answers_as_a_fresh_server_on_the_new_weights(new_dir):
    srv = Served(config(), tiny_loaded("bfloat16"))
    try:
        before = answers(srv.target)
        assert srv.models()["weight_version"] == 0
        with Client(srv.target, admin_token=TOKEN) as c:
            assert c.model_info().weight_version == 0
            res = c.update_weights(str(new_dir))
            info = c.model_info()
        after = answers(srv.target)
        models = srv.models()
    finally:
        srv.stop()
    loaded = fresh_loaded(new_dir)
    fresh = Served(config(), loaded)
    try:
        want = answers(fresh.target)
    finally:
        fresh.stop()
    assert res.weight_version == 1 and res.requests_ended == 0 and 0 < res.seconds < 60
    assert res.model_fingerprint == loaded.fingerprint == info.fingerprint
    assert info.weight_version == 1
    assert models["weight_version"] == 1 and models["reproducibility"]["model_fingerprint"] == loaded.fingerprint
    assert after == want                                  # tokens, logprob bits and the record's fingerprint
    assert all(a[2] == loaded.fingerprint for a in after)
    assert [a[0] for a in after] != [b[0] for b in before]
    assert all(b[2] == "tiny-random" for b in before)


# ---- (b) a broken update is refused, naming what is wrong, and changes nothing ---------------

def broken(tmp_path, new_dir, kind):
    """A copy of new_dir broken one way; returns (its path, what the refusal must name)."""
    d = tmp_path / kind
    d.mkdir()
    config_json = json.loads((new_dir / "config.json").read_text())
    sd = load_file(str(new_dir / "model.safetensors"))
    down = "model.layers.1.mlp.down_proj.weight"
    expect = down
    if kind == "missing":
        del sd[down]
        expect = f"missing tensor {down}"
    elif kind == "extra":
        sd["model.layers.2.mlp.down_proj.weight"] = sd[down].clone()
        expect = "extra tensor model.layers.2.mlp.down_proj.weight"
    elif kind == "shape":
        sd[down] = sd[down][:, :-1].contiguous()
        expect = f"{down}: shape [64, 128] expected, got [64, 127]"
    elif kind == "nan":
        sd[down][3, :5] = float("nan")
        expect = f"{down}: 5 values are NaN or Inf"
    elif kind == "inf":
        sd[down][0, 0] = float("inf")
        sd[down][1, 1] = float("-inf")
        expect = f"{down}: 2 values are NaN or Inf"
    elif kind == "overflow":   # finite in float32, Inf once rounded to the served bfloat16
        sd[down][0, 0] = 3.4e38
        expect = f"{down}: 1 value is beyond bfloat16's range"
    elif kind == "dtype":
        sd[down] = torch.ones(sd[down].shape, dtype=torch.int32)
        expect = f"{down}: dtype I32 cannot be served as bfloat16"
    elif kind == "config":
        config_json["rms_norm_eps"] = 1e-6
        expect = "rms_norm_eps 1e-05 expected, got 1e-06"
    if kind in ("garbage", "truncated"):
        if kind == "garbage":
            (d / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00not json")
        else:
            data = (new_dir / "model.safetensors").read_bytes()
            (d / "model.safetensors").write_bytes(data[:len(data) // 2])
        expect = f"unreadable file {d / 'model.safetensors'}"
    else:
        save_file(sd, str(d / "model.safetensors"), metadata={"format": "pt"})
    (d / "config.json").write_text(json.dumps(config_json))
    return d, expect


BROKEN = ("missing", "extra", "shape", "nan", "inf", "overflow", "dtype", "config", "garbage", "truncated")


@pytest.fixture(scope="module")
def served(reference_runs):
    srv = Served(config(), tiny_loaded("bfloat16"))
    yield srv
    srv.stop()


def test_broken_updates_are_refused_naming_the_tensor_and_change_nothing(served, new_dir, tmp_path):
    before = answers(served.target)
    with Client(served.target, admin_token=TOKEN) as c:
        for kind in BROKEN:
            path, expect = broken(tmp_path, new_dir, kind)
            with pytest.raises(grpc.RpcError) as err:
                c.update_weights(str(path))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, kind
            assert expect in err.value.details(), (kind, err.value.details())
            info = c.model_info()
            assert (info.fingerprint, info.weight_version) == ("tiny-random", 0), kind
        for path, expect in ((tmp_path / "nowhere", "not a directory"), ("", "no path given")):
            with pytest.raises(grpc.RpcError) as err:
                c.update_weights(str(path))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and expect in err.value.details()
    assert answers(served.target) == before
    assert served.models()["weight_version"] == 0
    # (e) refusals are counted; nothing was applied
    assert served.metric("gateeng_weight_updates_total", result="refused") == len(BROKEN) + 2
    assert served.metric("gateeng_weight_updates_total", result="applied") == 0
    assert served.metric("gateeng_weight_version") == 0


def test_a_refusal_names_every_problem_up_to_a_bound(tmp_path, new_dir):
    d = tmp_path / "many"
    d.mkdir()
    shutil.copy(new_dir / "config.json", d / "config.json")
    sd = load_file(str(new_dir / "model.safetensors"))
    for name in list(sd)[:10]:
        del sd[name]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensor .*; and 2 more$"):
        weights.prepare(config(), tiny_loaded("bfloat16").config, d)


# ---- (c) no token, no update -------------------------------------------------------------------

def test_no_token_no_update(served, new_dir):
    for token in (None, "wrong"):
        with Client(served.target, admin_token=token) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.update_weights(str(new_dir))
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert Client(served.target).model_info().weight_version == 0


def test_a_server_without_a_token_refuses_updates(new_dir):
    srv = Served(config(), tiny_loaded("bfloat16"), token=None)
    try:
        with Client(srv.target, admin_token=TOKEN) as c:
            with pytest.raises(grpc.RpcError) as err:
                c.update_weights(str(new_dir))
            assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
            assert c.model_info().weight_version == 0
    finally:
        srv.stop()


def test_a_gguf_served_as_stored_and_cuda_fail_closed_at_every_size():
    for size in (1, 2):   # tensor parallelism updates in place (tests/test_tensor_parallel_weights.py)
        with pytest.raises(WeightUpdateUnavailable, match="--dequantize"):
            weights.refuse_unless_supported(EngineConfig(tensor_parallel_size=size), quantized=True)
        with pytest.raises(WeightUpdateUnavailable, match="in place on cuda"):
            weights.refuse_unless_supported(EngineConfig(device="cuda", tensor_parallel_size=size))


# ---- (d) requests in flight ----------------------------------------------------------------------

def reference(loaded, prompt, params) -> list:
    """A VERIFIED answer's tokens alone on `loaded` (the reference for those weights)."""
    core = EngineCore(config(verified_route="direct"), loaded)
    h = core.add_request(core.new_request(prompt, params, VERIFIED))
    while core.has_work():
        core.step()
    return h.completion.token_ids


LONG = SamplingParams(max_tokens=40, ignore_eos=True)


def test_in_flight_requests_finish_on_the_old_weights_and_nothing_new_is_admitted(new_dir):
    old, new = tiny_loaded("bfloat16"), fresh_loaded(new_dir)
    core = EngineCore(config(weight_update_wait=60, verified_route="speculative"), old)
    running = core.add_request(core.new_request(PROMPTS[0], LONG, VERIFIED))
    preempted = core.add_request(core.new_request(PROMPTS[1], LONG, VERIFIED))
    for _ in range(6):
        core.step()
    long_prompt = list(range(100, 160))   # prefilled in chunks while the others decode
    prefilling = core.add_request(core.new_request(long_prompt, LONG, VERIFIED))
    core.step()
    sch = core.scheduler
    req = {r.request_id: r for r in sch.running}
    assert req[preempted.request_id].output_ids
    assert 0 < req[prefilling.request_id].num_computed < len(long_prompt)
    assert not req[prefilling.request_id].output_ids
    sch._preempt(req[preempted.request_id])     # preempted with output: ends at the swap
    sch._preempt(req[prefilling.request_id])    # preempted before any output: starts over on the new weights
    core.begin_weight_update(weights.prepare(core.config, core.model_config, new_dir))
    late = core.add_request(core.new_request(PROMPTS[1], LONG, VERIFIED))   # arrives during the wait
    while not core.weight_update_due():
        core.step()
        assert {r.request_id for r in sch.running} <= {running.request_id}   # nobody joins the batch
    assert running.done.is_set() and running.completion.finish_reason is FinishReason.LENGTH
    assert core.apply_weight_update() == 1
    assert preempted.completion.finish_reason is FinishReason.ABORT
    assert preempted.completion.finish_detail == weights.ENDED
    assert core.weight_version == 1 and core.blocks.cache == {}
    while core.has_work():
        core.step()
    assert running.completion.token_ids == reference(old, PROMPTS[0], LONG)
    assert running.completion.reproducibility.model_fingerprint == "tiny-random"
    done = preempted.completion.token_ids
    assert done and done == reference(old, PROMPTS[1], LONG)[:len(done)]
    assert preempted.completion.reproducibility.model_fingerprint == "tiny-random"
    for h, prompt in ((late, PROMPTS[1]), (prefilling, long_prompt)):
        assert h.completion.finish_reason is FinishReason.LENGTH
        assert h.completion.token_ids == reference(new, prompt, LONG)
        assert h.completion.reproducibility.model_fingerprint == new.fingerprint
    # Every chunk names the weights that computed its tokens, as the record does.
    for h, version in ((running, 0), (preempted, 0), (late, 1), (prefilling, 1)):
        chunks = [ev for ev in h if isinstance(ev, Chunk) and ev.token_ids]
        assert chunks and {c.weight_version for c in chunks} == {h.completion.reproducibility.weight_version} \
            == {version}


def test_requests_still_running_at_the_deadline_end_on_their_verified_tokens(new_dir):
    old = tiny_loaded("bfloat16")
    core = EngineCore(config(weight_update_wait=0, verified_route="speculative"), old)
    handles = [core.add_request(core.new_request(p, LONG, d)) for p in PROMPTS
               for d in (VERIFIED, DeterminismParams(Mode.OFF))]
    for _ in range(8):
        core.step()
    core.begin_weight_update(weights.prepare(core.config, core.model_config, new_dir))
    assert core.weight_update_due()
    assert core.apply_weight_update() == len(handles)
    assert core.scheduler.running == [] and core.blocks.num_free == core.blocks.num_blocks
    assert core.blocks.cache == {}
    for h, (prompt, mode) in zip(handles, [(p, m) for p in PROMPTS for m in (Mode.VERIFIED, Mode.OFF)]):
        c = h.completion
        assert c.finish_reason is FinishReason.ABORT and c.finish_detail == weights.ENDED
        assert c.reproducibility.model_fingerprint == "tiny-random"
        if mode is Mode.VERIFIED:   # only verified tokens: a prefix of the old weights' reference
            ref = reference(old, prompt, LONG)
            assert c.token_ids == ref[:len(c.token_ids)]


def test_streams_in_flight_during_an_rpc_update_end_as_documented(new_dir):
    srv = Served(config(weight_update_wait=0, max_model_len=512, num_kv_blocks=512),
                 tiny_loaded("bfloat16"))
    try:
        long = SamplingParams(max_tokens=400, ignore_eos=True)
        body = json.dumps({"model": "tiny", "prompt": PROMPTS[1], "max_tokens": 400, "temperature": 0,
                           "ignore_eos": True, "determinism": {"mode": "verified"}}).encode()
        http = []
        post = threading.Thread(target=lambda: http.append(json.loads(urllib.request.urlopen(
            urllib.request.Request(srv.http + "/v1/completions", body, {"Content-Type": "application/json"}),
            timeout=60).read())))
        post.start()
        with Client(srv.target, admin_token=TOKEN) as c:
            streams = [c.generate(p, long, VERIFIED) for p in PROMPTS]
            for s in streams:   # each has produced a token on the old weights
                assert next(s).WhichOneof("event") == "chunk"
            engine = srv.server.gateway.engine
            deadline = time.time() + 30
            while engine.counts.running < 3:
                assert time.time() < deadline
                time.sleep(0.01)
            res = c.update_weights(str(new_dir))
            finals = [[ev for ev in s if ev.WhichOneof("event") == "complete"][0].complete for s in streams]
            after = c.complete(PROMPTS[0], LONG, VERIFIED)
        post.join(60)
    finally:
        srv.stop()
    ended = [f for f in finals if f.finish_reason == pb.ABORT]
    (answer,) = http
    assert res.requests_ended == len(ended) + (answer["choices"][0]["finish_reason"] == "abort") >= 1
    for f in ended:
        assert f.finish_detail == "ended by a weight update"
        assert f.reproducibility.model_fingerprint == "tiny-random"
    if answer["choices"][0]["finish_reason"] == "abort":
        assert answer["finish_detail"] == "ended by a weight update"
        assert answer["reproducibility"]["model_fingerprint"] == "tiny-random"
    assert after.reproducibility.model_fingerprint == res.model_fingerprint
    assert list(after.token_ids) == reference(fresh_loaded(new_dir), PROMPTS[0], LONG)


# ---- (e) metrics, (f) the CLI -----------------------------------------------------------------

def test_cli_update_weights_against_a_server(new_dir, tmp_path, capsys):
    srv = Served(config(), tiny_loaded("bfloat16"))
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    try:
        assert cli.main(["update-weights", "--server", srv.target, str(new_dir),
                         "--admin-token-file", str(token_file)]) == 0
        out = capsys.readouterr().out
        fingerprint = fresh_loaded(new_dir).fingerprint
        assert "weight_version 1" in out and fingerprint in out and " s, 0 requests ended" in out
        assert srv.metric("gateeng_weight_updates_total", result="applied") == 1
        assert srv.metric("gateeng_weight_version") == 1
        assert 0 < srv.metric("gateeng_weight_update_seconds") < 60
        bad, expect = broken(tmp_path, new_dir, "shape")
        assert cli.main(["update-weights", "--server", srv.target, str(bad),
                         "--admin-token-file", str(token_file)]) == 2
        err = capsys.readouterr().err
        assert "INVALID_ARGUMENT" in err and expect in err
        assert cli.main(["update-weights", "--server", srv.target, str(new_dir)]) == 2
        assert "admin token is missing" in capsys.readouterr().err
        assert srv.metric("gateeng_weight_updates_total", result="refused") == 1
        assert Client(srv.target).model_info().weight_version == 1
    finally:
        srv.stop()


def test_the_swap_lets_the_old_weights_go(new_dir):
    """Nothing keeps the old model once swapped out: its memory is freed by reference
    counting alone (a server freezes its start-up heap, gc.freeze, so a cycle would
    keep it for the process's life)."""
    import gc
    import weakref
    from gateeng.engine.engine import Engine
    engine = Engine(config(verified_route="speculative"), loaded=fresh_loaded(new_dir))
    old = weakref.ref(engine.model)
    try:
        gc.disable()
        engine.update_weights(new_dir)
        assert engine.weight_version == 1 and engine.core.runner.model is engine.model
        assert old() is None
    finally:
        gc.enable()
        engine.shutdown()
