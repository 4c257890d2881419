"""The fleet's router (pure): least loaded, prefix affinity within the slack, whole
blocks only, and a restarted replica's keys forgotten."""
from gateeng.fleet.router import Router

A, B = "replica-0", "replica-1"
PROMPT = list(range(40))


def test_least_loaded_without_a_cached_prefix():
    r = Router(block_size=4)
    r.started(A, [1, 2, 3, 4])
    assert r.choose([9, 9, 9, 9], {A, B}) == B
    r.started(B, [9, 9, 9, 9])
    r.started(B, [8, 8, 8, 8])
    assert r.choose([7, 7, 7, 7], {A, B}) == A
    assert r.choose([7, 7, 7, 7], set()) is None


def test_a_shared_prefix_stays_where_it_is_cached_until_the_slack_is_used():
    r = Router(block_size=4, slack=2)
    r.started(A, PROMPT)
    assert r.choose(PROMPT[:20] + [1, 2, 3, 4], {A, B}) == A   # shares five whole blocks
    r.started(A, PROMPT)
    assert r.choose(PROMPT, {A, B}) == A        # 2 running there, 0 on B: within the slack
    r.started(A, PROMPT)
    assert r.choose(PROMPT, {A, B}) == B        # 3 > 0 + 2: the choices spread


def test_only_whole_blocks_key_a_prefix():
    r = Router(block_size=4)
    assert r.keys([1, 2, 3]) == []
    assert len(r.keys([1, 2, 3, 4, 5])) == 1
    assert r.keys([1, 2, 3, 4, 5, 6, 7, 8])[0] == r.keys([1, 2, 3, 4, 0, 0, 0, 0])[0]
    assert r.keys([1, 2, 3, 4, 5, 6, 7, 8])[1] != r.keys([0, 2, 3, 4, 5, 6, 7, 8])[1]


def test_a_forgotten_replica_loses_its_affinity_and_ended_requests_free_load():
    r = Router(block_size=4)
    r.started(B, PROMPT)
    r.started(A, [5, 5, 5, 5])
    assert r.choose(PROMPT, {A, B}) == B
    r.forget(B)
    r.ended(A)
    r.started(B, [6, 6, 6, 6])
    assert r.choose(PROMPT, {A, B}) == A
