"""Finish conditions, checked on one token at a time in output order."""
from __future__ import annotations

from typing import Callable, Optional

from gateeng.request import FinishReason, Request


class StopChecker:
    def __init__(self, eos_token_ids, max_model_len: int, decode: Optional[Callable] = None):
        self.eos = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.decode = decode   # token ids -> text; needed only for stop strings

    def check(self, req: Request, index: int) -> tuple[Optional[FinishReason], Optional[int]]:
        """Would the request finish at token `index` (an index into req.tokens)?

        Returns (reason, text_cut) where text_cut is where a stop string starts in
        the output text.
        """
        p = req.params
        token = req.tokens[index]
        num_out = index - req.num_prompt + 1
        if not p.ignore_eos and token in self.eos:
            return FinishReason.EOS, None
        if token in p.stop_token_ids:
            return FinishReason.STOP, None
        if p.stop and self.decode is not None:
            text = self.decode(req.tokens[req.num_prompt:index + 1])
            # Only a match that ends in the newest token's text is new.
            window = max(len(s) for s in p.stop) + 16
            start = max(0, len(text) - window)
            for s in p.stop:
                pos = text.find(s, start)
                if pos >= 0:
                    return FinishReason.STOP, pos
        if num_out >= p.max_tokens or index + 1 >= self.max_model_len:
            return FinishReason.LENGTH, None
        return None, None
