"""Incremental detokenization: the text of a growing (and sometimes truncated)
token list at a bounded cost per token.

Each new token decodes only a short window: the tokens since the last point
where the text was complete (`prefix`), compared with the same window without
the newest tokens (`read`). The difference is the new text. Decoding a window
that starts at a token boundary keeps decoders that strip a leading space or
join byte tokens right, and holding text back while it ends in U+FFFD keeps a
multi-byte character split across tokens from showing up half-done.

Invariants:
  - the text after k tokens depends only on the first k tokens, so truncating
    to k restores exactly the state the object had after k appends;
  - `text` only ever grows by appending while tokens are appended, so the text
    after k tokens is a prefix of the text after k + 1;
  - `final(k)` adds whatever is still held back; it equals decoding the k tokens
    in one call for the tokenizers this engine loads (tested on the embedded
    model's).
"""
from __future__ import annotations

from typing import Callable, Sequence


class IncrementalText:
    def __init__(self, decode: Callable[[Sequence[int]], str]):
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        # After k tokens: (len(text), prefix, read). marks[0] is the empty state.
        self._marks: list[tuple[int, int, int]] = [(0, 0, 0)]
        # Lowest token count truncated to since the last `take_low_water()`.
        self._low_water: int | None = None
        self._cuts_seen = 0   # entries of the followed list's cut log already applied

    def __len__(self) -> int:
        return len(self.ids)

    def append(self, token: int) -> None:
        _, prefix, read = self._marks[-1]
        self.ids.append(token)
        before = self.decode(self.ids[prefix:read]) if read > prefix else ""
        after = self.decode(self.ids[prefix:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            prefix, read = read, len(self.ids)
        self._marks.append((len(self.text), prefix, read))

    def truncate(self, k: int) -> None:
        """Forget every token from index k on."""
        if k >= len(self.ids):
            return
        k = max(k, 0)
        del self.ids[k:]
        del self._marks[k + 1:]
        self.text = self.text[:self._marks[k][0]]
        self._low_water = k if self._low_water is None else min(self._low_water, k)

    def sync(self, tokens: Sequence[int], k: int, offset: int = 0, cuts: Sequence[int] = ()) -> None:
        """Make the state that of tokens[offset:offset + k]. Tokens cut from the list
        must be announced: through `truncate`, or in `cuts`, the list's log of the
        lengths it was cut back to (Request.cuts), whose new entries are applied
        first. As a guard, a changed last token costs one pass to find where the
        lists part."""
        if len(cuts) > self._cuts_seen:
            self.truncate(min(cuts[self._cuts_seen:]) - offset)
            self._cuts_seen = len(cuts)
        n = min(len(self.ids), k)
        if n and self.ids[n - 1] != tokens[offset + n - 1]:
            n = next(i for i in range(n) if self.ids[i] != tokens[offset + i])
        self.truncate(n)
        for i in range(len(self.ids), k):
            self.append(int(tokens[offset + i]))

    def text_len(self, k: int) -> int:
        """Length of the text shown for the first k tokens (held-back bytes excluded)."""
        return self._marks[k][0]

    def final(self, k: int) -> str:
        """The whole text of the first k tokens, held-back bytes included."""
        length, prefix, read = self._marks[k]
        ids = self.ids[:k]
        before = self.decode(ids[prefix:read]) if read > prefix else ""
        after = self.decode(ids[prefix:]) if k > prefix else ""
        return self.text[:length] + after[len(before):]

    def take_low_water(self) -> int | None:
        """The lowest token count truncated to since the last call (None: no cut)."""
        low, self._low_water = self._low_water, None
        return low
