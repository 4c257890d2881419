"""`gateeng replay` against responses a real server gave under mixed load, through
the real `openai` client and the gRPC client, on the tiny bf16 spec model (the
reference gateeng-ref-1): replayed on a local engine, over gRPC and over HTTP."""
import dataclasses
import json
import re
import subprocess
import sys
import threading

import openai
import pytest
from google.protobuf import json_format

from gateeng.answers import Answer
from gateeng.config import EngineConfig, ServerConfig
from gateeng.plans.kernel_names import REFERENCE
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.tools import replay as rp
from test_server_async import Running
from tiny import spec_tiny

VERIFIED = {"determinism": {"mode": "verified"}}


def config():
    return EngineConfig(dtype="bfloat16", num_kv_blocks=256, max_model_len=128, block_size=4, max_num_seqs=32,
                        max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A server, and a JSONL of the responses it gave: HTTP completion and chat bodies
    and gRPC CompleteResponses, VERIFIED and OFF, each amid OFF noise."""
    srv = Running(config(), loaded=spec_tiny(), settings=ServerConfig(port=0, metrics_port=None, http_port=0))
    base = f"http://127.0.0.1:{srv.server.http.port}"
    api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    bodies = {}
    noise_done = threading.Event()

    def noise():
        with Client(srv.target) as c:
            while not noise_done.is_set():
                c.complete([7, 8, 9, 10, 11], SamplingParams(max_tokens=20, ignore_eos=True, temperature=1.0),
                           timeout=120)
    noisy = [threading.Thread(target=noise) for _ in range(4)]
    for t in noisy:
        t.start()
    try:
        bodies["http-greedy"] = api.completions.create(
            model="tiny-spec", prompt="abcdefgh", max_tokens=12, temperature=0, logprobs=3,
            extra_body={**VERIFIED, "ignore_eos": True}).model_dump()
        bodies["http-chat-seeded"] = api.chat.completions.create(
            model="tiny-spec", messages=[{"role": "user", "content": "hi there"}], max_tokens=10, temperature=0.9,
            logprobs=True, top_logprobs=2, extra_body=VERIFIED).model_dump()
        bodies["http-off"] = api.completions.create(model="tiny-spec", prompt="zyx", max_tokens=8, temperature=0,
                                                    extra_body={"ignore_eos": True}).model_dump()
        with Client(srv.target) as c:
            res = c.complete([40, 41, 42, 43, 44, 45], SamplingParams(max_tokens=14, temperature=0.7, top_k=20,
                                                                      ignore_eos=True, logprobs=2),
                             DeterminismParams(Mode.VERIFIED))
            bodies["grpc-seeded"] = json_format.MessageToDict(res, preserving_proto_field_name=True)
    finally:
        noise_done.set()
        for t in noisy:
            t.join()
    path = tmp_path_factory.mktemp("replay") / "evals.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies.values()))
    yield srv, base, bodies, path
    srv.stop()


def write(tmp_path, *bodies):
    path = tmp_path / "doctored.jsonl"
    path.write_text("".join(json.dumps(b) + "\n" for b in bodies))
    return path


def test_the_responses_carry_what_a_replay_needs(stored):
    _, _, bodies, path = stored
    http, grpc_ = bodies["http-greedy"], bodies["grpc-seeded"]
    assert http["reproducibility"]["reference"] == REFERENCE and http["replay"]["prompt_token_ids"]
    assert http["replay"]["token_ids"] and http["replay"]["sampling"]["temperature"] == 0
    assert grpc_["sampling"]["seed"] and grpc_["prompt_token_ids"]["ids"] == [40, 41, 42, 43, 44, 45]
    assert bodies["http-chat-seeded"]["replay"]["sampling"]["seed"] is not None   # the drawn seed
    items = rp.read(path)
    assert [type(item) for _, item in items] == [Answer] * 4
    assert [item.mode for _, item in items] == ["verified", "verified", "off", "verified"]


@pytest.mark.parametrize("where", ["local", "grpc", "openai"])
def test_responses_given_under_mixed_load_replay_identical(stored, where):
    srv, base, _, path = stored
    target = {"local": lambda: rp.LocalTarget(config(), loaded=spec_tiny()),
              "grpc": lambda: rp.GrpcTarget(srv.target), "openai": lambda: rp.OpenAITarget(base)}[where]()
    try:
        outcomes = rp.run(rp.read(path), target, show_progress=False)
    finally:
        target.close()
    verified = [o for o in outcomes if o.promised]
    assert len(verified) == 3 and all(o.identical for o in verified), [o.message for o in outcomes]
    assert all("logprob bits equal" in o.message for o in verified)
    (off,) = [o for o in outcomes if not o.promised]
    assert off.message.startswith("identical") or off.message.startswith("diverges")   # compared, promised nothing


def cli(*args):
    return subprocess.run([sys.executable, "-m", "gateeng.tools.cli", "replay", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def test_the_command_exits_0_when_every_verified_response_is_identical(stored):
    srv, base, _, path = stored
    for flag, where in (("--server", srv.target), ("--openai", base)):
        res = cli(path, flag, where)
        assert res.returncode == 0, res.stdout + res.stderr
        assert res.stdout.count("identical (") >= 3 and "no promise (OFF)" in res.stdout
        assert "3 of 3 VERIFIED identical" in res.stderr


@pytest.mark.parametrize("which", ["http-greedy", "grpc-seeded"])
def test_a_doctored_output_id_is_reported_at_its_index(stored, tmp_path, which):
    srv, _, bodies, _ = stored
    body = json.loads(json.dumps(bodies[which]))
    ids = body["replay"]["token_ids"] if which.startswith("http") else body["token_ids"]
    ids[5] = (ids[5] + 1) % 256
    res = cli(write(tmp_path, body), "--server", srv.target)
    assert res.returncode == 1
    assert re.search(rf"diverges at token 5: stored ('.*' )?\(id {ids[5]}, margin [-0-9.e]+\) vs replayed ('.*' )?"
                     rf"\(id {(ids[5] - 1) % 256}, margin", res.stdout), res.stdout
    assert "0 of 1 VERIFIED identical" in res.stderr


def test_a_doctored_logprob_is_reported(stored, tmp_path):
    srv, _, bodies, _ = stored
    body = json.loads(json.dumps(bodies["grpc-seeded"]))
    body["logprobs"][2]["logprob"] = float(body["logprobs"][2]["logprob"]) * (1 + 2 ** -20)
    res = cli(write(tmp_path, body), "--server", srv.target)
    assert res.returncode == 1 and "logprob bits differ at token 2" in res.stdout, res.stdout


@pytest.mark.parametrize("field, value", [("reference", "gateeng-ref-0"), ("model_fingerprint", "0" * 64),
                                          ("dtype", "float32")])
def test_a_record_naming_another_reference_model_or_dtype_is_refused_before_decoding(stored, tmp_path, field,
                                                                                    value):
    srv, _, bodies, _ = stored
    body = json.loads(json.dumps(bodies["http-greedy"]))
    body["reproducibility"][field] = value
    with Client(srv.target) as c:
        before = c.server_info()
    target = rp.GrpcTarget(srv.target)
    (outcome,) = rp.run(rp.read(write(tmp_path, body)), target, show_progress=False)
    target.close()
    assert not outcome.identical and "refused before decoding" in outcome.message
    assert f"{field}: stored {value!r}" in outcome.message
    with Client(srv.target) as c:    # nothing was decoded: the engine saw no request
        assert c.server_info().requests_running == before.requests_running == 0


def test_under_the_spec_only_reference_model_and_dtype_decide():
    here = dataclasses.asdict(spec_record())
    moved = {**here, "device_kind": "cuda:H200:sm_90", "isa": "sm_90", "torch_version": "9.9", "num_threads": 64}
    assert rp.reproducibility.differences(moved, here) == []
    machine = {**here, "reference": "invariant-v4(rows=8)"}
    other_machine = {**machine, "isa": "avx2,fma,avx512f"}
    assert rp.reproducibility.differences(other_machine, {**here, "reference": "invariant-v4(rows=8)"}) == [
        "isa: stored 'avx2,fma,avx512f', here " + repr(here["isa"])]


def spec_record():
    from gateeng import reproducibility
    return reproducibility.build(engine_version="1", model_fingerprint="abc", dtype="bfloat16", device="cpu",
                                 plan="fast", reference=REFERENCE, self_check_passed=True, self_check="ok")


def test_unreadable_items_are_reported_and_fail_the_run(tmp_path):
    path = tmp_path / "log.jsonl"
    path.write_text('{"object": "text_completion", "choices": []}\nnot json\n')
    res = cli(path, "--server", "127.0.0.1:1")
    assert res.returncode == 1
    assert "log.jsonl:1: cannot replay: the response has no `replay` block" in res.stdout
    assert "log.jsonl:2: cannot replay: not JSON" in res.stdout
