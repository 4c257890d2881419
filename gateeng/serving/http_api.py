"""An OpenAI-compatible HTTP front (Starlette on uvicorn), on the gRPC server's event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming over SSE),
GET /v1/models, GET /health. It is the gRPC front's peer over the same serving
gateway (gateway.py): the same bounds, determinism checks (checks.py) and
refusals (refusals.py). Per-request determinism rides in an extension field:

    {"determinism": {"mode": "verified", "margin_threshold": 0.3, "max_window": 32}}

The response carries the Reproducibility record in `reproducibility`, the
determinism report in `determinism`, and the record's fingerprint in
`system_fingerprint`. Defaults follow the OpenAI API (temperature 1, max_tokens
16 for completions). Fail closed: an unknown field, an option we do not
implement (n > 1, penalties, logit_bias, ...) or an unknown determinism mode is a
400, never ignored. Errors are OpenAI-style JSON: {"error": {"message", "type",
"param", "code"}}.

Logprobs are the engine's (see SamplingParams.logprobs): on the distribution
sampled from, and bitwise reproducible for VERIFIED requests. Token strings in
logprobs are each token decoded alone.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import socket
import time
from pathlib import Path
from typing import Optional

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from gateeng.engine.client import Engine
from gateeng.engine.errors import EngineDead
from gateeng.outputs import Chunk, Completion
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams, StreamPolicy
from gateeng.serving import checks, refusals
from gateeng.serving.refusals import Kind, Refusal
from gateeng.serving.gateway import Gateway

FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length",
          FinishReason.ABORT: "abort"}
# Accepted, and ignored because they change nothing here.
HARMLESS = {"user", "stream_options"}
# OpenAI options we do not implement: accepted only at the value that means "off".
OFF_VALUES = {"n": 1, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None,
              "suffix": None, "tools": None, "tool_choice": None, "response_format": None,
              "parallel_tool_calls": None}
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "stream", "determinism",
          "ignore_eos"}
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs", "echo"}
CHAT_FIELDS = COMMON | {"messages", "logprobs", "top_logprobs", "max_completion_tokens"}


def error_response(r: Refusal) -> JSONResponse:
    """A refusal in OpenAI's error shape, with Retry-After where retrying helps."""
    headers = {"Retry-After": str(r.retry_after_s)} if r.retry_after_s is not None else None
    return JSONResponse({"error": {"message": r.message, "type": r.kind.openai_type, "param": r.param,
                                   "code": r.code}}, status_code=r.kind.http_status, headers=headers)


class OpenAIFront:
    """Routes over the gateway."""

    def __init__(self, gateway: Gateway, model_name: Optional[str] = None):
        self.gateway, self._model_name = gateway, model_name
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
        ])

    # ---- plumbing ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """--served-model-name, else the model file's or directory's name."""
        if self._model_name:
            return self._model_name
        engine = self.gateway.engine
        if engine is None:
            return "gateeng"
        source = Path(engine.loaded.source)
        return source.stem if source.suffix == ".gguf" else source.name

    @property
    def engine(self) -> Engine:
        return self.gateway.ready_engine()

    async def _body(self, request: HttpRequest, allowed: set) -> dict:
        limit = 2 * self.gateway.prompt_bytes() + 65536
        too_large = Refusal(Kind.TOO_LARGE, f"request body above {limit} bytes (--max-prompt-bytes)")
        if int(request.headers.get("content-length") or 0) > limit:
            raise too_large
        raw = await request.body()
        if len(raw) > limit:
            raise too_large
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise Refusal(Kind.INVALID, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise Refusal(Kind.INVALID, "the body must be a JSON object")
        for key, value in body.items():
            if key in allowed or key in HARMLESS:
                continue
            if key in OFF_VALUES:
                if value not in (OFF_VALUES[key], None, [], {}):
                    raise Refusal(Kind.INVALID, f"`{key}` = {value!r} is not supported by this server", param=key)
                continue
            raise Refusal(Kind.INVALID, f"unknown field `{key}`; supported: {', '.join(sorted(allowed))}", param=key)
        model = body.get("model")
        if model not in (None, self.model_name):
            raise Refusal(Kind.NOT_FOUND, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                          param="model", code="model_not_found")
        return body

    def _sampling(self, body: dict, max_tokens_default: Optional[int], logprobs=None,
                  prompt_logprobs=None) -> SamplingParams:
        stop = body.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, (list, tuple)) or any(not isinstance(x, str) for x in stop):
            raise Refusal(Kind.INVALID, "stop must be a string or a list of strings", param="stop")
        stop = checks.stop_strings(tuple(stop), field="stop")
        max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        if max_tokens is None:
            max_tokens = max_tokens_default or max(1, self.engine.max_model_len // 2)
        params = SamplingParams(
            temperature=_number(body, "temperature", 1.0), top_p=_number(body, "top_p", 1.0),
            top_k=int(_number(body, "top_k", 0)), seed=body.get("seed"), max_tokens=max_tokens, stop=stop,
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        try:
            params.validate()
        except (ValueError, TypeError) as e:
            raise Refusal(Kind.INVALID, str(e)) from None
        return params

    def _determinism(self, body: dict) -> DeterminismParams:
        d = body.get("determinism") or {}
        if not isinstance(d, dict):
            raise Refusal(Kind.INVALID, "`determinism` must be an object", param="determinism")
        unknown = set(d) - {"mode", "margin_threshold", "max_window", "stream_policy"}
        if unknown:
            raise Refusal(Kind.INVALID, f"unknown determinism fields {sorted(unknown)}", param="determinism")
        modes = {"off": Mode.OFF, "verified": Mode.VERIFIED}
        mode = d.get("mode", self.gateway.settings.http_default_mode)
        if mode not in modes:
            raise Refusal(Kind.INVALID, f"determinism.mode {mode!r} is not known; known: off, verified",
                          param="determinism.mode")
        if d.get("stream_policy", "verified_only") != "verified_only":
            raise Refusal(Kind.INVALID, "determinism.stream_policy: only verified_only; an OpenAI stream has no way "
                                        "to withdraw tokens (EAGER needs gRPC's rollback events)",
                          param="determinism.stream_policy")
        return checks.determinism(modes[mode], d.get("margin_threshold"), d.get("max_window"),
                                  StreamPolicy.VERIFIED_ONLY, self.gateway.bounds)

    async def _run(self, prompt, params, det, chat=False):
        """(request id, event iterator) after submitting; refusals raise."""
        request_id = "cmpl-" + secrets.token_hex(16)
        return request_id, await self.gateway.start(prompt, params, det, request_id, chat)

    def _extension(self, c: Completion) -> dict:
        return {"system_fingerprint": c.reproducibility.fingerprint(),
                "reproducibility": {**c.reproducibility.__dict__, "seed": c.seed},
                "determinism": {"mode": c.mode.value, **vars(c.stats)}}

    def _token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    # ---- routes -------------------------------------------------------------------
    async def health(self, request: HttpRequest):
        try:
            self.engine
        except Refusal as r:
            return error_response(r)
        return JSONResponse({"status": "serving"})

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model",
                                                         "created": self.created, "owned_by": "gateeng"}]})

    async def completions(self, request: HttpRequest):
        try:
            body = await self._body(request, COMPLETION_FIELDS)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if not (isinstance(prompt, str) or isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
                raise Refusal(Kind.INVALID, "prompt must be a string or a list of token ids (one prompt per request)",
                              param="prompt")
            k = body.get("logprobs")
            if k is not None and (not isinstance(k, int) or isinstance(k, bool)):
                raise Refusal(Kind.INVALID, "logprobs must be an integer (alternatives per token)", param="logprobs")
            echo = bool(body.get("echo", False))
            params = self._sampling(body, 16, logprobs=k, prompt_logprobs=k if echo and k is not None else None)
            det = self._determinism(body)
            request_id, stream = await self._run(prompt, params, det)
            if body.get("stream"):
                return self._sse(stream, request_id, "text_completion", self._completion_chunk)
            final = await _final(stream)
            return JSONResponse(self._completion_json(request_id, final, echo, k))
        except (Refusal, checks.BadRequest) as e:
            return self._refused(refusals.from_engine(e))

    async def chat_completions(self, request: HttpRequest):
        try:
            body = await self._body(request, CHAT_FIELDS)
            messages = body.get("messages")
            if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
                raise Refusal(Kind.INVALID, "messages must be a list of {role, content} objects", param="messages")
            for m in messages:
                if set(m) - {"role", "content", "name"}:
                    raise Refusal(Kind.INVALID, f"message fields {sorted(set(m) - {'role', 'content', 'name'})} are not "
                                                "supported", param="messages")
            k = body.get("top_logprobs", 0) if body.get("logprobs") else None
            params = self._sampling(body, None, logprobs=k)
            det = self._determinism(body)
            msgs = [{"role": m.get("role"), "content": m.get("content")} for m in messages]
            request_id, stream = await self._run(msgs, params, det)
            if body.get("stream"):
                return self._sse(stream, request_id, "chat.completion.chunk", self._chat_chunk)
            final = await _final(stream)
            return JSONResponse(self._chat_json(request_id, final, k))
        except (Refusal, checks.BadRequest) as e:
            return self._refused(refusals.from_engine(e))

    def _refused(self, r: Refusal) -> JSONResponse:
        self.gateway.count(r, "http")
        return error_response(r)

    # ---- response shapes ----------------------------------------------------------
    def _legacy_logprobs(self, items: list) -> dict:
        """The completions API's logprobs from (token id, logprob or None, top or None) items."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = 0
        for token, logprob, top in items:
            text = self._token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else _finite(logprob))
            alternatives = None
            if top is not None:
                alternatives = {}
                for t, v in top:
                    alternatives.setdefault(self._token_text(t), _finite(v))
            out["top_logprobs"].append(alternatives)
            out["text_offset"].append(pos)
            pos += len(text)
        return out

    def _completion_json(self, request_id: str, c: Completion, echo: bool, k: Optional[int]) -> dict:
        text = c.text
        logprobs = None
        if echo:
            text = self.engine.tokenizer.decode(c.prompt_ids) + text
        if k is not None:
            items = [(e.token, e.logprob, e.top) for e in c.logprobs]
            if echo:   # the first prompt token has no context, hence no logprob (as OpenAI)
                items = [(c.prompt_ids[0], None, None)] + [(e.token, e.logprob, e.top)
                                                            for e in c.prompt_logprobs] + items
            logprobs = self._legacy_logprobs(items)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs,
                             "finish_reason": FINISH[c.finish_reason]}],
                "usage": _usage(c), **self._extension(c)}

    def _chat_logprobs(self, entries: list) -> dict:
        def item(t, v):
            text = self._token_text(t)
            return {"token": text, "logprob": _finite(v), "bytes": list(text.encode())}
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, v) for t, v in e.top])
                            for e in entries]}

    def _chat_json(self, request_id: str, c: Completion, k: Optional[int]) -> dict:
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": self._chat_logprobs(c.logprobs) if k is not None else None,
                             "finish_reason": FINISH[c.finish_reason]}],
                "usage": _usage(c), **self._extension(c)}

    def _completion_chunk(self, request_id: str, ev, first: bool) -> dict:
        choice = {"index": 0, "text": ev.text if isinstance(ev, Chunk) else "", "logprobs": None,
                  "finish_reason": None if isinstance(ev, Chunk) else FINISH[ev.finish_reason]}
        return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": [choice]}

    def _chat_chunk(self, request_id: str, ev, first: bool) -> dict:
        delta = {"role": "assistant"} if first else {}
        if isinstance(ev, Chunk):
            delta["content"] = ev.text
        choice = {"index": 0, "delta": delta, "logprobs": None,
                  "finish_reason": None if isinstance(ev, Chunk) else FINISH[ev.finish_reason]}
        if isinstance(ev, Chunk) and ev.logprobs:
            choice["logprobs"] = self._chat_logprobs(ev.logprobs)
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name, "choices": [choice]}

    def _sse(self, stream, request_id: str, kind: str, shape) -> StreamingResponse:
        async def events():
            first = True
            try:
                async for ev in stream:
                    if not isinstance(ev, (Chunk, Completion)):
                        continue                      # Rollback: VERIFIED_ONLY streams send none
                    if isinstance(ev, Chunk) and not ev.text and not ev.token_ids:
                        continue
                    payload = shape(request_id, ev, first)
                    first = False
                    if isinstance(ev, Completion):
                        payload.update(usage=_usage(ev), **self._extension(ev))
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            except EngineDead as e:
                yield f"data: {json.dumps({'error': {'message': str(e), 'type': 'server_error'}})}\n\n"
            finally:
                await stream.aclose()                 # a client that went away aborts its request
        return StreamingResponse(events(), media_type="text/event-stream")


async def _final(stream) -> Completion:
    try:
        async for ev in stream:
            if isinstance(ev, Completion):
                return ev
    except EngineDead as e:
        raise refusals.from_engine(e, submitted=True) from None
    finally:
        await stream.aclose()
    raise Refusal(Kind.INTERNAL, "the request ended without a completion")


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def _number(body: dict, key: str, default: float) -> float:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refusal(Kind.INVALID, f"`{key}` must be a number", param=key)
    return float(value)


def _finite(v: float):
    """JSON has no -inf: a token top-k/top-p removed gets the most negative float."""
    return v if math.isfinite(v) else -3.4028234663852886e38


class HttpServer:
    """uvicorn serving an OpenAIFront on the running event loop. Signals stay with
    the gRPC server, which drains both."""

    def __init__(self, front: OpenAIFront, host: str, port: int):
        class _Server(uvicorn.Server):
            def capture_signals(self):       # the gateeng Server owns SIGTERM / SIGINT
                return contextlib.nullcontext()

        self.sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((host, port))
        self.port = self.sock.getsockname()[1]
        self.server = _Server(uvicorn.Config(front.app, log_level="warning", lifespan="off",
                                             timeout_graceful_shutdown=5))
        self.task = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self.server.serve(sockets=[self.sock]))

    async def stop(self) -> None:
        self.server.should_exit = True
        if self.task is not None:
            await self.task
