"""`gateeng fleet --tensor-parallel-size 2` on a two-node Ray cluster on loopback
(ray.cluster_utils.Cluster, every node on 127.0.0.1): one replica whose two ranks are
Ray actors on the two nodes (a STRICT_SPREAD placement group), each reading only its
own shard of the model, joined in one gloo group. Its VERIFIED answers are one
single-process server's at tensor-parallel size 1, bit for bit, and no rank's peak
memory reaches the model's bytes; so are a tiny Qwen3-MoE's (each expert split, every
rank reading its experts' parts by byte ranges). On a tiny model: `gateeng update-weights` reaches
the replica's ranks (each reads its shard of the new checkpoint) and gives a size-1
server's fingerprint, weight_version and answers after the same update, and a broken
checkpoint changes nothing; a rank killed mid-stream fails its replica, every VERIFIED
stream still ends with one server's bits, and the replica comes back on the fleet's
weights."""
import os

# Ray's test cluster keeps every node on 127.0.0.1 only with this set before Ray loads.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import signal  # noqa: E402
import struct
import threading
import time

import pytest

from gateeng.config import EngineConfig, ServerConfig
from gateeng.model import loader
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from gateeng.tools import cli
from test_fleet import TOKEN, FleetRunning, replica_states
from test_fleet import cluster, model_dir, new_dir  # noqa: F401  (the module's two-node cluster, a tiny model)
from test_server_async import Running
from test_shard_read import _write_big
from test_tensor_parallel_weights import nan_in_rank_1s_rows
from test_weight_update import broken
from tiny import save_family

ray = pytest.importorskip("ray")
VERIFIED = DeterminismParams(Mode.VERIFIED)
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, temperature=0.8, seed=7)
ASKED = [([5, 17, 200, 3, 9], GREEDY), (list(range(40, 61)), SEEDED)]


@pytest.fixture(scope="module", autouse=True)
def reference_runs():
    if not reference_ops.runnable():
        pytest.skip("no build of the reference runs here")


def config(model_dir, tp: int) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=64, max_model_len=256, block_size=4,
                        max_num_batched_tokens=64, max_num_seqs=4, num_threads=1, verified_route="speculative",
                        tensor_parallel_size=tp)


def bits(x: float) -> str:
    return struct.pack("<d", x).hex()


def ask(target) -> list:
    """VERIFIED answers, greedy and seeded: (tokens and logprob bits, (the record's model
    fingerprint, tensor-parallel size)) each."""
    with Client(target) as c:
        done = [c.complete(p, params, VERIFIED) for p, params in ASKED]
    return [((list(r.token_ids), [(bits(lp.logprob), [(t.token_id, bits(t.logprob)) for t in lp.top])
                                  for lp in r.logprobs]),
             (r.reproducibility.model_fingerprint, r.reproducibility.tensor_parallel_size)) for r in done]


def single_answers(model_dir) -> list:
    """ask() of one `gateeng serve` at tensor-parallel size 1 on the model."""
    one = Running(config(model_dir, 1), loaded=loader.load(str(model_dir), "bfloat16"),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=None))
    try:
        return ask(one.target)
    finally:
        one.stop()


def same_bits(got: list, want: list) -> None:
    """A size-2 fleet's answers `got` are a size-1 server's `want`, bit for bit, under
    the same fingerprint; each record names its size."""
    assert [a for a, _ in got] == [a for a, _ in want]
    assert {r for _, r in want} == {(want[0][1][0], 1)} and {r for _, r in got} == {(want[0][1][0], 2)}


def test_tensor_parallel_ranks_on_two_nodes_give_one_servers_verified_bits_and_never_hold_the_model(
        tmp_path, cluster):
    # 1.3 GB: a rank process's own memory (a Ray worker's, torch's, the engine's: about
    # 400 MB) and its half stay below the model's bytes only if it holds no more than its half.
    model_bytes = _write_big(tmp_path, layers=32)
    save_family("llama", tmp_path / "tok")   # its byte-level tokenizer (256 ids, as the model's)
    for f in (tmp_path / "tok").glob("*token*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    want = single_answers(tmp_path)
    running = FleetRunning(config(tmp_path, 2), cluster.address, replicas=1)
    try:
        same_bits(ask(running.target), want)
        fleet = running.fleet
        # the two ranks on the two nodes
        table = ray.util.placement_group_table(fleet.group)
        assert table["strategy"] == "STRICT_SPREAD" and len(set(table["bundles_to_node_id"].values())) == 2
        (actor,) = fleet.actors.values()
        peaks = ray.get(actor.peak_rss.remote())
        assert len(peaks) == 2 and max(peaks) < model_bytes, (peaks, model_bytes)
    finally:
        assert running.stop() == 0


def test_a_mixture_of_experts_ranks_on_two_nodes_give_one_servers_verified_bits(tmp_path, cluster):
    save_family("qwen3_moe", tmp_path)
    want = single_answers(tmp_path)
    running = FleetRunning(config(tmp_path, 2), cluster.address, replicas=1)
    try:
        got = ask(running.target)
    finally:
        assert running.stop() == 0
    same_bits(got, want)


# ---- weights in place, and a rank's death, on a tiny model's fleet of one replica of two ranks ----------

@pytest.fixture(scope="module")
def tp_fleet(cluster, model_dir):
    running = FleetRunning(config(model_dir, 2), cluster.address, replicas=1)
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def single(model_dir):
    """One `gateeng serve` at tensor-parallel size 1 on the same model."""
    srv = Running(config(model_dir, 1), loaded=loader.load(str(model_dir), "bfloat16"),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=None))
    yield srv
    srv.stop()


def weights_of(fleet) -> list:
    return [(s.weight_version, s.fingerprint) for s in replica_states(fleet)]


def test_an_update_reaches_the_tensor_parallel_replicas_ranks_and_a_broken_one_changes_nothing(
        tp_fleet, single, new_dir, tmp_path, capsys):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    before, answered = weights_of(tp_fleet), ask(tp_fleet.target)

    def push(directory) -> int:
        return cli.main(["update-weights", "--server", tp_fleet.target, str(directory), "--admin-token-file",
                         str(token)])
    bad, _ = broken(tmp_path, new_dir, "nan")   # NaNs in rank 0's columns of a row-parallel weight only
    refused = "rank 0: model.layers.1.mlp.down_proj.weight: 5 of this rank's values are NaN"
    assert push(bad) == 2 and refused in capsys.readouterr().err
    bad, expect = nan_in_rank_1s_rows(tmp_path, new_dir)   # in rank 1's rows only: the Ray actor refuses
    assert push(bad) == 2 and expect in capsys.readouterr().err
    assert weights_of(tp_fleet) == before and ask(tp_fleet.target) == answered
    assert push(new_dir) == 0 and "weight_version 1" in capsys.readouterr().out
    done = single.server.gateway.engine.update_weights(new_dir)
    assert weights_of(tp_fleet) == [(1, done.model_fingerprint)] != before
    got, want = ask(tp_fleet.target), ask(single.target)
    assert [a for a, _ in got] == [a for a, _ in want] != [a for a, _ in answered]
    assert {r for _, r in got} == {(done.model_fingerprint, 2)}


def test_a_rank_killed_mid_stream_loses_no_verified_stream_and_its_replica_comes_back(tp_fleet, single):
    """SIGKILL the replica's rank 1 (a Ray actor on the other node) while VERIFIED streams
    run: the replica fails and exits with it, Ray restarts it with a new rank, it rejoins
    at the fleet's weights, and every stream completes with one server's bits."""
    params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0.7, seed=3)
    prompts = [[11 + i, 3, 90, 4 + i] for i in range(2)]
    with Client(single.target) as c:
        want = [list(c.complete(p, params, VERIFIED).token_ids) for p in prompts]
    fleet = tp_fleet.fleet
    (replica,) = fleet.actors.values()
    rank = ray.get(replica.__ray_call__.remote(lambda self: self.engine.core.tp_group.workers[0].actor))
    pid = ray.get(rank.__ray_call__.remote(lambda self: os.getpid()))
    received, finals = [[] for _ in prompts], [None] * len(prompts)

    def stream(i):
        with Client(tp_fleet.target) as c:
            for ev in c.generate(prompts[i], params, VERIFIED):
                if ev.HasField("chunk"):
                    received[i].extend(ev.chunk.token_ids)
                elif ev.HasField("complete"):
                    finals[i] = ev.complete
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while not all(received) and time.time() < deadline:
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    assert finals == [None] * len(prompts), "the kill came after a stream had ended"
    for t in threads:
        t.join(180)
    assert [list(f.token_ids) for f in finals] == want
    assert received == want   # nothing sent twice, nothing missing
    deadline = time.time() + 120
    while "replica-0" not in fleet.serving:
        assert time.time() < deadline, "the replica did not come back"
        time.sleep(0.2)
    assert weights_of(tp_fleet) == [(fleet.weight_version, fleet.record.model_fingerprint)]
    new_pid = ray.get(ray.get(replica.__ray_call__.remote(
        lambda self: self.engine.core.tp_group.workers[0].actor)).__ray_call__.remote(lambda self: os.getpid()))
    assert new_pid != pid
