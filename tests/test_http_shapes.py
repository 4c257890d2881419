"""The request shapes eval, batch and RL clients send to the OpenAI front, through the
real `openai` client on a tiny random model in-process: `n`, prompt lists, text
parts, response_format, stream_options, and vLLM's /tokenize, /detokenize, /version."""
import http.client
import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from gateeng import answers
from gateeng.config import HTTP_MAX_CHOICES
from gateeng.request import choice_seed
from gateeng.tools import replay
from test_http_api import served  # noqa: F401 (the fixture: a tiny model served over HTTP)

VERIFIED = {"determinism": {"mode": "verified"}}


def idle(srv, seconds: float = 5.0) -> bool:
    """No request left running or waiting and no KV held, within `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        c = srv.server.gateway.engine.counts
        if (c.running, c.waiting, c.kv_usage) == (0, 0, 0.0) or time.monotonic() > deadline:
            return (c.running, c.waiting, c.kv_usage) == (0, 0, 0.0)
        time.sleep(0.05)


def post(base: str, path: str, body: dict):
    req = urllib.request.Request(base + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_n8_seeded_verified_choices_equal_single_requests_with_the_documented_seeds(served):
    srv, _, api = served
    args = dict(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0.9, logprobs=3,
                extra_body={**VERIFIED, "ignore_eos": True})
    group = api.completions.create(n=8, seed=1234, **args)
    assert [c.index for c in group.choices] == list(range(8))
    singles = [api.completions.create(seed=choice_seed(1234, i), **args) for i in range(8)]
    for choice, single in zip(group.choices, singles):
        extra = choice.model_extra
        assert extra["replay"]["token_ids"] == single.model_extra["replay"]["token_ids"]
        assert choice.text == single.choices[0].text
        assert choice.logprobs.token_logprobs == single.choices[0].logprobs.token_logprobs   # bit for bit
        assert extra["replay"]["sampling"]["seed"] == single.model_extra["replay"]["sampling"]["seed"]
        assert extra["determinism"]["mode"] == "verified"
    assert len({tuple(c.model_extra["replay"]["token_ids"]) for c in group.choices}) > 1   # the seeds differ
    assert group.usage.completion_tokens == 80
    assert group.usage.prompt_tokens == singles[0].usage.prompt_tokens   # the prompt counted once
    assert group.system_fingerprint == singles[0].system_fingerprint
    assert choice_seed(1234, 0) == 1234 and singles[0].choices[0].text == group.choices[0].text
    assert idle(srv)


def test_each_choice_of_a_stored_group_replays_on_its_own(served, tmp_path):
    _, base, api = served
    res = api.completions.create(model="tiny", prompt="Hello", max_tokens=6, temperature=1.0, n=3, seed=7,
                                 extra_body=VERIFIED)
    path = tmp_path / "group.json"
    path.write_text(res.model_dump_json())
    items = replay.read(path)
    assert [label for label, _ in items] == [f"group.json choice {i}" for i in range(3)]
    for (_, stored), choice in zip(items, res.choices):
        assert isinstance(stored, answers.Answer) and stored.mode == "verified"
        assert stored.output_ids == choice.model_extra["replay"]["token_ids"]
        assert stored.sampling.seed == choice.model_extra["replay"]["sampling"]["seed"]


def test_a_list_of_prompts_gets_one_choice_each_in_order(served):
    srv, _, api = served
    prompts = ["The sky is", "Two plus two", "Paris is in"]
    res = api.completions.create(model="tiny", prompt=prompts, max_tokens=5, temperature=0, extra_body=VERIFIED)
    singles = [api.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0, extra_body=VERIFIED)
               for p in prompts]
    assert [c.index for c in res.choices] == [0, 1, 2]
    assert [c.text for c in res.choices] == [s.choices[0].text for s in singles]
    assert res.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    ids = [s.model_extra["replay"]["prompt_token_ids"] for s in singles[:2]]
    by_ids = api.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0, n=2, extra_body=VERIFIED)
    assert [c.index for c in by_ids.choices] == [0, 1, 2, 3]   # prompt p's choice i is p * n + i
    assert [c.text for c in by_ids.choices] == [singles[0].choices[0].text] * 2 + [singles[1].choices[0].text] * 2
    assert idle(srv)


def test_too_many_choices_are_refused_before_any_is_queued(served):
    srv, _, api = served
    with pytest.raises(openai.BadRequestError, match=f"at most {HTTP_MAX_CHOICES} per request"):
        api.completions.create(model="tiny", prompt=["a"] * 5, n=16, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match=r"`n` must be in \[1, 16\]"):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], n=0)
    with pytest.raises(openai.BadRequestError, match="prompt\\[1\\] must be a string or a list of token ids"):
        api.completions.create(model="tiny", prompt=["a", 3.5], max_tokens=2)
    assert idle(srv)


def test_streamed_choices_add_up_to_the_unary_ones_and_usage_comes_only_when_asked(served):
    srv, _, api = served
    args = dict(model="tiny", messages=[{"role": "user", "content": "Count."}], max_tokens=8, temperature=0.8,
                seed=5, n=3, extra_body=VERIFIED)
    whole = api.chat.completions.create(**args)
    texts, finish, usage_chunks = {}, {}, []
    for chunk in api.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args):
        if not chunk.choices:
            usage_chunks.append(chunk.usage)
            continue
        assert chunk.usage is None
        (choice,) = chunk.choices
        texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
        finish[choice.index] = choice.finish_reason or finish.get(choice.index)
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finish == {c.index: c.finish_reason for c in whole.choices}
    assert len(usage_chunks) == 1 and usage_chunks[0].completion_tokens == whole.usage.completion_tokens
    plain = list(api.chat.completions.create(stream=True, **args))
    assert all(c.usage is None for c in plain) and all(c.choices for c in plain)
    with pytest.raises(openai.BadRequestError, match="only allowed with `stream: true`"):
        api.chat.completions.create(stream_options={"include_usage": True}, **args)
    assert idle(srv)


def test_text_parts_are_joined_and_other_parts_refused_by_name(served):
    _, _, api = served
    joined = api.chat.completions.create(model="tiny", max_tokens=6, temperature=0, extra_body=VERIFIED,
                                         messages=[{"role": "user", "content": "Name a colour.\nOne word."}])
    parts = api.chat.completions.create(model="tiny", max_tokens=6, temperature=0, extra_body=VERIFIED,
                                        messages=[{"role": "user", "content": [
                                            {"type": "text", "text": "Name a colour."},
                                            {"type": "text", "text": "One word."}]}])
    assert parts.model_extra["replay"]["prompt_token_ids"] == joined.model_extra["replay"]["prompt_token_ids"]
    assert parts.choices[0].message.content == joined.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="'image_url'; this server reads only text parts"):
        api.chat.completions.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}])


def test_response_format_text_is_served_and_json_refused_by_name(served):
    _, _, api = served
    msgs = [{"role": "user", "content": "hi"}]
    ok = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=2, response_format={"type": "text"})
    assert ok.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.BadRequestError, match="response_format 'json_object' is not supported"):
        api.chat.completions.create(model="tiny", messages=msgs, max_tokens=2,
                                    response_format={"type": "json_object"})


def test_tokenize_detokenize_and_version(served):
    srv, base, api = served
    status, tok = post(base, "/tokenize", {"model": "tiny", "prompt": "Hello world"})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 256
    done = api.completions.create(model="tiny", prompt="Hello world", max_tokens=1, temperature=0)
    assert tok["tokens"] == done.model_extra["replay"]["prompt_token_ids"]
    status, text = post(base, "/detokenize", {"model": "tiny", "tokens": tok["tokens"]})
    assert status == 200 and text == {"prompt": srv.server.gateway.engine.tokenizer.decode(tok["tokens"])}
    msgs = [{"role": "user", "content": "hi"}]
    status, chat = post(base, "/tokenize", {"messages": msgs})
    done = api.chat.completions.create(model="tiny", messages=msgs, max_tokens=1, temperature=0)
    assert status == 200 and chat["tokens"] == done.model_extra["replay"]["prompt_token_ids"]
    status, err = post(base, "/detokenize", {"tokens": [10 ** 9]})
    assert status == 400 and "outside the vocabulary" in err["error"]["message"]
    status, err = post(base, "/tokenize", {"prompt": "x", "add_special_tokens": True})
    assert status == 400 and err["error"]["param"] == "add_special_tokens"
    status, err = post(base, "/tokenize", {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and err["error"]["code"] == "model_not_found"
    from gateeng import __version__
    assert json.loads(urllib.request.urlopen(base + "/version", timeout=10).read()) == {"version": __version__}


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_gone_mid_group_aborts_every_choice(served, stream):
    srv, base, _ = served
    body = json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 250, "n": 4, "ignore_eos": True,
                       "stream": stream})
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.http.port, timeout=30)
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    deadline = time.monotonic() + 10
    while srv.server.gateway.engine.counts.running < 4 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert srv.server.gateway.engine.counts.running == 4   # the whole group is decoding
    before = aborted(srv)
    conn.close()                                           # gone before the answer
    assert idle(srv, 10.0) and aborted(srv) == before + 4


def aborted(srv) -> float:
    """Requests finished by an abort, by the server's own counter."""
    return sum(sample.value for metric in srv.server.gateway.metrics.registry.collect()
               for sample in metric.samples
               if sample.name == "gateeng_request_success_total" and sample.labels.get("finish_reason") == "abort")
