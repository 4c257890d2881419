"""Engine requests as asyncio iterators, for the servers on the event loop.

The engine's step loop runs on its own thread; a request's events reach the
loop through call_soon_threadsafe, never blocking it. Tokenizing (inside
`Engine.submit`) runs on a small thread pool so a long prompt cannot stall the
loop either. Leaving the iterator early (a client gone, a deadline passed)
aborts the request, which frees its KV blocks: at any moment, including while
the pool is still inside `Engine.submit` (see `_Submission`).
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import AsyncIterator

from gateeng.engine.errors import EngineDead
from gateeng.outputs import Completion


class Submitted:
    """The first item of `stream_request`: the request is queued under this id."""

    def __init__(self, request_id: str):
        self.request_id = request_id


class _Submission:
    """One `Engine.submit` on the pool, and the abort owed if the coroutine that
    awaits it leaves first. Cancelling the awaiting coroutine cannot stop a submit
    the pool thread has already begun: it completes later, on that thread, and
    would leave a request decoding for nobody. So whichever of `run` (the pool
    thread, once submit returns) and `leave` (the coroutine, when it goes) comes
    second aborts the request; the lock orders the two, so exactly one of them
    sees the other's mark and the abort happens once."""

    def __init__(self, engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._left = False
        self._handle = None

    def run(self, submit):
        """On the pool thread. Skips the submit if the coroutine has already left."""
        with self._lock:
            if self._left:
                return None
        handle = submit()
        with self._lock:
            self._handle, left = handle, self._left
        if left:
            self.engine.abort(handle.request_id)
        return handle

    def leave(self) -> None:
        """On the loop, when the iterator ends by any path: aborts the request
        unless it finished (or was never queued)."""
        with self._lock:
            self._left, handle = True, self._handle
        if handle is not None and not handle.done.is_set():
            self.engine.abort(handle.request_id)


async def stream_request(engine, pool: Executor, prompt, sampling, determinism, request_id: str,
                         chat: bool = False) -> AsyncIterator:
    """`engine`: an Engine (engine.py), whose submit and abort this calls.
    Yields Submitted, then Chunk / Rollback events, then the Completion. Raises
    what `Engine.submit` raises (ValueError, QueueFull, DeterminismUnavailable,
    EngineDead) before anything is yielded, and EngineDead if the loop dies.
    Cancelled or closed at any point, before or during the submit included, it
    leaves no request in the engine."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def sink(ev) -> None:
        # On the engine thread, which must not raise: a loop that has closed has
        # nobody left to read the event.
        try:
            loop.call_soon_threadsafe(events.put_nowait, ev)
        except RuntimeError:
            pass

    submission = _Submission(engine)
    try:
        handle = await loop.run_in_executor(pool, submission.run, lambda: engine.submit(
            prompt, sampling, determinism, request_id, chat=chat, sink=sink))
        yield Submitted(handle.request_id)
        while True:
            ev = await events.get()
            if isinstance(ev, Exception):
                raise EngineDead(f"engine failure: {ev}") from ev
            yield ev
            if isinstance(ev, Completion):
                return
    finally:
        submission.leave()
