"""Where a request goes: the least-loaded replica, unless one holds the request's
prompt prefix in its KV cache and is not much busier.

Pure (no Ray, no torch): the fleet tells it which replicas serve and what each runs,
and it answers with a replica's name. A prompt's prefix is keyed by chained hashes
of its whole blocks of `block_size` tokens, as the engines' prefix caches key their
blocks, so two prompts share a key exactly where their caches would share blocks.
The map from keys to the replica that last ran them is bounded (least recently used
keys go first): it is a hint, and a stale hint costs only a cache miss.

The choices of an `n` request are requests of their own with one prompt: affinity
keeps them on one replica (the prompt is prefilled once) until that replica is
`slack` requests busier than the least-loaded one; then they spread.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional, Sequence


class Router:
    def __init__(self, block_size: int = 16, slack: int = 4, max_keys: int = 1 << 16):
        self.block_size, self.slack, self.max_keys = block_size, slack, max_keys
        self.load: dict[str, int] = {}          # requests in flight, by replica
        self._owner: "OrderedDict[int, str]" = OrderedDict()   # prefix key -> replica that ran it last

    def keys(self, ids: Sequence[int]) -> list:
        """The chained keys of the whole blocks of `ids`, shortest prefix first."""
        out, key = [], 0
        for start in range(0, len(ids) - len(ids) % self.block_size, self.block_size):
            key = hash((key, tuple(ids[start:start + self.block_size])))
            out.append(key)
        return out

    def choose(self, ids: Sequence[int], serving: Iterable[str]) -> Optional[str]:
        """The replica for a prompt of `ids` among `serving` (None if none serves)."""
        serving = sorted(serving)
        if not serving:
            return None
        least = min(serving, key=lambda r: (self.load.get(r, 0), r))
        keys = self.keys(ids)
        for key in reversed(keys):   # the longest cached prefix first
            owner = self._owner.get(key)
            if owner in serving:
                if self.load.get(owner, 0) <= self.load.get(least, 0) + self.slack:
                    least = owner
                break
        return least

    def started(self, replica: str, ids: Sequence[int]) -> None:
        """A request of `ids` runs on `replica` from now on."""
        self.load[replica] = self.load.get(replica, 0) + 1
        for key in self.keys(ids):
            self._owner[key] = replica
            self._owner.move_to_end(key)
        while len(self._owner) > self.max_keys:
            self._owner.popitem(last=False)

    def ended(self, replica: str) -> None:
        self.load[replica] = max(0, self.load.get(replica, 0) - 1)

    def forget(self, replica: str) -> None:
        """`replica` restarted: its cache is empty, so its keys are stale."""
        for key in [k for k, r in self._owner.items() if r == replica]:
            del self._owner[key]
