"""Finish conditions, checked on one token at a time in output order."""
from __future__ import annotations

from typing import Callable, Optional

from gateeng.engine.detokenizer import IncrementalText
from gateeng.request import FinishReason, Request


class StopChecker:
    def __init__(self, eos_token_ids, max_model_len: int,
                 text_of: Callable[[str], Optional[IncrementalText]] = lambda request_id: None):
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        # A request's output text by request id: the output side's (RequestHandle.text);
        # None where no tokenizer is attached (pure bookkeeping tests), so stop
        # strings are not matched there.
        self.text_of = text_of

    def check(self, req: Request, index: int) -> tuple[Optional[FinishReason], Optional[int]]:
        """Would the request finish at token `index` (an index into req.tokens)?

        Returns (reason, text_cut) where text_cut is where a stop string starts in
        the output text. Stop strings are matched on the request's incremental
        text (`text_of`): only text that token `index` added is searched, so the
        cost per token does not grow with the output.
        """
        p = req.params
        token = req.tokens[index]
        num_out = index - req.num_prompt + 1
        if not p.ignore_eos and token in self.eos:
            return FinishReason.EOS, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, None
        if p.stop and (text := self.text_of(req.request_id)) is not None:
            cut = self._stop_string(req, text, num_out)
            if cut is not None:
                return FinishReason.STOP, cut
        if num_out >= p.max_tokens or index + 1 >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    @staticmethod
    def _stop_string(req: Request, text: IncrementalText, num_out: int) -> Optional[int]:
        """Start of the earliest stop string that ends in the text token num_out - 1
        added, or None."""
        text.sync(req.tokens, num_out, offset=req.num_prompt, cuts=req.cuts)
        old, new = text.text_len(num_out - 1), text.text_len(num_out)
        if new == old:
            return None
        hits = [pos for s in req.params.stop
                if (pos := text.text.find(s, max(0, old - len(s) + 1), new)) >= 0]
        return min(hits) if hits else None
