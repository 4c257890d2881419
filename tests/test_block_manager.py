import pytest

from gateeng.engine.block_manager import BlockManager


@pytest.fixture
def bm():
    m = BlockManager(num_blocks=8, block_size=4)
    yield m
    m.check_integrity()


def test_allocate_release_counts(bm):
    ids = [bm.allocate() for _ in range(8)]
    assert bm.num_free == 0 and len(set(ids)) == 8
    with pytest.raises(RuntimeError):
        bm.allocate()
    bm.release_all(ids)
    assert bm.num_free == 8


def test_prefix_hit_shares_blocks_and_respects_canonical(bm):
    tokens = list(range(10))
    table = [bm.allocate() for _ in range(3)]
    bm.register(table, tokens, 0, 2, canonical=False)
    # OFF may reuse fast blocks; VERIFIED may not.
    assert bm.match_prefix(tokens, 2, canonical_only=True) == []
    hit = bm.match_prefix(tokens, 2, canonical_only=False)
    assert hit == table[:2]
    assert bm.blocks[table[0]].ref_count == 2
    bm.release_all(hit)
    bm.release_all(table)


def test_canonical_blocks_serve_everyone_and_survive_free(bm):
    tokens = list(range(8))
    table = [bm.allocate() for _ in range(2)]
    bm.register(table, tokens, 0, 2, canonical=True)
    bm.release_all(list(table))                 # freed but still cached
    assert bm.num_free == 8
    hit = bm.match_prefix(tokens, 2, canonical_only=True)
    assert sorted(hit) == sorted(table) and bm.num_free == 6
    bm.release_all(hit)


def test_reallocation_evicts_cache_entry(bm):
    tokens = list(range(4))
    t = [bm.allocate()]
    bm.register(t, tokens, 0, 1, canonical=True)
    bm.release_all(t)
    others = [bm.allocate() for _ in range(8)]   # reuses the cached block too
    assert bm.match_prefix(tokens, 1, canonical_only=False) == []
    bm.release_all(others)


def test_prefix_chain_differs_after_divergence(bm):
    a, b = list(range(8)), list(range(4)) + [9, 9, 9, 9]
    ta = [bm.allocate() for _ in range(2)]
    bm.register(ta, a, 0, 2, canonical=True)
    hit = bm.match_prefix(b, 2, canonical_only=True)
    assert hit == ta[:1]
    bm.release_all(hit)
    bm.release_all(ta)


def test_truncate_frees_tail(bm):
    t = [bm.allocate() for _ in range(4)]
    bm.truncate(t, 5)                            # 5 tokens need 2 blocks of 4
    assert len(t) == 2 and bm.num_free == 6
    bm.release_all(t)
