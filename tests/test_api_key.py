"""`gateeng serve --api-key`: both fronts refuse calls without the key (HTTP 401 in
OpenAI's shape, gRPC UNAUTHENTICATED), health and metrics stay open, and our
clients send it. One server on the tiny random model, in-process."""
import functools
import json
import os
import urllib.error
import urllib.request

import grpc
import openai
import pytest

import test_server_async
from gateeng.config import ServerConfig
from gateeng.request import SamplingParams
from gateeng.serving import credentials
from gateeng.serving.grpc_client import Client
from gateeng.serving.server import Server
from gateeng.tools import cli
from gateeng.tools.probe import GrpcSender, OpenAISender
from gateeng.serving.http_client import HttpError
from gateeng.tools.replay import OpenAITarget
from gateeng.v1 import engine_pb2_grpc as pb_grpc
from test_server_async import SERVING, Running, channel, health, request, tiny_config

KEY, ADMIN = "sk-test-0123456789", "admin-0123456789"
SHORT = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def served():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv(credentials.API_KEY_ENV, raising=False)
        mp.setattr(test_server_async, "Server", functools.partial(Server, api_key=KEY))
        srv = Running(tiny_config(), admin_token=ADMIN,
                      settings=ServerConfig(port=0, metrics_port=0, http_port=0))
    srv.base = f"http://127.0.0.1:{srv.server.http.port}"
    yield srv
    srv.stop()


def errors(srv, code):
    return srv.server.metrics.value("gateeng_rpc_errors_total", code=code) or 0


def get(url, headers=None):
    """(status, headers, body) of a GET, error statuses included."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


# ---- HTTP ---------------------------------------------------------------------------------

def test_http_without_the_key_is_a_401_in_openais_shape(served):
    before = errors(served, "HTTP_401")
    status, headers, body = get(served.base + "/v1/models")
    assert status == 401 and headers["WWW-Authenticate"] == "Bearer"
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
    assert "Authorization: Bearer" in error["message"]
    # Unknown paths too: nothing past the key tells a caller what the server has.
    assert get(served.base + "/v2/anything")[0] == 401
    assert get(served.base + "/v1/models", {"Authorization": "Basic " + KEY})[0] == 401
    assert errors(served, "HTTP_401") == before + 3


def test_the_openai_client_needs_the_right_key(served):
    for key in ("wrong", KEY + "x", KEY[:-1]):
        api = openai.OpenAI(base_url=served.base + "/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as caught:
            api.completions.create(model="tiny", prompt="hello", max_tokens=2)
        assert caught.value.status_code == 401 and KEY not in str(caught.value)
    api = openai.OpenAI(base_url=served.base + "/v1", api_key=KEY, max_retries=0)
    res = api.completions.create(model="tiny", prompt="hello", max_tokens=3, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 3
    assert [m.id for m in api.models.list().data] == ["tiny"]


def test_health_and_metrics_stay_open(served):
    status, _, body = get(served.base + "/health")
    assert status == 200 and json.loads(body) == {"status": "serving"}
    status, _, body = get(served.base + "/metrics")
    assert status == 200 and b"gateeng_rpc_errors_total" in body
    assert get(f"http://127.0.0.1:{served.server.metrics_port}/metrics")[0] == 200


def test_replay_and_probe_send_the_key(served):
    assert OpenAITarget(served.base, api_key=KEY).model["id"] == "tiny"
    with pytest.raises(HttpError, match="HTTP 401"):
        OpenAITarget(served.base)
    assert OpenAISender(served.base, 2, {}, False, None, None, api_key=KEY)("hi").token_ids
    assert len(GrpcSender(served.target, 2, False, False, None, api_key=KEY)("hi").token_ids) == 2


# ---- gRPC ---------------------------------------------------------------------------------

def test_grpc_without_the_key_is_unauthenticated(served):
    stub = pb_grpc.EngineStub(channel(served.target))
    before = errors(served, "UNAUTHENTICATED")
    for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", KEY),)):
        with pytest.raises(grpc.RpcError) as caught:
            stub.Complete(request(max_tokens=2), metadata=metadata, timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "authorization: Bearer <key>" in caught.value.details()
    with pytest.raises(grpc.RpcError) as caught:   # a streaming call ends the same way
        list(stub.Generate(request(max_tokens=2), timeout=10))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert errors(served, "UNAUTHENTICATED") == before + 4
    assert health(served.target) == SERVING


def test_our_client_sends_the_key(served, monkeypatch):
    with Client(served.target, api_key=KEY) as c:
        assert len(c.complete("hi", SHORT).token_ids) == 4
        assert sum(len(r.chunk.token_ids) for r in c.generate("hi", SHORT)) == 4
    monkeypatch.setenv(credentials.API_KEY_ENV, KEY)
    with Client(served.target) as c:     # the key from the environment
        assert c.model_info().name == "tiny"
    with Client(served.target, api_key="") as c, pytest.raises(grpc.RpcError) as caught:
        c.model_info()
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_admin_calls_need_the_key_and_the_admin_token(served):
    for key, token in ((KEY, None), ("", ADMIN)):
        with Client(served.target, admin_token=token, api_key=key) as c, pytest.raises(grpc.RpcError) as caught:
            c.update_gate_config(max_window=8)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(served.target, admin_token=ADMIN, api_key=KEY) as c:
        assert c.update_gate_config(max_window=8).max_window == 8


# ---- the command line ----------------------------------------------------------------------

def test_cli_reads_the_key_from_a_file_or_the_environment(served, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(credentials.API_KEY_ENV, raising=False)
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    os.chmod(key_file, 0o600)
    argv = ["generate", "--server", served.target, "--max-tokens", "2", "hi"]
    assert cli.main(argv + ["--api-key-file", str(key_file)]) == 0
    assert "WARNING" not in capsys.readouterr().err
    assert cli.main(argv) == 2
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    monkeypatch.setenv(credentials.API_KEY_ENV, KEY)
    assert cli.main(argv) == 0
    assert cli.main(argv + ["--api-key", "wrong"]) == 2       # the flag wins over the environment
    monkeypatch.setenv(credentials.API_KEY_ENV, "")
    assert cli.main(["admin", "gate", "--server", served.target, "--api-key", KEY]) == 0
    capsys.readouterr()


def test_a_key_file_is_checked(tmp_path, capsys):
    path = tmp_path / "key"
    path.write_text("abc\n")
    os.chmod(path, 0o644)
    assert credentials.read_secret_file(str(path), "--api-key-file") == "abc"
    assert "can be read by other users (mode 644)" in capsys.readouterr().err
    for text, problem in (("", "is empty"), ("\n", "is empty"), ("a b\n", "a space"), ("abc\n\n", "control"),
                          ("ключ", "non-ASCII")):
        path.write_text(text)
        with pytest.raises(ValueError, match=problem) as caught:
            credentials.read_secret_file(str(path), "--api-key-file")
        assert str(path) in str(caught.value)
