"""TLS on both fronts: certificates made here with openssl (a CA, a server certificate
for 127.0.0.1, a client certificate), a real Server on the tiny random model, the openai
client over HTTPS and our gRPC Client over TLS; plain-text clients refused; bad files a
clear start-up error."""
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time

import grpc
import openai
import pytest

from gateeng.config import ConnectionLimits, GrpcLimits, ServerConfig, TlsFiles
from gateeng.request import SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.serving.tls import client_credentials
from test_server_async import SERVING, Running, tiny_config

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


def openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
            "-subj", "/CN=gateeng test CA", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "a client")):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
                "-subj", f"/CN={cn}", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                "-out", f"{name}.pem", "-days", "2", *(["-extfile", "san.ext"] if name == "server" else []), cwd=d)
    return d


def tls_server(certs, client_certs=False):
    tls = TlsFiles(str(certs / "server.pem"), str(certs / "server.key"),
                   str(certs / "ca.pem") if client_certs else None)
    return Running(tiny_config(max_model_len=256),
                   settings=ServerConfig(port=0, metrics_port=0, http_port=0, tls=tls,
                                         grpc_limits=GrpcLimits(max_connections=16, handshake_timeout_s=2.0),
                                         http_limits=ConnectionLimits(max_connections=16, header_timeout_s=2.0)),
                   credentials=client_credentials(str(certs / "ca.pem"),
                                                  *((str(certs / "client.pem"), str(certs / "client.key"))
                                                    if client_certs else ())))


@pytest.fixture(scope="module")
def served(certs):
    srv = tls_server(certs)
    yield srv
    srv.stop()


def test_an_https_completion_with_the_openai_client_and_the_ca(served, certs):
    context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    api = openai.OpenAI(base_url=f"https://127.0.0.1:{served.server.http.port}/v1", api_key="unused",
                        max_retries=0, http_client=openai.DefaultHttpxClient(verify=context))
    with api:
        res = api.completions.create(model=served.server.gateway.model_name(), prompt=[5, 6, 7], max_tokens=3)
    assert res.choices[0].finish_reason in ("length", "stop")
    assert res.usage.completion_tokens >= 1


def test_grpc_health_and_complete_over_tls(served, certs):
    assert served.health() == SERVING
    with Client(served.target, ca_file=str(certs / "ca.pem")) as c:
        res = c.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True), timeout=30)
        assert len(res.token_ids) == 3


def test_plain_text_clients_are_refused_on_both_fronts(served):
    with Client(served.target) as c:                       # no CA: plain text
        with pytest.raises(grpc.RpcError) as e:
            c.server_info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with socket.create_connection(("127.0.0.1", served.server.http.port), timeout=5) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = b""
        try:
            while part := s.recv(4096):
                answer += part
        except (ConnectionResetError, socket.timeout):
            pass
    assert b"200" not in answer
    assert served.health() == SERVING                      # and the server goes on


def test_a_server_certificate_from_another_ca_is_not_trusted(served, certs):
    with Client(served.target, ca_file=str(certs / "client.pem")) as c:     # not the CA that signed it
        with pytest.raises(grpc.RpcError) as e:
            c.server_info()
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_a_stalled_https_handshake_is_closed_at_the_header_deadline(served):
    with socket.create_connection(("127.0.0.1", served.server.http.port), timeout=10) as s:
        t0 = time.time()
        try:
            assert s.recv(100) == b""
        except ConnectionResetError:
            pass
        assert time.time() - t0 < 2.0 + 3
    deadline = time.time() + 10
    while served.server.http.admission.open and time.time() < deadline:
        time.sleep(0.05)
    assert served.server.http.admission.open == 0


def test_client_certificates_are_required_with_ssl_ca_certs(certs):
    srv = tls_server(certs, client_certs=True)
    try:
        with Client(srv.target, ca_file=str(certs / "ca.pem")) as c:            # no client certificate
            with pytest.raises(grpc.RpcError):
                c.server_info()
        with Client(srv.target, ca_file=str(certs / "ca.pem"), cert_file=str(certs / "client.pem"),
                    key_file=str(certs / "client.key")) as c:
            assert c.server_info().requests_running == 0
        context = ssl.create_default_context(cafile=str(certs / "ca.pem"))
        url = f"https://127.0.0.1:{srv.server.http.port}/v1"
        bare = openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                             http_client=openai.DefaultHttpxClient(verify=context))
        with pytest.raises(openai.APIConnectionError):
            bare.models.list()
        context.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
        api = openai.OpenAI(base_url=url, api_key="unused", max_retries=0,
                            http_client=openai.DefaultHttpxClient(verify=context))
        assert api.models.list().data
    finally:
        srv.stop()


def serve_error(*flags) -> str:
    run = subprocess.run([sys.executable, "-m", "gateeng.tools.cli", "serve", "--port", "0", "--http-port", "-1",
                          "--metrics-port", "-1", *flags], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert "Traceback" not in run.stderr
    return run.stderr


def test_bad_tls_files_are_a_clear_start_up_error(certs, tmp_path):
    assert "--ssl-certfile /nonexistent.pem: cannot read it" in serve_error(
        "--ssl-certfile", "/nonexistent.pem", "--ssl-keyfile", str(certs / "server.key"))
    assert "needs TLS" in serve_error("--ssl-ca-certs", str(certs / "ca.pem"))
    assert "go together" in serve_error("--ssl-certfile", str(certs / "server.pem"))
    assert "not a certificate and its private key" in serve_error(
        "--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "client.key"))
    (tmp_path / "empty.pem").write_text("nothing here\n")
    assert "not a PEM file" in serve_error("--ssl-certfile", str(certs / "server.pem"),
                                           "--ssl-keyfile", str(tmp_path / "empty.pem"))


def test_gateeng_health_takes_the_ca(served, certs):
    cmd = [sys.executable, "-m", "gateeng.tools.cli", "health", "--server", served.target]
    plain = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert plain.returncode == 1
    run = subprocess.run(cmd + ["--ca-file", str(certs / "ca.pem")], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and "SERVING" in run.stdout, run.stderr
    # A container's HEALTHCHECK has no flags to add: the CA comes from the environment.
    env = dict(os.environ, GATEENG_CA_FILE=str(certs / "ca.pem"))
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and "SERVING" in run.stdout, run.stderr
