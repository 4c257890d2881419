"""A small Python client for `gateeng serve`.

    with Client("127.0.0.1:50051") as c:
        res = c.complete("Hello", SamplingParams(max_tokens=32), DeterminismParams(Mode.VERIFIED))
        print(res.text, res.determinism.mismatches)
        chat = c.complete([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])

A server started with an API key needs it on every call: `Client(..., api_key=KEY)`,
or $GATEENG_API_KEY. One started with TLS needs the CA that signed its certificate:
`Client(..., ca_file="ca.pem")`.
"""
from __future__ import annotations

import os
from typing import Iterator, Optional, Union

import grpc

from gateeng.request import DeterminismParams, Mode, SamplingParams, StreamPolicy
from gateeng.serving.credentials import API_KEY_ENV
from gateeng.serving.tls import client_credentials
from gateeng.v1 import engine_pb2 as pb
from gateeng.v1 import engine_pb2_grpc as pb_grpc


def sampling_proto(p: SamplingParams) -> pb.SamplingParams:
    """Every field set; seed, logprobs and prompt_logprobs only where not None."""
    sp = pb.SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                           stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos)
    for name in ("seed", "logprobs", "prompt_logprobs"):
        if getattr(p, name) is not None:
            setattr(sp, name, getattr(p, name))
    return sp


def to_proto(prompt: Union[str, list], params: Optional[SamplingParams] = None,
             det: Optional[DeterminismParams] = None, chat: bool = False, request_id: str = "") -> pb.GenerateRequest:
    sp = sampling_proto(params or SamplingParams())
    d = det or DeterminismParams()
    dp = pb.Determinism(
        mode=pb.Determinism.MODE_VERIFIED if d.mode is Mode.VERIFIED else pb.Determinism.MODE_OFF,
        stream_policy=pb.Determinism.EAGER if d.stream_policy is StreamPolicy.EAGER else pb.Determinism.VERIFIED_ONLY)
    if d.margin_threshold is not None:
        dp.margin_threshold = d.margin_threshold
    if d.max_window is not None:
        dp.max_window = d.max_window
    req = pb.GenerateRequest(request_id=request_id, chat=chat, sampling=sp, determinism=dp)
    if isinstance(prompt, str):
        req.text = prompt
    elif prompt and isinstance(prompt[0], dict):      # chat messages
        req.messages.messages.extend(pb.ChatMessage(role=m["role"], content=m["content"]) for m in prompt)
    else:
        req.token_ids.ids.extend(prompt)
    return req


def channel(target: str, ca_file: Optional[str] = None, cert_file: Optional[str] = None,
            key_file: Optional[str] = None) -> grpc.Channel:
    """A channel to `target`: over TLS where a CA file (the server's certificate is
    checked against it) or a client certificate is given, else in plain text."""
    if ca_file or cert_file or key_file:
        return grpc.secure_channel(target, client_credentials(ca_file, cert_file, key_file))
    return grpc.insecure_channel(target)


class Client:
    def __init__(self, target: str, admin_token: Optional[str] = None, api_key: Optional[str] = None,
                 ca_file: Optional[str] = None, cert_file: Optional[str] = None, key_file: Optional[str] = None):
        """`api_key` goes with every call; None takes $GATEENG_API_KEY, "" sends none.
        `admin_token` goes with the admin calls only. `ca_file`: talk TLS to a server
        started with --ssl-certfile, whose certificate this CA (PEM) signed;
        `cert_file` and `key_file`: this client's certificate, for a server started
        with --ssl-ca-certs."""
        self.channel = channel(target, ca_file, cert_file, key_file)
        self.stub = pb_grpc.EngineStub(self.channel)
        self.admin_token = admin_token
        self.api_key = os.environ.get(API_KEY_ENV) if api_key is None else api_key
        self.metadata = [("authorization", f"Bearer {self.api_key}")] if self.api_key else []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        self.channel.close()

    def complete(self, prompt, params=None, det=None, chat=False, request_id="", timeout=None) -> pb.CompleteResponse:
        return self.stub.Complete(to_proto(prompt, params, det, chat, request_id), timeout=timeout,
                                  metadata=self.metadata)

    def generate(self, prompt, params=None, det=None, chat=False, request_id="",
                 timeout=None) -> Iterator[pb.GenerateResponse]:
        return self.stub.Generate(to_proto(prompt, params, det, chat, request_id), timeout=timeout,
                                  metadata=self.metadata)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata).found

    def server_info(self) -> pb.ServerInfo:
        return self.stub.GetServerInfo(pb.GetServerInfoRequest(), metadata=self.metadata)

    def model_info(self) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), metadata=self.metadata)

    def update_gate_config(self, margin_threshold=None, max_window=None) -> pb.GateConfig:
        req = pb.UpdateGateConfigRequest()
        if margin_threshold is not None:
            req.margin_threshold = margin_threshold
        if max_window is not None:
            req.max_window = max_window
        return self.stub.UpdateGateConfig(req, metadata=self._admin_metadata())

    def update_weights(self, path: str, timeout=None) -> pb.UpdateWeightsResponse:
        """Have the server serve the checkpoint in `path`, a directory on the server
        (admin; see the UpdateWeights RPC)."""
        return self.stub.UpdateWeights(pb.UpdateWeightsRequest(path=str(path)), metadata=self._admin_metadata(),
                                       timeout=timeout)

    def _admin_metadata(self) -> list:
        """The API key's entry and the admin token's: a server with both needs both."""
        return self.metadata + ([("authorization", f"Bearer {self.admin_token}")] if self.admin_token else [])
