"""An OpenAI-compatible HTTP front (Starlette on uvicorn), on its own thread and event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming over SSE),
GET /v1/models, GET /v1/models/{id}, GET /health, GET /metrics (Prometheus); any
other path is a 404 in OpenAI's error shape. It is the gRPC front's peer over the same serving
gateway (gateway.py): the same bounds, determinism checks (checks.py) and
refusals (refusals.py). Per-request determinism rides in an extension field:

    {"determinism": {"mode": "verified", "margin_threshold": 0.3, "max_window": 32}}

The response carries the Reproducibility record in `reproducibility`, the
determinism report in `determinism`, the record's fingerprint in
`system_fingerprint`, and in `replay` what `gateeng replay` needs to decode it
again: the prompt's token ids (after the chat template), the output's token ids
and the sampling parameters as run (the drawn seed filled in). GET /v1/models
shows the server's record, so a replay can refuse a server before it decodes.
Defaults follow the OpenAI API (temperature 1, max_tokens 16 for
completions). Fail closed: an unknown field, an option we do not
implement (n > 1, penalties, logit_bias, ...), a field of the wrong type or an
unknown determinism mode is a 400, never ignored or coerced. Errors are
OpenAI-style JSON: {"error": {"message", "type", "param", "code"}}, with
Retry-After where retrying helps; no request content reaches a bare 500.

A client that closes its connection aborts its request (a plain request as well
as a stream). A request the drain cuts is a 503 with Retry-After; its SSE stream
ends with an error event, never with [DONE].

Logprobs are the engine's (see SamplingParams.logprobs): on the distribution
sampled from, and bitwise reproducible for VERIFIED requests. Token strings in
logprobs are each token decoded alone.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import secrets
import time
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateeng.config import HTTP_BODY_SLACK_BYTES
from gateeng.engine.client import Engine
from gateeng.engine.errors import EngineDead
from gateeng.logs import LOGGER
from gateeng.outputs import Chunk, Completion
from gateeng.request import DeterminismParams, FinishReason, Mode, SamplingParams, StreamPolicy
from gateeng.serving import checks, refusals
from gateeng.serving.refusals import Kind, Refusal
from gateeng.serving.gateway import REQUEST_ID_HEADER, Gateway

log = LOGGER.getChild("http")
FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length",
          FinishReason.ABORT: "abort"}
# A body past the limit is read and dropped up to this size, so that its client
# gets the 413 rather than a reset connection; past it, the connection closes.
DISCARD_BYTES = 16 * 1024 * 1024
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


def error_body(r: Refusal) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": r.message, "type": r.kind.openai_type, "param": r.param, "code": r.code}}


def error_response(r: Refusal) -> Response:
    """A refusal as OpenAI answers one, with Retry-After where retrying helps. ASCII
    JSON, so no message (which may quote the request) can fail to encode."""
    headers = {"Retry-After": str(r.retry_after_s)} if r.retry_after_s is not None else {}
    if r.kind in (Kind.TOO_LARGE, Kind.TIMEOUT):
        headers["Connection"] = "close"   # the body's rest was not read: this connection cannot carry another
    return Response(json.dumps(error_body(r)), status_code=r.kind.http_status, headers=headers,
                    media_type="application/json")


class OpenAIFront:
    """Routes over the gateway."""

    def __init__(self, gateway: Gateway):
        self.gateway = gateway
        self.created = int(time.time())
        self.app = Starlette(routes=[
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
            Route("/v1/completions", self._guarded(self.completions, "cmpl-"), methods=["POST"]),
            Route("/v1/chat/completions", self._guarded(self.chat_completions, "chatcmpl-"), methods=["POST"]),
        ], exception_handlers={404: self._not_found, 405: self._not_allowed})

    # ---- plumbing ---------------------------------------------------------------
    @property
    def model_name(self) -> str:
        """The model's name both fronts show (Gateway.model_name)."""
        return self.gateway.model_name() or "gateeng"

    @property
    def engine(self) -> Engine:
        return self.gateway.ready_engine()

    async def _body(self, request: HttpRequest, allowed: set) -> dict:
        raw = await self._read_body(request)
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:
            raise Refusal(Kind.INVALID, f"the body is not valid JSON: {e}") from None
        if not isinstance(body, dict):
            raise Refusal(Kind.INVALID, "the body must be a JSON object")
        for key, value in body.items():
            if key in allowed or key in HARMLESS:
                continue
            if key in OFF_VALUES:
                off = value is None or value in ([], {}) or (not isinstance(value, bool) and value == OFF_VALUES[key])
                if not off:
                    raise Refusal(Kind.INVALID, f"`{key}` = {value!r} is not supported by this server", param=key)
                continue
            raise Refusal(Kind.INVALID, f"unknown field `{key}`; supported: {', '.join(sorted(allowed))}", param=key)
        model = body.get("model")
        if model not in (None, self.model_name):
            raise Refusal(Kind.NOT_FOUND, f"model {model!r} is not served here; this server serves {self.model_name!r}",
                          param="model", code="model_not_found")
        return body

    async def _read_body(self, request: HttpRequest) -> bytes:
        """The body's bytes, bounded before they are held. --max-prompt-bytes is already
        several times what the context holds, so a body past it (plus room for the
        other fields) carries a prompt that cannot fit, however its text is escaped.
        The limit applies to the bytes received, whatever Content-Length says and
        with chunked transfer alike: past it nothing more is kept, the rest is read
        and dropped up to DISCARD_BYTES (so the client reads the 413, not a reset)
        and the connection is closed after the answer. The whole body must arrive
        within --http-body-timeout."""
        prompt_bytes = self.gateway.prompt_bytes()
        limit = prompt_bytes + HTTP_BODY_SLACK_BYTES
        header = request.headers.get("content-length")
        if header is not None and not header.isdigit():
            raise Refusal(Kind.INVALID, f"Content-Length {header!r} is not a byte count")
        declared = int(header or 0)
        keep = declared <= limit
        chunks, received = [], 0
        seconds = self.gateway.settings.http_limits.body_timeout_s
        try:
            async with asyncio.timeout(seconds):
                if keep or declared <= DISCARD_BYTES:
                    async for chunk in request.stream():
                        received += len(chunk)
                        keep = keep and received <= limit
                        if keep:
                            chunks.append(chunk)
                        elif received > DISCARD_BYTES:
                            break
        except TimeoutError:
            raise Refusal(Kind.TIMEOUT, f"the request body did not arrive within {seconds:g} s "
                                        f"(--http-body-timeout); {received} bytes came") from None
        if not keep:
            raise Refusal(Kind.TOO_LARGE, f"request body above {limit} bytes: its prompt is past "
                                          f"--max-prompt-bytes ({prompt_bytes}), far more than the context holds")
        return b"".join(chunks)

    def _sampling(self, body: dict, max_tokens_default: int, logprobs=None, prompt_logprobs=None) -> SamplingParams:
        """OpenAI's sampling fields, checked by checks.sampling as gRPC's are."""
        fields = {key: body.get(key) for key in ("temperature", "top_p", "top_k", "seed", "stop", "ignore_eos")}
        fields.update(max_tokens=body.get("max_completion_tokens", body.get("max_tokens")), logprobs=logprobs,
                      prompt_logprobs=prompt_logprobs)
        return checks.sampling(fields, self.engine.max_model_len, temperature=1.0, max_tokens=max_tokens_default)

    def _determinism(self, body: dict) -> DeterminismParams:
        d = body.get("determinism")
        if d is None:
            d = {}
        if not isinstance(d, dict):
            raise Refusal(Kind.INVALID, f"`determinism` must be an object or null, got {type(d).__name__}",
                          param="determinism")
        unknown = set(d) - {"mode", "margin_threshold", "max_window", "stream_policy"}
        if unknown:
            raise Refusal(Kind.INVALID, f"unknown determinism fields {sorted(unknown)}", param="determinism")
        modes = {"off": Mode.OFF, "verified": Mode.VERIFIED}
        mode = d.get("mode", self.gateway.settings.http_default_mode)
        if not isinstance(mode, str) or mode not in modes:
            raise Refusal(Kind.INVALID, f"determinism.mode {mode!r} is not known; known: off, verified",
                          param="determinism.mode")
        if d.get("stream_policy", "verified_only") != "verified_only":
            raise Refusal(Kind.INVALID, "determinism.stream_policy: only verified_only; an OpenAI stream has no way "
                                        "to withdraw tokens (EAGER needs gRPC's rollback events)",
                          param="determinism.stream_policy")
        return checks.determinism(modes[mode], d.get("margin_threshold"), d.get("max_window"),
                                  StreamPolicy.VERIFIED_ONLY, self.gateway.bounds)

    def _extension(self, c: Completion) -> dict:
        return {"system_fingerprint": c.reproducibility.fingerprint(),
                "reproducibility": {**record_json(c.reproducibility), "seed": c.seed},
                "determinism": {"mode": c.mode.value, **vars(c.stats)},
                "replay": {"prompt_token_ids": c.prompt_ids, "token_ids": c.token_ids,
                           "sampling": c.sampling.to_dict()},
                **({"finish_detail": c.finish_detail} if c.finish_detail else {})}

    def _token_text(self, token: int) -> str:
        return self.engine.tokenizer.decode([token])

    def _guarded(self, handler, id_prefix: str):
        """A generation route: a fresh server id for the request (the response's `id`
        and its gateeng-request-id header), and no exception past it. A refusal
        is answered in OpenAI's error shape and counted; anything else is logged
        with the request id, answered 500 in the same shape and counted."""
        async def route(request: HttpRequest):
            request_id = id_prefix + secrets.token_hex(16)
            try:
                response = await handler(request, request_id)
            except ClientDisconnect:       # gone while sending its body: nobody to answer
                log.debug("request %s: the client went away before its body arrived", request_id)
                response = Response(status_code=400)
            except (Refusal, checks.BadRequest) as e:
                response = self._refused(refusals.from_engine(e))
            except Exception:
                log.exception("request %s (%s) failed", request_id, request.url.path)
                response = self._refused(refusals.internal_error(request_id))
            response.headers[REQUEST_ID_HEADER] = request_id
            return response
        return route

    def _refused(self, r: Refusal) -> Response:
        self.gateway.count(r, "http")
        return error_response(r)

    # ---- routes -------------------------------------------------------------------
    async def health(self, request: HttpRequest):
        try:
            self.engine
        except Refusal as r:
            return error_response(r)
        return JSONResponse({"status": "serving"})

    def _model_card(self) -> dict:
        model = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "gateeng"}
        engine = self.gateway.engine
        if engine is not None:    # what `gateeng replay --openai` checks before it decodes
            model["reproducibility"] = record_json(engine.reproducibility)
            model["weight_version"] = engine.weight_version   # 0 at start, +1 per applied weight update
        return model

    async def metrics(self, request: HttpRequest):
        """The same registry as --metrics-port serves, on the API port too, where vLLM's
        clients (aiperf) look for it."""
        return Response(generate_latest(self.gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: HttpRequest):
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: HttpRequest):
        """GET /v1/models/{id}: the served model's card, or OpenAI's 404."""
        model_id = request.path_params["model_id"]
        if model_id != self.model_name:
            return error_response(Refusal(Kind.NOT_FOUND, f"model {model_id!r} is not served here; this server "
                                                          f"serves {self.model_name!r}", param="model",
                                          code="model_not_found"))
        return JSONResponse(self._model_card())

    async def _not_found(self, request: HttpRequest, exc) -> Response:
        return error_response(Refusal(Kind.NOT_FOUND, f"no route {request.url.path}; this server answers "
                                                      f"/v1/completions, /v1/chat/completions, /v1/models, /health "
                                                      f"and /metrics"))

    async def _not_allowed(self, request: HttpRequest, exc) -> Response:
        r = Refusal(Kind.INVALID, f"{request.method} is not allowed on {request.url.path}")
        return Response(json.dumps(error_body(r)), status_code=405, media_type="application/json")

    async def completions(self, request: HttpRequest, request_id: str):
        body = await self._body(request, COMPLETION_FIELDS)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                # a batch of one prompt
        if isinstance(prompt, list):
            prompt = checks.token_ids(prompt, "prompt")
        elif not isinstance(prompt, str):        # text is checked with its size, in Gateway.start
            raise Refusal(Kind.INVALID, "prompt must be a string or a list of token ids (one prompt per request)",
                          param="prompt")
        k = checks.integer(body.get("logprobs"), "logprobs")
        echo = checks.boolean(body.get("echo"), "echo") or False
        stream = checks.boolean(body.get("stream"), "stream") or False
        if echo and stream:
            raise Refusal(Kind.INVALID, "`echo` is not served on a stream (the prompt's logprobs come with the "
                                        "whole answer); ask without `stream`", param="echo")
        params = self._sampling(body, 16, logprobs=k, prompt_logprobs=k if echo and k is not None else None)
        det = self._determinism(body)
        events = await self.gateway.start(prompt, params, det, request_id)
        return await self._respond(request, request_id, events, stream, "text_completion",
                                   self._completion_chunks(),
                                   lambda final: self._completion_json(request_id, final, echo, k))

    async def chat_completions(self, request: HttpRequest, request_id: str):
        body = await self._body(request, CHAT_FIELDS)
        messages = checks.messages(body.get("messages"))
        k = None
        if checks.boolean(body.get("logprobs"), "logprobs"):
            k = checks.integer(body.get("top_logprobs"), "top_logprobs") or 0
        elif body.get("top_logprobs") is not None:
            raise Refusal(Kind.INVALID, "`top_logprobs` needs `logprobs: true`", param="top_logprobs")
        stream = checks.boolean(body.get("stream"), "stream") or False
        params = self._sampling(body, max(1, self.engine.max_model_len // 2), logprobs=k)
        det = self._determinism(body)
        events = await self.gateway.start(messages, params, det, request_id)
        return await self._respond(request, request_id, events, stream, "chat.completion.chunk", self._chat_chunk,
                                   lambda final: self._chat_json(request_id, final, k))

    async def _respond(self, request: HttpRequest, request_id: str, events, stream: bool, kind: str, chunk_shape,
                       whole_shape) -> Response:
        """An SSE stream of chunk_shape events, or the one JSON answer whole_shape makes."""
        if stream:
            return self._sse(events, request_id, kind, chunk_shape)
        final = await self._final(request, events)
        if final is None:
            return Response(status_code=400)   # the client is gone: nobody reads this
        return JSONResponse(whole_shape(final))

    async def _final(self, request: HttpRequest, events) -> Optional[Completion]:
        """The request's Completion; None if the client closed its connection first,
        which aborts the request (its KV freed, counted as finish_reason abort).
        A request the drain cut is a 503 with Retry-After, for the client to retry."""
        answer = asyncio.ensure_future(_completion(events))
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (answer, gone):
                task.cancel()              # a cancelled `answer` closes `events`: the abort
            await asyncio.gather(answer, gone, return_exceptions=True)
        if answer.cancelled():
            log.debug("a client went away before its request finished; aborted")
            return None
        final = answer.result()
        cut = self.gateway.cut_by_drain(final)
        if cut is not None:
            raise cut
        return final

    # ---- response shapes ----------------------------------------------------------
    def _legacy_logprobs(self, items: list, pos: int = 0) -> dict:
        """The completions API's logprobs from (token id, logprob or None, top or None)
        items, their text offsets counted from `pos`."""
        out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, logprob, top in items:
            text = self._token_text(token)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if logprob is None else json_logprob(logprob))
            alternatives = None
            if top is not None:
                alternatives = {}
                for t, v in top:
                    alternatives.setdefault(self._token_text(t), json_logprob(v))
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
            return {"token": text, "logprob": json_logprob(v), "bytes": list(text.encode())}
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, v) for t, v in e.top])
                            for e in entries]}

    def _chat_json(self, request_id: str, c: Completion, k: Optional[int]) -> dict:
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": self.model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": c.text},
                             "logprobs": self._chat_logprobs(c.logprobs) if k is not None else None,
                             "finish_reason": FINISH[c.finish_reason]}],
                "usage": _usage(c), **self._extension(c)}

    def _completion_chunks(self):
        """The shape of one stream's completion chunks. A chunk's logprobs are its
        tokens' (as OpenAI streams them), their text offsets counted over the stream."""
        offset = 0

        def shape(request_id: str, ev, first: bool) -> dict:
            nonlocal offset
            choice = {"index": 0, "text": ev.text if isinstance(ev, Chunk) else "", "logprobs": None,
                      "finish_reason": None if isinstance(ev, Chunk) else FINISH[ev.finish_reason]}
            if isinstance(ev, Chunk) and ev.logprobs:
                choice["logprobs"] = lp = self._legacy_logprobs([(e.token, e.logprob, e.top) for e in ev.logprobs],
                                                                offset)
                offset += sum(len(t) for t in lp["tokens"])
            return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice]}
        return shape

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

    def _sse(self, events, request_id: str, kind: str, shape) -> StreamingResponse:
        """Server-sent events, ending with `data: [DONE]` only when the request
        finished. A request cut by the drain, an engine failure or an unexpected
        error ends with an error event instead (counted as the unary answer's
        status would be), so no client takes a cut answer for a whole one."""
        def error_event(r: Refusal) -> str:
            self.gateway.count(r, "http")
            return "data: " + json.dumps(error_body(r)) + "\n\n"

        async def stream():
            first = True
            try:
                async for ev in events:
                    if not isinstance(ev, (Chunk, Completion)):
                        continue                      # Rollback: VERIFIED_ONLY streams send none
                    if isinstance(ev, Chunk) and not ev.text and not ev.token_ids:
                        continue
                    if isinstance(ev, Completion):
                        cut = self.gateway.cut_by_drain(ev)
                        if cut is not None:
                            yield error_event(cut)
                            return
                    payload = shape(request_id, ev, first)
                    first = False
                    if isinstance(ev, Completion):
                        payload.update(usage=_usage(ev), **self._extension(ev))
                    yield f"data: {json.dumps(payload)}\n\n"
                yield "data: [DONE]\n\n"
            except EngineDead as e:
                yield error_event(refusals.from_engine(e, submitted=True))
            except Exception:
                log.exception("request %s (stream) failed", request_id)
                yield error_event(refusals.internal_error(request_id))
            finally:
                await events.aclose()                 # a client that went away aborts its request
        return StreamingResponse(stream(), media_type="text/event-stream")


async def _completion(events) -> Completion:
    try:
        async for ev in events:
            if isinstance(ev, Completion):
                return ev
    except EngineDead as e:
        raise refusals.from_engine(e, submitted=True) from None
    finally:
        await events.aclose()
    raise Refusal(Kind.INTERNAL, "the request ended without a completion")


async def _disconnect(request: HttpRequest) -> None:
    """Returns when the client closes its connection. The body is read by then, so
    the only message left for this request is http.disconnect."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def record_json(r) -> dict:
    """A Reproducibility record as the HTTP front shows it, with its fingerprint."""
    return {**dataclasses.asdict(r), "fingerprint": r.fingerprint()}


def _usage(c: Completion) -> dict:
    return {"prompt_tokens": c.prompt_tokens, "completion_tokens": c.completion_tokens,
            "total_tokens": c.prompt_tokens + c.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": c.cached_tokens}}


def json_logprob(v: float):
    """JSON has no -inf: a token top-k/top-p removed gets the most negative float."""
    return v if math.isfinite(v) else -3.4028234663852886e38
