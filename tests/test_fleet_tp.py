"""`gateeng fleet --tensor-parallel-size 2` on a two-node Ray cluster on loopback
(ray.cluster_utils.Cluster, every node on 127.0.0.1): one replica whose two ranks are
Ray actors on the two nodes (a STRICT_SPREAD placement group), each reading only its
own shard of the model, joined in one gloo group. Its VERIFIED answers are one
single-process server's at tensor-parallel size 1, bit for bit, and no rank's peak
memory reaches the model's bytes."""
import os

# Ray's test cluster keeps every node on 127.0.0.1 only with this set before Ray loads.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import struct  # noqa: E402

import pytest

from gateeng.config import EngineConfig, ServerConfig
from gateeng.model import loader
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.grpc_client import Client
from test_fleet import FleetRunning, cluster  # noqa: F401  (the module's two-node cluster)
from test_server_async import Running
from test_shard_read import _write_big
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


def test_tensor_parallel_ranks_on_two_nodes_give_one_servers_verified_bits_and_never_hold_the_model(
        tmp_path, cluster):
    # 1.3 GB: a rank process's own memory (a Ray worker's, torch's, the engine's: about
    # 400 MB) and its half stay below the model's bytes only if it holds no more than its half.
    model_bytes = _write_big(tmp_path, layers=32)
    save_family("llama", tmp_path / "tok")   # its byte-level tokenizer (256 ids, as the model's)
    for f in (tmp_path / "tok").glob("*token*"):
        (tmp_path / f.name).write_bytes(f.read_bytes())
    one = Running(config(tmp_path, 1), loaded=loader.load(str(tmp_path), "bfloat16"),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=None))
    try:
        want = ask(one.target)
    finally:
        one.stop()
    running = FleetRunning(config(tmp_path, 2), cluster.address, replicas=1)
    try:
        got = ask(running.target)
        assert [a for a, _ in got] == [a for a, _ in want]
        assert {r for _, r in want} == {(want[0][1][0], 1)} and {r for _, r in got} == {(want[0][1][0], 2)}
        fleet = running.fleet
        # the two ranks on the two nodes
        table = ray.util.placement_group_table(fleet.group)
        assert table["strategy"] == "STRICT_SPREAD" and len(set(table["bundles_to_node_id"].values())) == 2
        (actor,) = fleet.actors.values()
        peaks = ray.get(actor.peak_rss.remote())
        assert len(peaks) == 2 and max(peaks) < model_bytes, (peaks, model_bytes)
    finally:
        assert running.stop() == 0
