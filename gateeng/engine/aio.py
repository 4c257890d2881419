"""Engine requests as asyncio iterators, for the servers on the event loop.

The engine's step loop runs on its own thread; a request's events reach the
loop through call_soon_threadsafe, never blocking it. Tokenizing (inside
`Engine.submit`) runs on a small thread pool so a long prompt cannot stall the
loop either. Leaving the iterator early (a client gone, a deadline passed)
aborts the request, which frees its KV blocks.
"""
from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import AsyncIterator

from gateeng.engine.errors import EngineDead
from gateeng.outputs import Completion


class Submitted:
    """The first item of `stream_request`: the request is queued under this id."""

    def __init__(self, request_id: str):
        self.request_id = request_id


async def stream_request(engine, pool: Executor, prompt, sampling, determinism, request_id: str,
                         chat: bool = False) -> AsyncIterator:
    """`engine`: an Engine (client.py), whose submit and abort this calls.
    Yields Submitted, then Chunk / Rollback events, then the Completion. Raises
    what `Engine.submit` raises (ValueError, QueueFull, DeterminismUnavailable,
    EngineDead) before anything is yielded, and EngineDead if the loop dies."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    handle = await loop.run_in_executor(pool, lambda: engine.submit(
        prompt, sampling, determinism, request_id, chat=chat,
        sink=lambda ev: loop.call_soon_threadsafe(events.put_nowait, ev)))
    try:
        yield Submitted(handle.request_id)
        while True:
            ev = await events.get()
            if isinstance(ev, Exception):
                raise EngineDead(f"engine failure: {ev}") from ev
            yield ev
            if isinstance(ev, Completion):
                return
    finally:
        if not handle.done.is_set():
            engine.abort(handle.request_id)
