"""The output side of the engine: request state in, stream events out.

After each step the engine hands every scheduled request and its RequestHandle
to `emit`; a finished request goes to `finish`, which returns the Completion.
What a caller may see is bounded by `Request.emit_limit()` (verified tokens, or
EAGER ones). The text is the handle's own IncrementalText (RequestHandle.text,
which the stop checker shares), following the request's tokens and its log of
cuts (Request.cuts), so the cost per step is the number of new tokens, not the
length of the output.

Invariants:
  - the Chunks of a request, minus what its Rollbacks withdraw, add up to the
    Completion's token ids and text;
  - text that could be the start of a stop string is held back until the match
    is decided, so a stop string never reaches the client.
"""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from gateeng.engine.detokenizer import IncrementalText
from gateeng.outputs import Chunk, Completion, Rollback
from gateeng.request import Request


@dataclass
class RequestHandle:
    """A caller's end of one request: its events, in order, ending with the Completion.
    Events go to `sink` when one is given (an event loop's queue), else to `events`.
    `text` is the output's text, decoded incrementally; the engine makes it at
    registration."""
    request_id: str
    text: IncrementalText
    sink: Optional[Callable] = None
    events: "queue.SimpleQueue" = field(default_factory=queue.SimpleQueue)
    sent_ids: list = field(default_factory=list)
    sent_text_len: int = 0
    last_emit: float = 0.0
    completion: Optional[Completion] = None
    done: threading.Event = field(default_factory=threading.Event)
    failure: Optional[BaseException] = None   # why the engine ended the request unfinished

    def put(self, ev) -> None:
        (self.sink or self.events.put)(ev)

    def __iter__(self):
        """Blocking iterator over Chunk / Rollback events, ending with the Completion
        (or an exception if the engine failed)."""
        while True:
            ev = self.events.get()
            yield ev
            if isinstance(ev, (Completion, Exception)):
                return

    def result(self, timeout: Optional[float] = None) -> Completion:
        if not self.done.wait(timeout):
            raise TimeoutError(f"request {self.request_id} did not finish in {timeout}s")
        if self.completion is None:
            raise RuntimeError(f"request {self.request_id} failed: the engine stopped"
                               + (f": {self.failure}" if self.failure is not None else ""))
        return self.completion


class OutputProcessor:
    def __init__(self, observer, reproducibility):
        self.observer = observer          # the engine replaces it through set_observer
        self.reproducibility = reproducibility

    def emit(self, req: Request, h: RequestHandle) -> None:
        """Send what the request may show now and the client has not seen."""
        self._send(req, h, final=False)

    def finish(self, req: Request, h: RequestHandle) -> Completion:
        self._send(req, h, final=True)
        text = h.text.final(len(req.output_ids))
        if req.stop_text_len is not None:
            text = text[:req.stop_text_len]
        return Completion(req.request_id, list(req.output_ids), text, req.finish_reason, req.num_prompt,
                          req.num_cached_tokens, req.mode, req.tau,
                          dataclasses.replace(req.params, seed=req.seed if not req.params.greedy else None),
                          req.stats.snapshot(),
                          self.reproducibility, list(req.logprobs), list(req.prompt_logprobs),
                          list(req.prompt_ids), req.finish_detail)

    def _send(self, req: Request, h: RequestHandle, final: bool) -> None:
        text = h.text
        num_out = len(req.tokens) - req.num_prompt
        limit = num_out if final else min(req.emit_limit(), num_out)
        text.sync(req.tokens, limit, offset=req.num_prompt, cuts=req.cuts)
        low = text.take_low_water()
        keep = limit if low is None else min(low, limit)   # sent tokens known to stand
        if keep < len(h.sent_ids):
            self._rollback(req, h, keep, limit)
        new = req.tokens[req.num_prompt + len(h.sent_ids):req.num_prompt + limit]
        if final:
            shown = text.final(limit)
            if req.stop_text_len is not None:
                shown = shown[:req.stop_text_len]
            end = len(shown)
        else:
            shown, end = text.text, text.text_len(limit)
            if req.params.stop:     # hold back a possible stop-string start
                end = max(h.sent_text_len, end - max(len(s) for s in req.params.stop) + 1)
            if req.stop_text_len is not None:
                end = min(end, max(h.sent_text_len, req.stop_text_len))
        delta = shown[h.sent_text_len:end]
        if not new and not delta:
            return
        if new:
            now = time.monotonic()
            if not h.sent_ids and req.first_token_time is None:
                req.first_token_time = now
                self.observer.on_first_token(req.mode, now - req.arrival)
            else:
                self.observer.on_tokens(req.mode, len(new), (now - h.last_emit) / len(new))
            h.last_emit = now
        # The final call may carry only text held back for an unfinished character
        # or a possible stop string, so the chunks always add up to the completion.
        lps = req.logprobs[len(h.sent_ids):len(h.sent_ids) + len(new)] if req.params.logprobs is not None else []
        # The weights served now computed these tokens: a swap happens between steps and
        # ends every request whose answer holds anything the old weights computed.
        version = self.reproducibility.weight_version if self.reproducibility is not None else 0
        h.put(Chunk(list(new), delta, len(h.sent_ids), lps, version))
        h.sent_ids.extend(new)
        h.sent_text_len = max(h.sent_text_len, end)

    def _rollback(self, req: Request, h: RequestHandle, keep: int, limit: int) -> None:
        """Withdraw the sent tokens from the first one past `keep` that changed or is
        past the emit limit."""
        common = keep
        while common < min(len(h.sent_ids), limit) and h.sent_ids[common] == req.tokens[req.num_prompt + common]:
            common += 1
        if common >= len(h.sent_ids):
            return
        h.put(Rollback(common))
        del h.sent_ids[common:]
        h.sent_text_len = min(h.sent_text_len, h.text.text_len(common))
        req.stats.retractions += 1
        self.observer.on_retraction(req.mode)
