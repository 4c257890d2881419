"""Paged KV block bookkeeping (pure Python, no torch).

Blocks have ref counts. Free blocks sit in an LRU ordered set; a free block keeps
its prefix-cache entry until it is reallocated, so a finished request's blocks can
still be hit. The prefix cache keys full blocks by a chained hash of their tokens
and by whether the KV was written by the invariant plan (`canonical`): VERIFIED
requests may only reuse canonical blocks, everyone else may reuse either.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional


def chain_hash(parent: Optional[int], tokens) -> int:
    # Python's int/tuple hash is deterministic across processes (no hash seed for ints).
    return hash((parent if parent is not None else -1, tuple(tokens)))


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    key: Optional[tuple] = None      # (hash, canonical) while registered
    tokens: Optional[tuple] = None   # kept to rule out hash collisions


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cache: dict[tuple, int] = {}

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        if not self.free:
            raise RuntimeError("no free KV blocks")
        block_id, _ = self.free.popitem(last=False)   # least recently freed first
        blk = self.blocks[block_id]
        self._unregister(blk)
        blk.ref_count = 1
        return block_id

    def release(self, block_id: int) -> None:
        blk = self.blocks[block_id]
        assert blk.ref_count > 0, f"double free of block {block_id}"
        blk.ref_count -= 1
        if blk.ref_count == 0:
            self.free[block_id] = None

    def release_all(self, block_table: list) -> None:
        # Free tail first so the head (shared prefixes) stays cached longest.
        for block_id in reversed(block_table):
            self.release(block_id)
        block_table.clear()

    def truncate(self, block_table: list, num_tokens: int) -> None:
        """Drop blocks beyond what `num_tokens` positions need (rollback)."""
        keep = self.blocks_needed(num_tokens)
        while len(block_table) > keep:
            self.release(block_table.pop())

    def match_prefix(self, tokens: list, max_blocks: int, canonical_only: bool) -> list:
        """Longest run of cached full blocks for `tokens`; takes a reference on each."""
        if not self.enable_prefix_caching:
            return []
        bs, parent, found = self.block_size, None, []
        for i in range(max_blocks):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk)
            block_id = self.cache.get((h, True))
            if block_id is None and not canonical_only:
                block_id = self.cache.get((h, False))
            if block_id is None or self.blocks[block_id].tokens != chunk:
                break
            found.append(block_id)
            parent = h
        for block_id in found:
            blk = self.blocks[block_id]
            if blk.ref_count == 0:
                del self.free[block_id]
            blk.ref_count += 1
        return found

    def register(self, block_table: list, tokens: list, first: int, upto: int, canonical: bool) -> None:
        """Enter full blocks [first, upto) of a block table into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        parent = None
        for i in range(upto):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk)
            parent = h
            if i < first:
                continue
            blk = self.blocks[block_table[i]]
            if blk.key is not None:
                continue   # already cached (e.g. it came from the cache)
            key = (h, canonical)
            if key in self.cache:
                continue   # an equivalent block is cached; keep the older one
            blk.key, blk.tokens = key, chunk
            self.cache[key] = blk.block_id

    def drop_prefix_cache(self) -> None:
        """Forget every cached block (new weights: no KV written before is reusable)."""
        for blk in self.blocks:
            self._unregister(blk)

    def _unregister(self, blk: Block) -> None:
        if blk.key is not None:
            del self.cache[blk.key]
            blk.key, blk.tokens = None, None

    def check_integrity(self) -> None:
        used = sum(1 for b in self.blocks if b.ref_count > 0)
        assert used + self.num_free == self.num_blocks, (used, self.num_free, self.num_blocks)
        for b in self.blocks:
            assert b.ref_count >= 0
            assert (b.ref_count == 0) == (b.block_id in self.free), b
        for key, block_id in self.cache.items():
            assert self.blocks[block_id].key == key
