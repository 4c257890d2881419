"""The OpenAI-compatible HTTP front, through the real `openai` client, on a tiny
random model in-process (the same Server `gateeng serve --http-port` runs)."""
import json
import urllib.error
import urllib.request

import openai
import pytest

from gateeng.serving.grpc_client import Client
from gateeng.request import DeterminismParams, Mode, SamplingParams
from test_server_async import Running, tiny_config

VERIFIED = {"determinism": {"mode": "verified"}}


@pytest.fixture(scope="module")
def served():
    from gateeng.config import ServerConfig
    srv = Running(tiny_config(max_model_len=256), settings=ServerConfig(port=0, metrics_port=None, http_port=0))
    base = f"http://127.0.0.1:{srv.server.http.port}"
    yield srv, base, openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    srv.stop()


def test_health_and_models(served):
    _, base, api = served
    assert json.loads(urllib.request.urlopen(base + "/health", timeout=10).read()) == {"status": "serving"}
    (model,) = api.models.list().data
    assert model.id == "tiny" and model.owned_by == "gateeng"


def test_completions_with_logprobs_and_the_reproducibility_record(served):
    _, _, api = served
    res = api.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=0, logprobs=5,
                                 extra_body={"ignore_eos": True})
    choice = res.choices[0]
    assert choice.finish_reason == "length" and res.usage.completion_tokens == 8
    assert len(choice.logprobs.tokens) == 8 and all(len(t) <= 5 for t in choice.logprobs.top_logprobs)
    assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
    assert res.system_fingerprint and res.model_extra["reproducibility"]["model_fingerprint"] == "tiny-random"


def test_streamed_chat_adds_up_to_the_unary_answer(served):
    _, _, api = served
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    whole = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                        extra_body=VERIFIED)
    stream = api.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                         stream=True, extra_body=VERIFIED)
    parts, finish = [], None
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
        if chunk.choices and chunk.choices[0].finish_reason:
            finish = chunk.choices[0].finish_reason
    assert "".join(parts) == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert whole.model_extra["determinism"]["mode"] == "verified"


def test_verified_logprobs_over_http_equal_those_over_grpc(served):
    srv, _, api = served
    res = api.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=10, temperature=0, logprobs=5,
                                 extra_body=dict(VERIFIED, ignore_eos=True))
    with Client(srv.target) as c:
        g = c.complete([5, 6, 7], SamplingParams(max_tokens=10, ignore_eos=True, logprobs=5),
                       DeterminismParams(Mode.VERIFIED))
    assert res.choices[0].logprobs.token_logprobs == [lp.logprob for lp in g.logprobs]
    assert res.system_fingerprint == g.reproducibility.fingerprint


def test_echo_gives_prompt_logprobs_like_lm_eval_asks(served):
    _, _, api = served
    prompt = [5, 6, 7, 8, 9]
    res = api.completions.create(model="tiny", prompt=prompt, max_tokens=1, temperature=0, logprobs=1, echo=True)
    lp = res.choices[0].logprobs
    assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(prompt) + 1
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])


@pytest.mark.parametrize("kwargs, status, words", [
    (dict(n=17), 400, "`n` must be in [1, 16]"),
    (dict(extra_body={"frobnicate": 1}), 400, "unknown field `frobnicate`"),
    (dict(extra_body={"determinism": {"mode": "bitwise"}}), 400, "known: off, verified"),
    (dict(extra_body={"determinism": {"mode": "verified", "stream_policy": "eager"}}), 400, "rollback"),
    (dict(extra_body={"determinism": {"mode": "verified", "max_window": 1}}), 400, "max_window must be in"),
    (dict(temperature=-1), 400, "temperature"),
    (dict(logprobs=21), 400, "logprobs must be in"),
    (dict(model="gpt-4"), 404, "not served here"),
    (dict(stream=True, echo=True, logprobs=1), 400, "`echo` is not served on a stream"),
])
def test_bad_requests_get_openai_errors(served, kwargs, status, words):
    _, _, api = served
    args = dict(model="tiny", prompt="hi", max_tokens=4)
    args.update(kwargs)
    with pytest.raises(openai.APIStatusError) as ei:
        api.completions.create(**args)
    assert ei.value.status_code == status and words in ei.value.body["message"], ei.value.body
    assert api.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


@pytest.mark.parametrize("body, words", [
    ({"prompt": "hi", "stop": [1, 2]}, "stop must be"),
    ({"prompt": "hi", "max_tokens": 2.5}, "max_tokens must be an integer"),
    ({"prompt": "hi", "seed": "x"}, "seed must be an integer"),
    ({"prompt": "hi", "temperature": "hot"}, "temperature"),
    ({"prompt": {"a": 1}}, "prompt must be"),
    ({"prompt": "hi", "determinism": {"mode": "verified", "margin_threshold": "big"}}, "margin_threshold"),
])
def test_wrongly_typed_fields_are_400_and_the_engine_keeps_serving(served, body, words):
    _, base, api = served
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(req, timeout=30)
    assert ei.value.code == 400 and words in json.loads(ei.value.read())["error"]["message"]
    assert api.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def test_top_logprobs_without_logprobs_is_refused_not_dropped(served):
    _, _, api = served
    with pytest.raises(openai.BadRequestError) as ei:
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    top_logprobs=3)
    assert "`top_logprobs` needs `logprobs: true`" in ei.value.body["message"]


def test_streamed_completion_logprobs_equal_the_unary_answers(served):
    _, _, api = served
    args = dict(model="tiny", prompt=[5, 6, 7], max_tokens=10, temperature=0, logprobs=3,
                extra_body=dict(VERIFIED, ignore_eos=True))
    whole = api.completions.create(**args).choices[0].logprobs
    tokens, logprobs, tops, offsets = [], [], [], []
    for chunk in api.completions.create(stream=True, **args):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            tokens += lp.tokens
            logprobs += lp.token_logprobs
            tops += lp.top_logprobs
            offsets += lp.text_offset
    assert (tokens, logprobs, tops, offsets) == (whole.tokens, whole.token_logprobs, whole.top_logprobs,
                                                 whole.text_offset)


def test_model_by_id_metrics_and_unknown_paths(served):
    _, base, api = served
    assert api.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError) as ei:
        api.models.retrieve("gpt-4")
    assert "not served here" in ei.value.body["message"]
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert "gateeng_requests_running" in text
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(base + "/v1/embeddings", timeout=10)
    body = json.loads(ei.value.read())
    assert ei.value.code == 404 and "no route /v1/embeddings" in body["error"]["message"]
    assert body["error"]["type"] == "not_found_error"
    with pytest.raises(urllib.error.HTTPError) as ei:
        urllib.request.urlopen(base + "/v1/completions", timeout=10)   # GET on a POST route
    assert ei.value.code == 405 and "GET is not allowed" in json.loads(ei.value.read())["error"]["message"]
