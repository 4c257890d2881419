"""Both fronts refuse the same requests the same way: one table sent over gRPC and
over HTTP (the real `openai` client for JSON bodies, raw bytes for malformed
ones), each answer with its status and a message naming the field, counted in
gateeng_rpc_errors_total, and the server serving a normal request after each.
Then what only HTTP has to get right: a client that closes its socket, and the
drain."""
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Optional

import grpc
import openai
import pytest

from gateeng.config import ServerConfig
from gateeng.serving.server import REQUEST_ID_HEADER
from gateeng.v1 import engine_pb2 as pb
from gateeng.v1 import engine_pb2_grpc as pb_grpc
from test_server_async import Running, channel, tiny_config
from tiny import hf_tiny, tiny_loaded

CONTEXT = 4096                       # long enough that a request runs for seconds
PROMPT_BYTES = 32 * CONTEXT          # the default --max-prompt-bytes for it
INVALID = grpc.StatusCode.INVALID_ARGUMENT
VERIFIED = pb.Determinism.MODE_VERIFIED


@dataclass
class Case:
    name: str
    words: str                                  # in the message, on both fronts
    http: Optional[object] = None               # a JSON body (dict) or raw bytes
    rpc: Optional[pb.GenerateRequest] = None
    status: int = 400
    code: grpc.StatusCode = INVALID
    path: str = "/v1/completions"


def text(s, **sampling):
    return pb.GenerateRequest(text=s, sampling=pb.SamplingParams(**sampling))


def raw(body: str) -> bytes:
    return body.encode()


CASES = [
    # The rows the HTTP front once served or answered with a plain-text 500.
    Case("prompt past --max-prompt-bytes", "--max-prompt-bytes", {"prompt": "x" * (PROMPT_BYTES + 1)},
         text("x" * (PROMPT_BYTES + 1))),
    Case("chat past --max-prompt-bytes", "--max-prompt-bytes",
         {"messages": [{"role": "user", "content": "x" * PROMPT_BYTES}]},
         pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="user", content="x" * PROMPT_BYTES)])),
         path="/v1/chat/completions"),
    Case("top_k 1e999", "top_k must be an integer, got inf", raw('{"prompt": "hi", "top_k": 1e999}')),
    Case("top_k NaN", "top_k must be an integer, got nan", raw('{"prompt": "hi", "top_k": NaN}')),
    Case("top_p NaN", "top_p must be a finite number", raw('{"prompt": "hi", "top_p": NaN}'),
         text("hi", top_p=float("nan"))),
    Case("lone surrogate in the prompt", "lone surrogate", raw('{"prompt": "a\\udc80b"}')),
    Case("lone surrogate in a message", "lone surrogate",
         raw('{"messages": [{"role": "user", "content": "\\udc80"}]}'), path="/v1/chat/completions"),
    Case("lone surrogate in a stop string", "lone surrogate", raw('{"prompt": "hi", "stop": ["\\ud800"]}')),
    Case("stream 'no'", "stream must be true or false", {"prompt": "hi", "stream": "no"}),
    Case("echo 'no'", "echo must be true or false", {"prompt": "hi", "echo": "no"}),
    Case("top_k 2.7", "top_k must be an integer, got 2.7", {"prompt": "hi", "top_k": 2.7}),
    Case("prompt [true]", "list of integer token ids", {"prompt": [True]}),
    Case("determinism []", "`determinism` must be an object or null", {"prompt": "hi", "determinism": []}),
    Case("determinism mode []", "is not known", {"prompt": "hi", "determinism": {"mode": []}}),
    Case("chat logprobs 'yes'", "logprobs must be true or false",
         {"messages": [{"role": "user", "content": "hi"}], "logprobs": "yes"}, path="/v1/chat/completions"),
    Case("n true", "n must be an integer, got True", {"prompt": "hi", "n": True}),
    Case("max_tokens 10^9", "max_tokens 1000000000 exceeds the context (4096 tokens",
         {"prompt": "hi", "max_tokens": 10 ** 9}, text("hi", max_tokens=10 ** 9)),
    Case("max_tokens 10^30", "exceeds the context", {"prompt": "hi", "max_tokens": 10 ** 30}),
    Case("chat max_completion_tokens 10^9", "exceeds the context",
         {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 10 ** 9},
         path="/v1/chat/completions"),
    Case("Content-Length not a number", "not a byte count", None),
    # The gRPC bad-input table, and its HTTP spelling.
    Case("empty prompt", "empty", {"prompt": ""}, pb.GenerateRequest(text="")),
    Case("no input", "`text`, `token_ids` or `messages`", None, pb.GenerateRequest()),
    Case("no prompt", "prompt must be a string, a list of token ids", {"max_tokens": 2}),
    Case("unknown token ids", "vocabulary", {"prompt": [1, 99999]},
         pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1, 99999]))),
    Case("NaN threshold", "margin_threshold", raw('{"prompt": "hi", "determinism": {"mode": "verified", '
                                                  '"margin_threshold": NaN}}'),
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=VERIFIED, margin_threshold=float("nan")))),
    Case("prompt longer than the context", "context holds 4096", {"prompt": [42] * (CONTEXT + 10)},
         pb.GenerateRequest(token_ids=pb.TokenIds(ids=[42] * (CONTEXT + 10)))),
    Case("negative temperature", "temperature", {"prompt": "hi", "temperature": -1}, text("hi", temperature=-1)),
    Case("top_p zero", "top_p", {"prompt": "hi", "top_p": 0}, text("hi", top_p=0)),
    Case("max_tokens zero", "max_tokens must be >= 1", {"prompt": "hi", "max_tokens": 0},
         pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=0))),
    Case("chat with token ids", "chat", None, pb.GenerateRequest(token_ids=pb.TokenIds(ids=[1]), chat=True)),
    Case("messages as token ids", "list of {role, content}", {"messages": [1, 2]}, path="/v1/chat/completions"),
    Case("unknown determinism mode", "known", {"prompt": "hi", "determinism": {"mode": "bitwise"}},
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=99))),
    Case("unknown stream policy", "stream_policy", {"prompt": "hi", "determinism": {"stream_policy": "fast"}},
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(stream_policy=5))),
    Case("3 MB request id", "request_id", None, pb.GenerateRequest(text="hi", request_id="x" * 3_000_000)),
    Case("4 MB prompt", "--max-prompt-bytes", {"prompt": "word " * 800_000},
         pb.GenerateRequest(text="word " * 800_000), status=413),
    Case("17 stop strings", "stop", {"prompt": "hi", "stop": ["x"] * 17}, text("hi", stop=["x"] * 17)),
    Case("65 stop token ids", "stop_token_ids", None, text("hi", stop_token_ids=list(range(65)))),
    Case("tau above the ceiling", "--request-tau-max",
         {"prompt": "hi", "determinism": {"mode": "verified", "margin_threshold": 3.4e38}},
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=VERIFIED, margin_threshold=3.4e38))),
    Case("W below the floor", "max_window", {"prompt": "hi", "determinism": {"mode": "verified", "max_window": 1}},
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=VERIFIED, max_window=1))),
    Case("W above the ceiling", "max_window",
         {"prompt": "hi", "determinism": {"mode": "verified", "max_window": 511}},
         pb.GenerateRequest(text="hi", determinism=pb.Determinism(mode=VERIFIED, max_window=511))),
    Case("W not an integer", "max_window must be an integer",
         {"prompt": "hi", "determinism": {"mode": "verified", "max_window": 8.5}}),
    Case("unknown chat role", "known roles", {"messages": [{"role": "tool", "content": "x"}]},
         pb.GenerateRequest(messages=pb.Messages(messages=[pb.ChatMessage(role="tool", content="x")])),
         path="/v1/chat/completions"),
    Case("no chat messages", "empty", {"messages": []}, pb.GenerateRequest(messages=pb.Messages()),
         path="/v1/chat/completions"),
    Case("body not UTF-8", "not valid JSON", b'{"prompt": "a\xff\xfe"}'),
    Case("body not JSON", "not valid JSON", b"{prompt"),
    Case("body not an object", "must be a JSON object", [1, 2]),
]


def long_context_server(drain_seconds: float) -> Running:
    """Both fronts over a tiny random model with a CONTEXT-token context."""
    return Running(tiny_config(max_model_len=CONTEXT, num_kv_blocks=2 * CONTEXT // 4),
                   loaded=tiny_loaded("float32", hf_tiny(max_positions=CONTEXT)),
                   settings=ServerConfig(port=0, metrics_port=None, http_port=0, drain_seconds=drain_seconds))


@pytest.fixture(scope="module")
def served():
    srv = long_context_server(drain_seconds=30)
    base = f"http://127.0.0.1:{srv.server.http.port}"
    api = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
    yield srv, base, api
    srv.stop()


def errors(srv, code: str) -> float:
    return srv.server.metrics.value("gateeng_rpc_errors_total", code=code) or 0.0


def post_raw(base: str, path: str, data: bytes, headers=None):
    """(status, headers, body) for raw bytes, whatever the status."""
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json",
                                                                  **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=60) as res:
            return res.status, res.headers, res.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def send_http(api, base, case: Case):
    """(status, headers, error message) over HTTP for one case."""
    if case.name == "Content-Length not a number":
        with socket.create_connection(("127.0.0.1", int(base.rsplit(":", 1)[1])), timeout=30) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 12abc\r\n\r\n{}")
            head = s.recv(65536).decode(errors="replace")
        return int(head.split()[1]), {}, head
    if isinstance(case.http, bytes):
        status, headers, body = post_raw(base, case.path, case.http)
        return status, headers, json.loads(body)["error"]["message"]
    try:   # the real client, for every body JSON can spell
        api.post(case.path.removeprefix("/v1"), body=case.http, cast_to=object)
    except openai.APIStatusError as e:
        assert set(e.body) >= {"message", "type", "param", "code"}, e.body      # OpenAI's error shape
        return e.status_code, e.response.headers, e.body["message"]
    raise AssertionError(f"{case.name}: served")


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_each_bad_request_is_refused_alike_by_both_fronts_and_the_server_stays_healthy(served, case):
    srv, base, api = served
    if case.http is not None or case.name == "Content-Length not a number":
        label = f"HTTP_{case.status}"
        before = errors(srv, label)
        status, headers, message = send_http(api, base, case)
        assert status == case.status, (case.name, status, message)
        if case.name != "Content-Length not a number":   # refused by the HTTP parser itself
            assert case.words in message, (case.name, message)
            assert errors(srv, label) == before + 1
            assert headers.get(REQUEST_ID_HEADER, "").startswith(("cmpl-", "chatcmpl-"))
    if case.rpc is not None:
        stub = pb_grpc.EngineStub(channel(srv.target))
        before = errors(srv, case.code.name)
        with pytest.raises(grpc.RpcError) as ei:
            stub.Complete(case.rpc, timeout=60)
        assert ei.value.code() == case.code and case.words in ei.value.details(), (case.name, ei.value.details())
        assert errors(srv, case.code.name) == before + 1
    ok = api.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2
    counts = srv.server.gateway.engine.counts
    assert (counts.running, counts.waiting) == (0, 0)


def test_a_prompt_past_the_byte_bound_is_refused_without_tokenizing(served, monkeypatch):
    srv, base, api = served
    tokenizer = srv.server.gateway.engine.tokenizer
    seen = []
    encode = tokenizer.encode
    monkeypatch.setattr(tokenizer, "encode", lambda text, **kw: seen.append(len(text)) or encode(text, **kw))
    with pytest.raises(openai.BadRequestError, match="--max-prompt-bytes"):
        api.completions.create(model="tiny", prompt="y" * (PROMPT_BYTES + 1), max_tokens=2)
    assert seen == []
    api.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert seen == [2]


def test_the_response_names_the_server_id_in_its_header(served):
    _, base, api = served
    res = api.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2)
    assert res.headers[REQUEST_ID_HEADER] == res.parse().id and res.parse().id.startswith("cmpl-")


def test_an_unexpected_error_is_a_counted_500_in_openai_shape_that_names_the_request(served, monkeypatch, capsys):
    srv, base, api = served
    tokenizer = srv.server.gateway.engine.tokenizer

    def broken(text, **kw):
        raise RuntimeError("injected tokenizer fault")
    monkeypatch.setattr(tokenizer, "encode", broken)
    before = errors(srv, "HTTP_500")
    with pytest.raises(openai.InternalServerError) as ei:
        api.completions.create(model="tiny", prompt="hi", max_tokens=2)
    rid = ei.value.response.headers[REQUEST_ID_HEADER]
    assert ei.value.body["type"] == "server_error" and rid in ei.value.body["message"]
    with pytest.raises(openai.InternalServerError):
        api.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                    stream=True)
    assert errors(srv, "HTTP_500") == before + 2
    log = capsys.readouterr().err
    assert f"request {rid} (/v1/completions) failed" in log and "RuntimeError: injected tokenizer fault" in log
    monkeypatch.undo()
    assert api.completions.create(model="tiny", prompt="hi", max_tokens=2).usage.completion_tokens >= 1


def idle(srv) -> bool:
    c = srv.server.gateway.engine.counts
    return (c.running, c.waiting, c.kv_usage) == (0, 0, 0.0)


def wait_until(predicate, timeout):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": [5, 6, 7]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
])
def test_closing_the_socket_of_a_plain_request_aborts_it_within_a_second(served, path, body):
    srv, base, _ = served
    aborts = srv.server.metrics.value
    before = aborts("gateeng_request_success_total", finish_reason="abort") or 0.0
    data = json.dumps(dict(body, max_tokens=CONTEXT - 64, ignore_eos=True)).encode()
    s = socket.create_connection(("127.0.0.1", srv.server.http.port), timeout=30)
    s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    assert wait_until(lambda: srv.server.gateway.engine.counts.running == 1, 30)
    s.close()
    assert wait_until(lambda: idle(srv), 1.0), srv.server.gateway.engine.counts
    assert aborts("gateeng_request_success_total", finish_reason="abort") == before + 1


def test_the_drain_answers_503_with_retry_after_and_cuts_streams_with_an_error_event():
    srv = long_context_server(drain_seconds=1.5)
    base = f"http://127.0.0.1:{srv.server.http.port}"
    long = json.dumps({"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True}).encode()
    answers = {}

    def plain():
        answers["plain"] = post_raw(base, "/v1/completions", long)

    def streamed():
        req = urllib.request.Request(base + "/v1/completions", data=json.dumps(
            {"prompt": [5, 6, 7], "max_tokens": 4000, "ignore_eos": True, "stream": True}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as res:
            answers["sse"] = [line for line in res.read().decode().split("\n\n") if line]
    threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
    for t in threads:
        t.start()
    assert wait_until(lambda: srv.server.gateway.engine.counts.running == 2, 30)
    stopper = threading.Thread(target=srv.stop)
    stopper.start()
    assert wait_until(lambda: srv.server.gateway.draining, 10)
    status, headers, body = post_raw(base, "/v1/completions", json.dumps({"prompt": "hi"}).encode())
    assert status == 503 and headers["Retry-After"] == "1" and "shutting down" in json.loads(body)["error"]["message"]
    for t in threads:
        t.join(60)
    status, headers, body = answers["plain"]
    assert status == 503 and headers["Retry-After"] == "1", (status, body)
    assert "retry" in json.loads(body)["error"]["message"]
    events = answers["sse"]
    assert "[DONE]" not in events[-1] and json.loads(events[-1].removeprefix("data: "))["error"]["type"] == \
        "server_error"
    assert all("error" not in json.loads(e.removeprefix("data: ")) for e in events[:-1])
    stopper.join(60)
    assert srv.exit_code == 0
