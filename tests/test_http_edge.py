"""The HTTP front's reading of a JSON body, without a server or a model (the
checks shared with the gRPC front are test_checks.py's; the routes' answers,
test_http_api.py's)."""
import json

import pytest

from gateeng.config import HTTP_MAX_N, GateBounds
from gateeng.request import Mode, StreamPolicy
from gateeng.serving import checks, grpc_edge, http_edge
from gateeng.serving.refusals import Kind, Refusal
from gateeng.v1 import engine_pb2 as pb

BOUNDS = GateBounds(max_margin_threshold=4.0, min_window=4, max_window=64)
CONTEXT = 256


def completion(**body):
    return http_edge.completion(body, CONTEXT, "off", BOUNDS)


def chat(**body):
    return http_edge.chat(body, CONTEXT, "off", BOUNDS)


@pytest.mark.parametrize("raw, kind, words", [
    (b"{not json", Kind.INVALID, "not valid JSON"),
    (b"[1, 2]", Kind.INVALID, "must be a JSON object"),
    (b'{"prompt": "a", "colour": 1}', Kind.INVALID, "unknown field `colour`"),
    (b'{"prompt": "a", "presence_penalty": 0.5}', Kind.INVALID, "`presence_penalty` = 0.5 is not supported"),
    (b'{"prompt": "a", "best_of": true}', Kind.INVALID, "`best_of` = True is not supported"),
    (b'{"prompt": "a", "model": "other"}', Kind.NOT_FOUND, "model 'other' is not served here"),
])
def test_a_body_is_refused_naming_what_is_wrong(raw, kind, words):
    with pytest.raises(Refusal, match=words) as e:
        http_edge.parse(raw, http_edge.COMPLETION_FIELDS, "tiny")
    assert e.value.kind is kind


def test_a_body_keeps_harmless_fields_and_options_at_their_off_value():
    raw = json.dumps({"prompt": "a", "model": "tiny", "user": "u", "best_of": 1, "logit_bias": {}, "tools": None})
    assert http_edge.parse(raw.encode(), http_edge.COMPLETION_FIELDS, "tiny")["prompt"] == "a"


@pytest.mark.parametrize("value, want", [
    ("hi", ["hi"]),
    ([1, 2, 3], [[1, 2, 3]]),
    (["a", [4, 5]], ["a", [4, 5]]),
])
def test_completion_prompts_are_one_or_a_list(value, want):
    assert http_edge.prompts(value) == want


@pytest.mark.parametrize("value, words", [
    (None, "prompt must be a string"),
    ([], "non-empty list"),
    (["a", 3.5], r"prompt\[1\] must be a string or a list of token ids"),
    ([[1, 2], [3, True]], r"prompt\[1\] must be a list of integer token ids"),
])
def test_bad_prompts_are_refused(value, words):
    with pytest.raises((Refusal, checks.BadRequest), match=words):
        http_edge.prompts(value)


@pytest.mark.parametrize("body, words", [
    ({"prompt": "a", "n": 0}, r"`n` must be in \[1, "),
    ({"prompt": "a", "n": HTTP_MAX_N + 1}, r"`n` must be in \[1, "),
    ({"prompt": ["a"] * 8, "n": HTTP_MAX_N}, "choices; at most"),
    ({"prompt": "a", "stream_options": {"include_usage": True}}, "only allowed with `stream: true`"),
    ({"prompt": "a", "stream": True, "stream_options": {"other": 1}}, "supports only `include_usage`"),
    ({"prompt": "a", "echo": True, "stream": True}, "`echo` is not served on a stream"),
    ({"prompt": "a", "max_tokens": CONTEXT}, "exceeds the context"),
    ({"prompt": "a", "determinism": "verified"}, "must be an object or null"),
    ({"prompt": "a", "determinism": {"mode": "reference"}}, "determinism.mode 'reference' is not known; "
                                                            "known: off, verified"),
    ({"prompt": "a", "determinism": {"stream_policy": "eager"}}, "only verified_only"),
    ({"prompt": "a", "determinism": {"max_window": 1000}}, "max_window"),
])
def test_completion_requests_are_refused_naming_the_field(body, words):
    with pytest.raises((Refusal, checks.BadRequest), match=words):
        completion(**body)


def test_a_completion_request_reads_as_openai_defaults_it():
    g = completion(prompt=["a", "b"], n=2, echo=True, logprobs=3, seed=7, stream=False)
    assert (g.prompts, g.n, g.stream, g.include_usage, g.echo, g.logprobs) == (["a", "b"], 2, False, False, True, 3)
    assert (g.sampling.temperature, g.sampling.max_tokens, g.sampling.seed) == (1.0, 16, 7)
    assert (g.sampling.logprobs, g.sampling.prompt_logprobs) == (3, 3)
    assert g.determinism.mode is Mode.OFF and g.determinism.stream_policy is StreamPolicy.VERIFIED_ONLY
    g = completion(prompt="a", stream=True, stream_options={"include_usage": True},
                   determinism={"mode": "verified", "margin_threshold": 0.5})
    assert (g.stream, g.include_usage, g.determinism.mode, g.determinism.margin_threshold) == (
        True, True, Mode.VERIFIED, 0.5)


def test_a_chat_request_reads_its_messages_and_logprobs():
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    g = chat(messages=messages, logprobs=True, top_logprobs=2, max_completion_tokens=5, max_tokens=9)
    assert g.prompts == [[{"role": "user", "content": "a\nb"}]]
    assert (g.n, g.logprobs, g.echo, g.sampling.max_tokens, g.sampling.logprobs) == (1, 2, False, 5, 2)
    assert chat(messages=messages).sampling.max_tokens == CONTEXT // 2
    assert chat(messages=messages, response_format={"type": "text"}).logprobs is None
    with pytest.raises(Refusal, match="response_format 'json_object' is not supported"):
        chat(messages=messages, response_format={"type": "json_object"})
    with pytest.raises(Refusal, match="`top_logprobs` needs `logprobs: true`"):
        chat(messages=messages, top_logprobs=2)


def test_the_default_mode_applies_where_a_request_names_none():
    assert http_edge.determinism({}, "verified", BOUNDS).mode is Mode.VERIFIED
    assert http_edge.determinism({"determinism": None}, "verified", BOUNDS).mode is Mode.VERIFIED
    assert http_edge.determinism({"determinism": {"mode": "off"}}, "verified", BOUNDS).mode is Mode.OFF


def test_both_fronts_name_the_same_determinism_modes():
    """HTTP's mode names are the proto's Determinism.Mode names (MODE_UNSPECIFIED
    aside), each read as the same Mode."""
    names = [v.name for v in pb.Determinism.Mode.DESCRIPTOR.values if v.name != "MODE_UNSPECIFIED"]
    assert [n.removeprefix("MODE_").lower() for n in names] == list(checks.MODES)
    for name in names:
        assert checks.MODES[name.removeprefix("MODE_").lower()] is grpc_edge.mode_from_proto(pb.Determinism.Mode.Value(name))


@pytest.mark.parametrize("body, want", [
    ({"prompt": "hi"}, ("hi", False)),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
     ([{"role": "user", "content": "hi"}], True)),
])
def test_tokenize_reads_a_prompt_or_messages(body, want):
    assert http_edge.tokenize_input(body) == want


@pytest.mark.parametrize("body, words", [
    ({}, "one of them"),
    ({"prompt": "a", "messages": []}, "one of them"),
    ({"prompt": [1, 2]}, "`prompt` must be a string"),
    ({"messages": [], "add_generation_prompt": False}, "`add_generation_prompt` false is not supported"),
    ({"prompt": "a", "add_special_tokens": True}, "`add_special_tokens` true is not supported"),
])
def test_tokenize_refusals(body, words):
    with pytest.raises(Refusal, match=words):
        http_edge.tokenize_input(body)


def test_detokenize_ids_lie_in_the_vocabulary():
    assert http_edge.detokenize_ids({"tokens": [0, 9]}, 10) == [0, 9]
    with pytest.raises(Refusal, match=r"token ids \[10, -1\] are outside the vocabulary \[0, 10\)"):
        http_edge.detokenize_ids({"tokens": [1, 10, -1]}, 10)
