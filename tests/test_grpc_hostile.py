"""The gRPC listener under hostile load: connections are bounded before they are held,
so no flood of gRPC connections takes health, the HTTP front or the model's files down.
A real Server on the tiny random model (and, for the open-file limit, a real `gateeng
serve` process), raw sockets as an attacker uses them, real gRPC and HTTP clients."""
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import grpc
import pytest

from gateeng.config import ConnectionLimits, GrpcLimits, ServerConfig
from gateeng.request import SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.serving.grpc_gate import PREFACE
from test_http_hostile import post_completion
from test_server_async import SERVING, Running, health, tiny_config

LIMITS = GrpcLimits(max_connections=8, handshake_timeout_s=1.5, idle_timeout_s=2.0)


@pytest.fixture(scope="module")
def served():
    srv = Running(tiny_config(max_model_len=256),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=0, grpc_limits=LIMITS,
                                        http_limits=ConnectionLimits(max_connections=8, header_timeout_s=1.5)))
    yield srv
    srv.stop()


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` (reads reach EOF or a reset) within `seconds`;
    what it sends first (gRPC's settings, a GOAWAY) is read and dropped."""
    sock.settimeout(seconds)
    deadline = time.time() + seconds
    try:
        while time.time() < deadline:
            if not sock.recv(65536):
                return True
            sock.settimeout(max(0.01, deadline - time.time()))
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def wait_open(gate, want: int, seconds: float = 10) -> int:
    deadline = time.time() + seconds
    while gate.admission.open != want and time.time() < deadline:
        time.sleep(0.05)
    return gate.admission.open


def test_n_plus_one_silent_connections_leave_health_serving_and_http_answering(served):
    gate = served.server.grpc.gate
    socks = [connect(served.server.port) for _ in range(LIMITS.max_connections + 1)]
    time.sleep(0.2)
    assert gate.admission.open <= LIMITS.max_connections
    t0 = time.time()
    assert health(served.target, timeout=2) == SERVING          # a fresh channel, while the flood holds on
    assert time.time() - t0 < 1.0
    with Client(served.target) as c:
        assert len(c.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True)).token_ids) == 3
    assert post_completion(served.server.http.port)["choices"]
    assert gate.admission.evicted >= 1                          # the oldest silent ones made room
    for s in socks:
        s.close()
    assert wait_open(gate, 0) == 0


def test_a_silent_connection_is_closed_at_the_handshake_deadline(served):
    sock = connect(served.server.port)
    t0 = time.time()
    assert closed_within(sock, LIMITS.handshake_timeout_s + 3)
    took = time.time() - t0
    sock.close()
    assert LIMITS.handshake_timeout_s - 0.3 <= took <= LIMITS.handshake_timeout_s + 2, took


def test_bytes_that_are_not_http2_are_closed_at_once(served):
    sock = connect(served.server.port)
    sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    assert closed_within(sock, 1.0)
    sock.close()


def test_past_the_limit_of_connections_that_spoke_one_more_is_refused_at_once_and_logged_once(served, capsys):
    gate = served.server.grpc.gate
    refused_before = gate.admission.refused
    spoke = []
    for _ in range(LIMITS.max_connections):
        s = connect(served.server.port)
        s.sendall(PREFACE)              # a preface and then nothing: gRPC's own handshake deadline ends these
        spoke.append(s)
    assert wait_open(gate, LIMITS.max_connections) == LIMITS.max_connections
    extra = [connect(served.server.port) for _ in range(20)]
    assert all(closed_within(s, 1.0) for s in extra)
    assert gate.admission.refused - refused_before == 20
    # gRPC closes the ones that never sent their settings; then health is back at once.
    assert all(closed_within(s, LIMITS.handshake_timeout_s + 3) for s in spoke)
    for s in spoke + extra:
        s.close()
    assert wait_open(gate, 0) == 0
    assert health(served.target, timeout=2) == SERVING
    logged = [line for line in capsys.readouterr().err.splitlines() if "refused" in line]
    assert len(logged) <= 1, logged


def test_an_idle_connection_is_closed_after_the_idle_timeout_and_the_client_reconnects(served):
    gate = served.server.grpc.gate
    assert wait_open(gate, 0) == 0
    with Client(served.target) as c:
        c.server_info()
        assert gate.admission.open == 1
        assert wait_open(gate, 0, LIMITS.idle_timeout_s + 5) == 0     # gRPC's GOAWAY after no call for 2 s
        assert c.server_info().requests_running == 0                  # the next call reconnects


# ---- a real process under a real open-file limit ---------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_1100_silent_connections_on_either_front_under_an_open_file_limit_of_1024_leave_the_server_serving(tmp_path):
    from tiny import save_family
    save_family("llama", tmp_path / "model")
    needed = 1100 + 64
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < needed:
        pytest.skip(f"this test opens {needed} sockets; the hard open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, needed), hard))
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "gateeng.tools.cli", "serve", "--model", str(tmp_path / "model"),
           "--dtype", "float32", "--port", str(port), "--http-port", str(http_port), "--metrics-port", "-1",
           "--verified-route", "direct", "--max-model-len", "128", "--grpc-handshake-timeout", "5"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024)))
    socks = []
    try:
        target = f"127.0.0.1:{port}"
        deadline = time.time() + 180
        while True:
            assert proc.poll() is None and time.time() < deadline, "the server did not start"
            try:
                if health(target, timeout=1) == SERVING:
                    break
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        for _ in range(1100):
            socks.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        t0 = time.time()
        # Deadlines loose for a loaded host; the 5 s handshake timeout still lets the
        # probe in only if the gate closed a silent connection for it (or one timed out).
        assert health(target, timeout=10) == SERVING
        with Client(target) as c:
            assert len(c.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), timeout=20).token_ids) == 3
        assert post_completion(http_port)["choices"]
        assert time.time() - t0 < 40
        for s in socks:
            s.close()
        # The same flood on the HTTP front: its refusals and silent connections must not
        # take the descriptors gRPC needs (the output is checked below for EMFILE too).
        socks = [socket.create_connection(("127.0.0.1", http_port), timeout=10) for _ in range(1100)]
        assert health(target, timeout=10) == SERVING
        with Client(target) as c:
            assert len(c.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), timeout=20).token_ids) == 3
    finally:
        for s in socks:
            s.close()
        proc.send_signal(signal.SIGTERM)
        try:
            out = proc.communicate(timeout=60)[0]
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
    assert "below the" in out and "ulimit -n" in out, out[-3000:]       # the limits were lowered, and said so
    assert "Traceback" not in out, out[-3000:]
    assert "Too many open files" not in out, out[-3000:]


def test_metrics_listen_on_their_own_address():
    srv = Running(tiny_config(max_model_len=256),
                  settings=ServerConfig(port=0, metrics_port=0, metrics_host="127.0.0.2", http_port=None))
    try:
        port = srv.server.metrics_port
        assert srv.server.metrics_http.sock.getsockname()[0] == "127.0.0.2"
        text = urllib.request.urlopen(f"http://127.0.0.2:{port}/metrics", timeout=10).read().decode()
        assert "gateeng_" in text
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        assert health(srv.target) == SERVING              # gRPC stays on --host
    finally:
        srv.stop()
