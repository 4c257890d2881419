"""An OpenAI-compatible HTTP front (Starlette on uvicorn), on its own thread and event loop.

Routes: POST /v1/completions, POST /v1/chat/completions (streaming over SSE),
GET /v1/models, GET /v1/models/{id}, POST /tokenize, POST /detokenize (vLLM's
shapes), GET /version, GET /health, GET /metrics (Prometheus); any other path is
a 404 in OpenAI's error shape. It is the gRPC front's peer over the same serving
gateway (gateway.py): the same bounds, checks (checks.py) and refusals
(refusals.py). http_edge.py reads a body into the values a request runs with, as
grpc_edge.py reads a protobuf; this module routes, reads the body's bytes, starts the
requests and shapes the answers. Per-request determinism rides in an extension
field:

    {"determinism": {"mode": "verified", "margin_threshold": 0.3, "max_window": 32}}

The response carries the Reproducibility record in `reproducibility`, the
determinism report in `determinism`, the record's fingerprint in
`system_fingerprint`, and in `replay` what `gateeng replay` needs to decode it
again: the prompt's token ids (after the chat template), the output's token ids
and the sampling parameters as run (the drawn seed filled in). GET /v1/models
shows the server's record, so a replay can refuse a server before it decodes.
Defaults follow the OpenAI API (temperature 1, max_tokens 16 for
completions). Each choice of a request (`n` per prompt, and one per prompt of a
prompt list) is a request of the engine's own, with the seed
request.choice_seed gives it; a single choice's fields (reproducibility,
determinism, replay) are each choice's own, and a one-choice answer's at
its top level too. Fail closed: an unknown field, an
option we do not implement (penalties, logit_bias, a response_format other
than text, ...), a field of the wrong type or an unknown determinism mode is a
400, never ignored or coerced. Errors are
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
import secrets
import time
from typing import Optional

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from gateeng import __version__, reproducibility
from gateeng.answers import json_logprob
from gateeng.config import HTTP_BODY_SLACK_BYTES
from gateeng.engine.engine import Engine
from gateeng.engine.errors import EngineDead
from gateeng.logs import LOGGER
from gateeng.outputs import Chunk, Completion
from gateeng.request import FinishReason, choice_seed
from gateeng.serving import checks, http_edge, refusals
from gateeng.serving.http_edge import Generation
from gateeng.serving.refusals import Kind, Refusal
from gateeng.serving.gateway import REQUEST_ID_HEADER, Gateway

log = LOGGER.getChild("http")
FINISH = {FinishReason.STOP: "stop", FinishReason.EOS: "stop", FinishReason.LENGTH: "length",
          FinishReason.ABORT: "abort"}
# A body past the limit is read and dropped up to this size, so that its client
# gets the 413 rather than a reset connection; past it, the connection closes.
DISCARD_BYTES = 16 * 1024 * 1024


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
            Route("/version", self.version, methods=["GET"]),
            Route("/tokenize", self._guarded(self.tokenize, "tokenize-"), methods=["POST"]),
            Route("/detokenize", self._guarded(self.detokenize, "detokenize-"), methods=["POST"]),
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
        """The body, read within its bounds and parsed (http_edge.parse)."""
        return http_edge.parse(await self._read_body(request), allowed, self.model_name)

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

    def _own(self, c: Completion) -> dict:
        """A choice's own fields: what a replay, or a trainer rescoring it, reads."""
        return {"reproducibility": {**record_json(c.reproducibility), "seed": c.seed},
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
            # Whether gateeng.train.Policy computes this server's VERIFIED bits, and why not.
            why = reproducibility.untrainable(record_json(engine.reproducibility))
            model["trainable"], model["untrainable_reason"] = not why, why
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
                                                      f"/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                                                      f"/detokenize, /version, /health and /metrics"))

    async def _not_allowed(self, request: HttpRequest, exc) -> Response:
        r = Refusal(Kind.INVALID, f"{request.method} is not allowed on {request.url.path}")
        return Response(json.dumps(error_body(r)), status_code=405, media_type="application/json")

    async def version(self, request: HttpRequest):
        return JSONResponse({"version": __version__})

    async def tokenize(self, request: HttpRequest, request_id: str):
        """vLLM's /tokenize: the ids the completions route (`prompt`) or the chat route
        (`messages`, rendered with the chat template) would decode from."""
        prompt, chat = http_edge.tokenize_input(await self._body(request, http_edge.TOKENIZE_FIELDS))
        ids = await self.gateway.encode(prompt, chat)
        return JSONResponse({"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                             "token_strs": None})

    async def detokenize(self, request: HttpRequest, request_id: str):
        """vLLM's /detokenize: the text of a list of token ids."""
        body = await self._body(request, http_edge.DETOKENIZE_FIELDS)
        ids = http_edge.detokenize_ids(body, self.engine.model_config.vocab_size)
        return JSONResponse({"prompt": self.engine.tokenizer.decode(ids)})

    async def completions(self, request: HttpRequest, request_id: str):
        body = await self._body(request, http_edge.COMPLETION_FIELDS)
        g = http_edge.completion(body, self.engine.max_model_len, self.gateway.settings.http_default_mode,
                                 self.gateway.bounds)
        runs = await self._start(g, request_id)
        return await self._respond(request, request_id, runs, g, self._completion_chunks(),
                                   lambda finals: self._completion_json(request_id, finals, g.n, g.echo, g.logprobs))

    async def chat_completions(self, request: HttpRequest, request_id: str):
        body = await self._body(request, http_edge.CHAT_FIELDS)
        g = http_edge.chat(body, self.engine.max_model_len, self.gateway.settings.http_default_mode,
                           self.gateway.bounds)
        runs = await self._start(g, request_id)
        return await self._respond(request, request_id, runs, g, self._chat_chunk,
                                   lambda finals: self._chat_json(request_id, finals, g.n, g.logprobs))

    async def _start(self, g: Generation, request_id: str) -> list:
        """Submit every choice: prompt p's choice i is index p * n + i (as OpenAI
        numbers them), with the seed choice_seed(seed, i). All or none: a refusal
        part-way aborts the choices already queued."""
        total, params = len(g.prompts) * g.n, g.sampling
        capacity = self.engine.config.max_queue + self.engine.config.max_num_seqs
        if total > capacity:
            raise Refusal(Kind.INVALID, f"this request asks for {total} choices; this server holds at most "
                                        f"{capacity} requests at once: send fewer", param="n")
        runs = []
        try:
            for prompt in g.prompts:
                for i in range(g.n):
                    choice = params if params.seed is None else dataclasses.replace(
                        params, seed=choice_seed(params.seed, i))
                    rid = request_id if total == 1 else f"{request_id}-{len(runs)}"
                    runs.append(await self.gateway.start(prompt, choice, g.determinism, rid))
        except BaseException:
            for events in runs:
                await events.aclose()          # aborts the request
            raise
        return runs

    async def _respond(self, request: HttpRequest, request_id: str, runs: list, g: Generation, chunk_shape,
                       whole_shape) -> Response:
        """An SSE stream of chunk_shape events, or the one JSON answer whole_shape
        makes of the choices' Completions."""
        if g.stream:
            return self._sse(runs, request_id, g.n, g.include_usage, chunk_shape)
        finals = await self._finals(request, runs)
        if finals is None:
            return Response(status_code=400)   # the client is gone: nobody reads this
        return JSONResponse(whole_shape(finals))

    async def _finals(self, request: HttpRequest, runs: list) -> Optional[list]:
        """Every choice's Completion; None if the client closed its connection first,
        which aborts them all (their KV freed, counted as finish_reason abort). A
        choice that fails ends the others. A request the drain cut is a 503 with
        Retry-After, for the client to retry."""
        answers = [asyncio.ensure_future(_completion(events)) for events in runs]
        whole = asyncio.gather(*answers)
        gone = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait((whole, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (*answers, gone):
                task.cancel()              # a cancelled answer closes its events: the abort
            await asyncio.gather(whole, gone, return_exceptions=True)
        # Answers are cancelled only once the client has gone (or all are done), so a
        # cancellation in `whole` means the client left; any other error is raised.
        error = asyncio.CancelledError() if whole.cancelled() else whole.exception()
        if isinstance(error, asyncio.CancelledError):
            log.debug("a client went away before its request finished; aborted")
            return None
        if error is not None:
            raise error
        finals = whole.result()
        for final in finals:
            cut = self.gateway.cut_by_drain(final)
            if cut is not None:
                raise cut
        return finals

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

    def _completion_choice(self, index: int, c: Completion, echo: bool, k: Optional[int]) -> dict:
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
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": FINISH[c.finish_reason]}

    def _completion_json(self, request_id: str, finals: list, n: int, echo: bool, k: Optional[int]) -> dict:
        return self._whole(request_id, "text_completion", finals, n,
                           [self._completion_choice(i, c, echo, k) for i, c in enumerate(finals)])

    def _whole(self, request_id: str, kind: str, finals: list, n: int, choices: list) -> dict:
        """A whole answer. Each choice carries its own fields (reproducibility,
        determinism, replay), whatever their number; a one-choice answer carries
        them at its top level too, as it did before choices did."""
        body = {"id": request_id, "object": kind, "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": _usage(finals, n),
                "system_fingerprint": finals[0].reproducibility.fingerprint()}
        for choice, c in zip(choices, finals):
            choice.update(self._own(c))
        if len(finals) == 1:
            body.update(self._own(finals[0]))
        return body

    def _chat_logprobs(self, entries: list) -> dict:
        def item(t, v):
            text = self._token_text(t)
            return {"token": text, "logprob": json_logprob(v), "bytes": list(text.encode())}
        return {"content": [dict(item(e.token, e.logprob), top_logprobs=[item(t, v) for t, v in e.top])
                            for e in entries]}

    def _chat_json(self, request_id: str, finals: list, n: int, k: Optional[int]) -> dict:
        return self._whole(request_id, "chat.completion", finals, n, [
            {"index": i, "message": {"role": "assistant", "content": c.text},
             "logprobs": self._chat_logprobs(c.logprobs) if k is not None else None,
             "finish_reason": FINISH[c.finish_reason]} for i, c in enumerate(finals)])

    def _completion_chunks(self):
        """The shape of one stream's completion chunks. A chunk's logprobs are its
        tokens' (as OpenAI streams them), their text offsets counted over its choice."""
        offsets: dict = {}

        def shape(request_id: str, index: int, ev, first: bool) -> dict:
            choice = {"index": index, "text": ev.text if isinstance(ev, Chunk) else "", "logprobs": None,
                      "finish_reason": None if isinstance(ev, Chunk) else FINISH[ev.finish_reason]}
            if isinstance(ev, Chunk) and ev.logprobs:
                choice["logprobs"] = lp = self._legacy_logprobs([(e.token, e.logprob, e.top) for e in ev.logprobs],
                                                                offsets.get(index, 0))
                offsets[index] = offsets.get(index, 0) + sum(len(t) for t in lp["tokens"])
            return {"id": request_id, "object": "text_completion", "created": int(time.time()),
                    "model": self.model_name, "choices": [choice]}
        return shape

    def _chat_chunk(self, request_id: str, index: int, ev, first: bool) -> dict:
        delta = {"role": "assistant"} if first else {}
        if isinstance(ev, Chunk):
            delta["content"] = ev.text
        choice = {"index": index, "delta": delta, "logprobs": None,
                  "finish_reason": None if isinstance(ev, Chunk) else FINISH[ev.finish_reason]}
        if isinstance(ev, Chunk) and ev.logprobs:
            choice["logprobs"] = self._chat_logprobs(ev.logprobs)
        return {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model_name, "choices": [choice]}

    def _sse(self, runs: list, request_id: str, n: int, usage: bool, shape) -> StreamingResponse:
        """Server-sent events, one choice per chunk, ending with `data: [DONE]` only
        when every choice finished. A choice's last chunk carries its finish_reason
        and its own fields (reproducibility, determinism, replay). With
        `stream_options.include_usage`, every chunk has `usage: null` and a last
        chunk with no choices has the usage (as OpenAI streams it). A request cut by
        the drain, an engine failure or an unexpected error ends with an error event
        instead (counted as the unary answer's status would be), so no client takes
        a cut answer for a whole one."""
        def error_event(r: Refusal) -> str:
            self.gateway.count(r, "http")
            return "data: " + json.dumps(error_body(r)) + "\n\n"

        async def stream():
            started, finals = set(), [None] * len(runs)
            try:
                async for index, ev in _merged(runs):
                    if not isinstance(ev, (Chunk, Completion)):
                        continue                      # Rollback: VERIFIED_ONLY streams send none
                    if isinstance(ev, Chunk) and not ev.text and not ev.token_ids:
                        continue
                    if isinstance(ev, Completion):
                        cut = self.gateway.cut_by_drain(ev)
                        if cut is not None:
                            yield error_event(cut)
                            return
                        finals[index] = ev
                    payload = shape(request_id, index, ev, index not in started)
                    started.add(index)
                    if isinstance(ev, Completion):
                        payload["system_fingerprint"] = ev.reproducibility.fingerprint()
                        payload.update(self._own(ev))
                    if usage:
                        payload["usage"] = None
                    yield f"data: {json.dumps(payload)}\n\n"
                if usage:
                    last = {"id": request_id, "object": payload["object"], "created": int(time.time()),
                            "model": self.model_name, "choices": [], "usage": _usage(finals, n)}
                    yield f"data: {json.dumps(last)}\n\n"
                yield "data: [DONE]\n\n"
            except EngineDead as e:
                yield error_event(refusals.from_engine(e, submitted=True))
            except Exception:
                log.exception("request %s (stream) failed", request_id)
                yield error_event(refusals.internal_error(request_id))
        return StreamingResponse(stream(), media_type="text/event-stream")


_END = object()


async def _merged(runs: list):
    """(choice index, event) from every choice's events, as they come. Leaving it
    (the stream done, or its client gone) closes every choice's events, which
    aborts the choices still decoding."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, events) -> None:
        try:
            async for ev in events:
                queue.put_nowait((index, ev))
        except Exception as e:                 # raised where the stream reads it
            queue.put_nowait((index, e))
        finally:
            queue.put_nowait((index, _END))

    tasks = [asyncio.ensure_future(pump(i, events)) for i, events in enumerate(runs)]
    try:
        left = len(tasks)
        while left:
            index, ev = await queue.get()
            if ev is _END:
                left -= 1
            elif isinstance(ev, Exception):
                raise ev
            else:
                yield index, ev
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for events in runs:
            await events.aclose()


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


def _usage(finals: list, n: int) -> dict:
    """The usage of a request's choices: each prompt's tokens once (its first
    choice's), every choice's output tokens."""
    firsts = finals[::n]
    prompt, cached = sum(c.prompt_tokens for c in firsts), sum(c.cached_tokens for c in firsts)
    completion = sum(c.completion_tokens for c in finals)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}
