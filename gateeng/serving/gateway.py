"""The gateway both fronts share: the engine once it is loaded, whether the
server is draining, the bounds, the metrics and the tokenizer pool; and the one
path a request takes into the engine (`start`), with every refusal on it a
refusals.Refusal. The gRPC and HTTP fronts are peers over it: each reads its
own wire format, calls `start`, and writes its own answer. They run on two
event loops (HTTP has its own thread), so the gateway holds no loop-bound
state: `start` binds each request to the loop that calls it, and the rest is
set once (`engine`), a flag (`draining`) or thread-safe (metrics, the pool).
"""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Optional

from gateeng.config import ServerConfig
from gateeng.engine import aio
from gateeng.engine.engine import Engine
from gateeng.request import DeterminismParams, FinishReason, SamplingParams
from gateeng.serving import checks, refusals
from gateeng.serving.metrics import Metrics
from gateeng.serving.refusals import Kind, Refusal

# The response header (gRPC initial metadata, HTTP header) with the server's id
# for the request: unguessable, and the one the server's error logs name.
REQUEST_ID_HEADER = "gateeng-request-id"


def model_name(source: str) -> str:
    """A model's name from where it was loaded: a .gguf file's stem, else the
    directory's name. Clients see this, never the path (it names the server's
    directories); --served-model-name replaces it (Gateway.model_name)."""
    path = Path(source)
    return path.stem if path.suffix == ".gguf" else path.name


class Gateway:
    def __init__(self, settings: ServerConfig, metrics: Metrics):
        self.settings, self.bounds, self.metrics = settings, settings.bounds, metrics
        self.engine: Optional[Engine] = None   # set once the model is loaded and checked
        self.draining = False
        # Tokenizing a long prompt must not stall the event loop.
        self.tokenize_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="gateeng-tokenize")

    def unavailable(self) -> Optional[str]:
        """Why no request can be served now, or None."""
        if self.engine is None:
            return "the model is still loading; retry shortly"
        if self.engine.failure is not None:
            return "the engine stopped on an error and the server is restarting; retry on another replica"
        if self.draining:
            return "the server is shutting down; retry on another replica"
        return None

    def model_name(self, engine: Optional[Engine] = None) -> Optional[str]:
        """The model's name as both fronts and the metrics show it: --served-model-name,
        else model_name(source) of `engine` (by default the gateway's); None while the
        model loads and none is set."""
        if self.settings.served_model_name:
            return self.settings.served_model_name
        engine = engine or self.engine
        return None if engine is None else model_name(engine.loaded.source)

    def ready_engine(self) -> Engine:
        """The engine, or a Refusal (UNAVAILABLE, with a retry hint) saying why there
        is none to serve."""
        reason = self.unavailable()
        if reason is not None:
            raise Refusal(Kind.UNAVAILABLE, reason, retry_after_s=refusals.RETRY_AFTER_S)
        return self.engine

    def prompt_bytes(self) -> int:
        """--max-prompt-bytes, or its default for this engine's context."""
        return self.settings.prompt_bytes(self.ready_engine().max_model_len)

    async def start(self, prompt, sampling: SamplingParams, determinism: DeterminismParams, request_id: str,
                    chat: bool = False) -> AsyncIterator:
        """Submit one request (tokenizing it on the pool) and return its event
        iterator: Chunk / Rollback events, then the Completion. Closing the iterator
        before the end aborts the request, and so does cancelling this call, even
        while the pool is still submitting it (aio.stream_request). Refusals raise
        before it is returned.
        The prompt's size is checked here, before tokenizing, for both fronts."""
        engine = self.ready_engine()
        try:
            checks.prompt_size(prompt, self.settings.prompt_bytes(engine.max_model_len), engine.max_model_len)
        except checks.BadRequest as exc:
            raise refusals.from_engine(exc) from None
        stream = aio.stream_request(engine, self.tokenize_pool, prompt, sampling, determinism, request_id, chat)
        try:
            await stream.__anext__()   # Submitted
        except Exception as exc:
            raise refusals.from_engine(exc) from None
        self.metrics.count_overrides(determinism)
        return stream

    async def encode(self, prompt, chat: bool = False) -> list:
        """A prompt's token ids as a request would have them, its size checked first
        and the tokenizing done on the pool (as `start` does)."""
        engine = self.ready_engine()
        try:
            checks.prompt_size(prompt, self.settings.prompt_bytes(engine.max_model_len), engine.max_model_len)
        except checks.BadRequest as exc:
            raise refusals.from_engine(exc) from None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, engine.encode, prompt, chat)

    def cut_by_drain(self, completion) -> Optional[Refusal]:
        """A request aborted because the server is shutting down is refused, not
        answered as finished: its client should retry it elsewhere."""
        if completion.finish_reason is FinishReason.ABORT and self.draining:
            return Refusal(Kind.UNAVAILABLE, "the server shut down before the request finished; retry it on "
                                             "another replica", retry_after_s=refusals.RETRY_AFTER_S)
        return None

    def count(self, refusal: Refusal, front: str) -> None:
        """A refusal in gateeng_rpc_errors_total: labelled by its gRPC status name on
        the gRPC front ("grpc"), by HTTP_<status> on the HTTP front ("http")."""
        kind = refusal.kind
        self.metrics.count_error(kind.grpc_code.name if front == "grpc" else f"HTTP_{kind.http_status}")

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False)
