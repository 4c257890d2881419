"""The gRPC front's checks without a model: parsing, unknown values, sizes, gate
bounds (the checks shared with the HTTP front are test_checks.py's)."""
import pytest

from gateeng.serving import checks, grpc_edge
from gateeng.config import GateBounds
from gateeng.serving.grpc_edge import BadRequest
from gateeng.request import Mode
from gateeng.v1 import engine_pb2 as pb

BOUNDS = GateBounds(max_margin_threshold=4.0, min_window=4, max_window=64)


def raw(msg) -> bytes:
    return msg.SerializeToString()


def test_unknown_enum_values_are_refused_naming_the_field_and_the_known_values():
    with pytest.raises(BadRequest, match=r"determinism\.mode = 99 .*MODE_VERIFIED \(2\)"):
        grpc_edge.parse(pb.GenerateRequest, raw(pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=99))))
    with pytest.raises(BadRequest, match=r"determinism\.stream_policy = 7 .*EAGER \(1\)"):
        grpc_edge.parse(pb.GenerateRequest, raw(pb.GenerateRequest(text="hi",
                                                              determinism=pb.Determinism(stream_policy=7))))
    ok = grpc_edge.parse(pb.GenerateRequest, raw(pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=2))))
    assert grpc_edge.determinism_from_proto(ok.determinism, BOUNDS).mode is Mode.VERIFIED


def test_fields_from_a_newer_api_are_refused_not_ignored():
    data = raw(pb.GenerateRequest(text="hi")) + b"\xf8\x06\x01"          # field 111, varint 1
    with pytest.raises(BadRequest, match=r"numbers \[111\]"):
        grpc_edge.parse(pb.GenerateRequest, data)
    nested = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=3))
    sub = raw(nested.sampling) + b"\xa0\x06\x05"                          # field 100 inside sampling
    data = raw(pb.GenerateRequest(text="hi")) + b"\x2a" + bytes([len(sub)]) + sub
    with pytest.raises(BadRequest, match=r"GenerateRequest\.sampling has fields"):
        grpc_edge.parse(pb.GenerateRequest, data)


def test_invalid_utf8_is_a_bad_request():
    data = b"\x12\x03a\xff\xfe"             # field 2 (text), 3 bytes, not UTF-8
    with pytest.raises(BadRequest, match="UTF-8"):
        grpc_edge.parse(pb.GenerateRequest, data)


@pytest.mark.parametrize("req, words", [
    (pb.GenerateRequest(text="hi", request_id="x" * 129), "request_id is 129 bytes"),
    (pb.GenerateRequest(text="é" * 40), "prompt text is 80 bytes"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1] * 100)), "context holds 100"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a"] * 17)), "at most 16"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop=["a" * 257])), "at most 256"),
    (pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(stop_token_ids=list(range(65)))), "at most 64"),
    (pb.GenerateRequest(), "set `text`, `token_ids` or `messages`"),
    (pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="é" * 40)])),
     "messages are 84 bytes"),
    (pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user")] * 257)), "at most 256"),
    (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), chat=True), "chat"),
])
def test_size_limits(req, words):
    with pytest.raises(BadRequest, match=words):
        before_tokenizing(req)


def before_tokenizing(req, max_prompt_bytes=64, max_model_len=100):
    """What the gRPC front and the gateway check before a prompt is tokenized."""
    grpc_edge.check_generate(req)
    grpc_edge.sampling_from_proto(req.sampling, max_model_len)
    checks.prompt_size(grpc_edge.prompt_from_proto(req), max_prompt_bytes, max_model_len)


def test_within_the_limits_passes():
    before_tokenizing(pb.GenerateRequest(text="é" * 32, request_id="x" * 128,
                                         sampling=pb.SamplingParams(stop=["a"] * 16, max_tokens=99)))


def test_unset_sampling_fields_take_the_grpc_defaults_and_set_ones_are_kept():
    p = grpc_edge.sampling_from_proto(pb.SamplingParams(), max_model_len=100)
    assert (p.temperature, p.top_p, p.top_k, p.seed, p.max_tokens, p.logprobs) == (0.0, 1.0, 0, None, 99, None)
    p = grpc_edge.sampling_from_proto(pb.SamplingParams(temperature=0.5, top_k=3, seed=7, max_tokens=5, logprobs=0,
                                                   stop_token_ids=[4], ignore_eos=True), max_model_len=100)
    assert (p.temperature, p.top_k, p.seed, p.max_tokens, p.logprobs) == (0.5, 3, 7, 5, 0)
    assert p.stop_token_ids == (4,) and p.ignore_eos
    with pytest.raises(BadRequest, match=r"sampling.max_tokens 100 exceeds the context \(100 tokens"):
        grpc_edge.sampling_from_proto(pb.SamplingParams(max_tokens=100), max_model_len=100)


@pytest.mark.parametrize("det, words", [
    (pb.Determinism(margin_threshold=3.4e38), r"margin_threshold must be in \[0, 4\]"),
    (pb.Determinism(margin_threshold=float("nan")), "finite"),
    (pb.Determinism(max_window=1), r"max_window must be in \[4, 64\]"),
    (pb.Determinism(max_window=511), r"max_window must be in \[4, 64\]"),
])
def test_gate_settings_outside_the_operator_bounds_are_refused(det, words):
    with pytest.raises(BadRequest, match=words):
        grpc_edge.determinism_from_proto(det, BOUNDS)


def test_gate_settings_inside_the_bounds_pass_through():
    d = grpc_edge.determinism_from_proto(pb.Determinism(mode=2, margin_threshold=4.0, max_window=4), BOUNDS)
    assert (d.margin_threshold, d.max_window) == (4.0, 4)
    d = grpc_edge.determinism_from_proto(pb.Determinism(), BOUNDS)
    assert (d.mode, d.margin_threshold, d.max_window) == (Mode.OFF, None, None)


def test_bounds_must_be_consistent():
    with pytest.raises(ValueError):
        GateBounds(1.0, 10, 5).validate()
    with pytest.raises(ValueError):
        GateBounds(float("inf"), 1, 5).validate()
