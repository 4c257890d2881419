"""The HTTP front and /metrics under hostile load: every byte and connection is
bounded before it is held, and nothing an HTTP client does takes gRPC or health
down. A real Server on the tiny random model, raw sockets as an attacker uses them."""
import json
import resource
import socket
import threading
import time
import urllib.request

import pytest

from gateeng.config import RESERVED_FDS, ConnectionLimits, ServerConfig
from gateeng.serving.http_server import ensure_descriptors
from test_server_async import SERVING, Running, health, tiny_config

LIMITS = ConnectionLimits(max_connections=8, header_timeout_s=1.5, body_timeout_s=1.5, keep_alive_timeout_s=1.0)


@pytest.fixture(scope="module")
def served():
    srv = Running(tiny_config(max_model_len=256),
                  settings=ServerConfig(port=0, metrics_port=0, http_port=0, http_limits=LIMITS,
                                        metrics_limits=ConnectionLimits(max_connections=2, header_timeout_s=1.5)))
    yield srv
    srv.stop()


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def read_all(sock: socket.socket) -> bytes:
    out = b""
    try:
        while True:
            part = sock.recv(65536)
            if not part:
                return out
            out += part
    except (ConnectionResetError, socket.timeout):
        return out


def post_completion(port: int) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    return json.loads(urllib.request.urlopen(req, timeout=30).read())


def chunked_headers() -> bytes:
    return (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")


def test_a_chunked_body_is_refused_once_past_the_limit_and_never_held(served):
    port = served.server.http.port
    before = rss_mib()
    sock = connect(port)
    sock.sendall(chunked_headers())
    piece = b"x" * 65536
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    sent = 0
    try:
        while sent < 64 * 2 ** 20:                # 64 MiB, never whole in the server
            sock.sendall(frame)
            sent += len(piece)
        sock.sendall(b"0\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                                      # the server stopped reading, as it should
    answer = read_all(sock)
    sock.close()
    grew = rss_mib() - before
    assert grew < 16, f"RSS grew {grew:.1f} MiB over a refused body"
    assert sent < 64 * 2 ** 20 or answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert post_completion(port)["choices"]          # the front still serves


def test_a_chunked_body_just_past_the_limit_gets_a_413_the_client_can_read(served):
    port = served.server.http.port
    body = json.dumps({"prompt": "a" * (served.server.gateway.prompt_bytes() + 100_000)}).encode()
    sock = connect(port)
    sock.sendall(chunked_headers() + b"%x\r\n" % len(body) + body + b"\r\n0\r\n\r\n")
    answer = read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"max-prompt-bytes" in answer and b"connection: close" in answer.lower()


def test_a_body_that_stalls_gets_408_after_the_body_timeout(served):
    sock = connect(served.server.http.port)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\":")
    t0 = time.time()
    answer = read_all(sock)
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"http-body-timeout" in answer, answer[:300]
    assert time.time() - t0 < LIMITS.body_timeout_s + 5


def test_idle_connections_past_the_limit_are_refused_cheaply_and_grpc_stays_serving(served, capsys):
    port = served.server.http.port
    idle = [connect(port) for _ in range(LIMITS.max_connections)]
    time.sleep(0.2)
    extra = [connect(port) for _ in range(40)]    # N + 40: every one past N is answered and closed
    answers = [read_all(s) for s in extra]
    assert all(a.startswith(b"HTTP/1.1 503") for a in answers), answers[:3]
    assert health(served.target) == SERVING
    # No bytes within the header timeout: the idle ones are closed, and their slots come back.
    assert all(read_all(s).startswith(b"HTTP/1.1 408") for s in idle)
    for s in idle + extra:
        s.close()
    time.sleep(0.2)
    assert post_completion(port)["choices"]
    logged = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(logged) <= 3, logged


def test_a_client_trickling_its_headers_is_closed_at_the_header_timeout(served):
    sock = connect(served.server.http.port)
    t0 = time.time()
    try:
        for _ in range(20):                       # a byte every 0.2 s: never whole headers in 1.5 s
            sock.sendall(b"G")
            time.sleep(0.2)
    except (BrokenPipeError, ConnectionResetError):
        pass
    read_all(sock)
    sock.close()
    assert time.time() - t0 < 6


def test_the_metrics_endpoint_is_bounded_too(served):
    port = served.server.metrics_port
    idle = [connect(port) for _ in range(2)]
    time.sleep(0.2)
    refused = connect(port)
    assert read_all(refused).startswith(b"HTTP/1.1 503")
    for s in idle:
        read_all(s)                               # closed at the header timeout
        s.close()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert "gateeng_" in text


def test_concurrent_floods_leave_the_count_of_open_connections_at_zero(served):
    port = served.server.http.port

    def flood():
        for _ in range(30):
            s = connect(port)
            s.close()
    threads = [threading.Thread(target=flood) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    deadline = time.time() + 5
    while served.server.http.admission.open and time.time() < deadline:
        time.sleep(0.05)
    assert served.server.http.admission.open == 0


def test_the_open_file_limit_is_raised_for_the_connection_limits_as_far_as_the_hard_limit_allows():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (300, hard))
        assert ensure_descriptors(400 if hard == resource.RLIM_INFINITY else min(400, hard)) >= min(400, hard)
        if hard != resource.RLIM_INFINITY:
            assert ensure_descriptors(hard + 1) == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert ServerConfig(http_port=0).descriptors_needed() > ServerConfig(http_port=None).descriptors_needed()


def test_limits_the_open_file_limit_cannot_hold_are_lowered_alike_or_the_start_refused():
    settings = ServerConfig(http_port=0, metrics_port=0)
    assert settings.fitted(settings.descriptors_needed()) is settings
    fitted = settings.fitted(1024)
    assert fitted.descriptors_needed() <= 1024
    assert fitted.grpc_limits.max_connections < settings.grpc_limits.max_connections
    assert fitted.http_limits.max_connections < settings.http_limits.max_connections
    assert fitted.http_limits.header_timeout_s == settings.http_limits.header_timeout_s
    with pytest.raises(ValueError, match="ulimit -n"):
        settings.fitted(RESERVED_FDS + 10)
