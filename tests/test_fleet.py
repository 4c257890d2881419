"""`gateeng fleet` on a two-node Ray cluster on loopback (ray.cluster_utils.Cluster,
every node on 127.0.0.1), on a tiny bf16 model saved as a Hugging Face directory:
VERIFIED answers from both replicas equal one server's; an update reaches both
replicas and a broken one neither; requests that arrive while a push holds the
version barrier wait and are answered on the new weights, and past the hold's bound
are refused with a retry hint; a replica killed with
SIGKILL mid-stream loses no VERIFIED stream, each finishing with one server's bits;
health is NOT_SERVING while no replica answers and SERVING again once one does;
nothing started listens beyond loopback. One cluster, one fleet and one single server
serve the whole module."""
import os

# Ray's test cluster keeps every node on 127.0.0.1 only with this set before Ray loads.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"

import contextlib  # noqa: E402
import ipaddress
import json
import signal
import struct
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import grpc
import psutil
import pytest
import torch

from gateeng.config import EngineConfig, ServerConfig
from gateeng.fleet import fleet as fleet_module
from gateeng.model import loader
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from gateeng.serving.gateway import REQUEST_ID_HEADER
from gateeng.serving.grpc_client import Client
from gateeng.tools import cli
from test_server_async import NOT_SERVING, SERVING, Running, wait_for
from test_weight_update import broken
from tiny import hf_family, save_family

ray = pytest.importorskip("ray")
TOKEN = "fleet-t0ken"
VERIFIED = DeterminismParams(Mode.VERIFIED)
PROMPTS = [[5, 17, 200, 3, 9], list(range(40, 61)), [7] * 33]
GREEDY = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
SEEDED = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, temperature=0.8, seed=7)


@pytest.fixture(scope="module", autouse=True)
def reference_runs():
    if not reference_ops.runnable():
        pytest.skip("no build of the reference runs here")


def config(model_dir) -> EngineConfig:
    return EngineConfig(model=str(model_dir), dtype="bfloat16", num_kv_blocks=512, max_model_len=512, block_size=4,
                        max_num_batched_tokens=64, max_num_seqs=16, num_threads=1, verified_route="speculative")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    save_family("llama", path, tie=True)
    return path


@pytest.fixture(scope="module")
def new_dir(tmp_path_factory, model_dir):
    """Other weights for the same model (config.json and safetensors)."""
    path = tmp_path_factory.mktemp("new")
    hf = hf_family("llama", tie=True)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    hf.save_pretrained(path, safe_serialization=True)
    for f in model_dir.glob("*token*"):   # so one server can start on it too
        (path / f.name).write_bytes(f.read_bytes())
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """Two Ray nodes of one CPU each, both on 127.0.0.1. Without the autoscaler's monitor
    and the log monitor, which a fixed cluster of two nodes does not use (the workers'
    logs stay in Ray's session directory): the head starts in about two thirds of the
    time."""
    from ray.cluster_utils import Cluster
    small = dict(num_cpus=1, node_ip_address="127.0.0.1", object_store_memory=96 * 2 ** 20,
                 include_log_monitor=False)
    c = Cluster(initialize_head=True, head_node_args=dict(small, include_dashboard=False, no_monitor=True))
    c.add_node(**small)
    c.wait_for_nodes()
    ray.init(address=c.address, _node_ip_address="127.0.0.1")
    yield c
    ray.shutdown()
    c.shutdown()


class FleetRunning(Running):
    """`gateeng fleet` on its own thread and loop, over the test cluster."""

    def __init__(self, cfg, address, replicas=2):
        from gateeng.fleet import serve
        self.server = serve.fleet_server(cfg, ServerConfig(port=0, metrics_port=0, http_port=0), replicas, address,
                                         admin_token=TOKEN)
        self.exit_code, self.loop, self.credentials = None, None, None
        self.thread = threading.Thread(target=self._main, daemon=True)
        self.thread.start()
        deadline = time.time() + 300
        while self.server.gateway.engine is None:
            assert time.time() < deadline and self.thread.is_alive(), "fleet did not start"
            time.sleep(0.1)
        self.target = f"127.0.0.1:{self.server.port}"
        wait_for(self.target, SERVING)
        self.fleet = self.server.gateway.engine


@pytest.fixture(scope="module")
def fleet(cluster, model_dir):
    running = FleetRunning(config(model_dir), cluster.address)
    yield running
    assert running.stop() == 0


@pytest.fixture(scope="module")
def single(model_dir):
    """One `gateeng serve` on the same model: the answers the fleet must give."""
    srv = Running(config(model_dir), loaded=loader.load(str(model_dir), "bfloat16"),
                  settings=ServerConfig(port=0, metrics_port=None, http_port=None))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def first_answers(single):
    """One server's VERIFIED answers on the model's first weights (before any update)."""
    return answers(single.target)[0]


def bits(x: float) -> str:
    return struct.pack("<d", x).hex()


def answer(r) -> tuple:
    return (list(r.token_ids), [(bits(lp.logprob), [(t.token_id, bits(t.logprob)) for t in lp.top])
                                for lp in r.logprobs], r.reproducibility.model_fingerprint)


def answers(target, concurrent=True) -> tuple:
    """VERIFIED answers, greedy and seeded, each prompt twice at once (so both replicas
    take some): ({(params, prompt): answer}, the replicas and weight versions seen)."""
    jobs = [(i, j) for i in range(2) for j in range(len(PROMPTS))] * 2
    out, seen, lock = {}, set(), threading.Lock()

    def run(job):
        with Client(target) as c:
            r = c.complete(PROMPTS[job[1]], (GREEDY, SEEDED)[job[0]], VERIFIED)
        with lock:
            assert out.setdefault(job, answer(r)) == answer(r)
            seen.add((r.reproducibility.replica, r.reproducibility.weight_version))
    threads = [threading.Thread(target=run, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(out) == 2 * len(PROMPTS)
    return out, seen


def test_both_replicas_answer_as_one_server(fleet, first_answers):
    got, seen = answers(fleet.target)
    assert got == first_answers
    assert seen == {("replica-0", 0), ("replica-1", 0)}
    ray_nodes = {ray.get(a.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()))
                 for a in fleet.fleet.actors.values()}
    assert len(ray_nodes) == 2   # SPREAD: one replica on each node


def test_health_metrics_and_http_front(fleet):
    with Client(fleet.target) as c:
        assert c.server_info().self_check_passed and c.model_info().weight_version == fleet.fleet.weight_version
    http = f"http://127.0.0.1:{fleet.server.http.port}"
    body = json.dumps({"model": fleet.server.gateway.model_name(), "prompt": [5, 17, 200], "max_tokens": 4,
                       "determinism": {"mode": "verified"}}).encode()
    req = urllib.request.Request(http + "/v1/completions", body, {"Content-Type": "application/json"})
    out = json.loads(urllib.request.urlopen(req, timeout=60).read())
    assert out["reproducibility"]["replica"] in ("replica-0", "replica-1")
    text = urllib.request.urlopen(f"http://127.0.0.1:{fleet.server.metrics_port}/metrics", timeout=30).read().decode()
    for replica in ("replica-0", "replica-1"):
        assert f'replica="{replica}"' in text
    lines = [line for line in text.splitlines() if line.startswith("gateeng_request_success_total{")]
    assert any('replica="' in line for line in lines)
    assert text.count("# HELP gateeng_request_success_total ") <= 1 and "# TYPE gateeng_weight_version gauge" in text


def loopback(ip: str) -> bool:
    address = ipaddress.ip_address(ip.split("%")[0])
    return (getattr(address, "ipv4_mapped", None) or address).is_loopback


def test_nothing_listens_beyond_loopback(fleet):
    me = psutil.Process()
    procs = [me] + me.children(recursive=True)
    listening = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        listening += [(p.pid, p.name(), c.laddr) for c in conns if c.status == psutil.CONN_LISTEN]
    assert listening, "found no listening socket: the check looked at the wrong processes"
    assert [entry for entry in listening if not loopback(entry[2].ip)] == []
    ports = {entry[2].port for entry in listening}
    assert fleet.server.port in ports and fleet.server.http.port in ports


def replica_states(fleet) -> list:
    return [ray.get(a.state.remote()) for _, a in sorted(fleet.fleet.actors.items())]


def test_update_reaches_both_replicas_and_a_broken_one_neither(fleet, single, first_answers, new_dir, tmp_path,
                                                               capsys):
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    before = replica_states(fleet)
    bad, expect = broken(tmp_path, new_dir, "nan")
    assert cli.main(["update-weights", "--server", fleet.target, str(bad), "--admin-token-file", str(token)]) == 2
    assert "INVALID_ARGUMENT" in capsys.readouterr().err
    assert [(s.weight_version, s.fingerprint) for s in replica_states(fleet)] == \
        [(s.weight_version, s.fingerprint) for s in before]
    assert cli.main(["update-weights", "--server", fleet.target, str(new_dir), "--admin-token-file",
                     str(token)]) == 0
    assert "weight_version 1" in capsys.readouterr().out
    after = replica_states(fleet)
    assert [s.weight_version for s in after] == [1, 1]
    assert after[0].fingerprint == after[1].fingerprint != before[0].fingerprint
    got, seen = answers(fleet.target)
    assert seen == {("replica-0", 1), ("replica-1", 1)}
    # One server brought to the same weights in place (which answers as a fresh start
    # on them: test_weight_update) gives the fleet's answers.
    assert single.server.gateway.engine.update_weights(new_dir).model_fingerprint == after[0].fingerprint
    want, _ = answers(single.target)
    assert got == want and {a[2] for a in got.values()} == {after[0].fingerprint}


LONG = SamplingParams(max_tokens=480, ignore_eos=True)


@contextlib.contextmanager
def barrier_closed(fleet, directory):
    """A push of `directory` whose version barrier is closed when the block starts:
    long VERIFIED streams on both replicas hold the swap (each replica swaps once its
    running requests are done). Yields a dict: `held`, for each request the fleet
    takes from then on, whether the barrier was closed when it came; after the block,
    `update` (the push's result) and `finals` (the long streams' completions)."""
    f = fleet.fleet
    submit, out = f.submit, {"held": []}

    def watched(*args, **kwargs):   # the gateway's call
        out["held"].append(not f._open.is_set())
        return submit(*args, **kwargs)
    with Client(fleet.target) as c:
        streams = [c.generate(p, LONG, VERIFIED) for p in ([3, 1, 4], [2, 7, 1])]
        for s in streams:   # each has produced a token on the old weights
            assert next(s).HasField("chunk")
        push = threading.Thread(target=lambda: out.setdefault("update", f.update_weights(directory)))
        push.start()
        deadline = time.monotonic() + 60
        while f._open.is_set():   # staged on both replicas: the barrier closes
            assert push.is_alive() and time.monotonic() < deadline, "the barrier never closed"
            time.sleep(0.001)
        f.submit = watched
        try:
            yield out
        finally:
            del f.submit   # the class's own again
        push.join(60)
        out["finals"] = [[ev for ev in s if ev.HasField("complete")][0].complete for s in streams]
    # The streams that held the swap ended on the old weights: complete, or cut at
    # --weight-update-wait on a slow host.
    before = out["update"].weight_version - 1
    assert [final.reproducibility.weight_version for final in out["finals"]] == [before, before]
    assert out["update"].requests_ended == sum(len(final.token_ids) < LONG.max_tokens for final in out["finals"])


def test_requests_arriving_during_a_push_wait_and_are_answered_on_the_new_weights(fleet, first_answers,
                                                                                   model_dir):
    """Requests that come while the version barrier is closed wait at the front, then
    run on the new weights, never on the old, and answer as one server on those
    weights does."""
    before = fleet.fleet.weight_version
    with barrier_closed(fleet, model_dir) as push:
        got, seen = answers(fleet.target)
    assert any(push["held"]), "every request came after the push: none waited at the barrier"
    assert push["update"].weight_version == before + 1
    assert seen == {("replica-0", before + 1), ("replica-1", before + 1)}   # never the old version
    assert got == first_answers


def test_a_request_held_past_the_bound_is_refused_with_a_retry_hint(fleet, new_dir, monkeypatch):
    """The hold is bounded (--weight-update-wait plus HOLD_S): past it a request is
    refused RESOURCE_EXHAUSTED with a retry hint, never left waiting. The bound is
    set to nothing here, so a request that comes while the barrier is closed is
    refused at once."""
    monkeypatch.setattr(fleet_module, "HOLD_S", -fleet.fleet.config.weight_update_wait)
    with barrier_closed(fleet, new_dir) as push:
        with Client(fleet.target) as c, pytest.raises(grpc.RpcError) as refused:
            c.complete(PROMPTS[0], GREEDY, VERIFIED, timeout=30)
    assert push["held"] == [True]
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "swapping its weights" in refused.value.details()
    assert "grpc-retry-pushback-ms" in dict(refused.value.trailing_metadata())


def test_a_replica_killed_mid_stream_loses_no_verified_stream(fleet):
    """SIGKILL one replica while VERIFIED and OFF streams run on both: every VERIFIED
    stream ends with the tokens one server gives (the fleet's weights are the updated
    ones by now, so the reference is the fleet itself before the kill: VERIFIED bits
    repeat); an OFF stream the dead replica had sent tokens of ends with the error
    that says why, and every other OFF stream completes."""
    params = SamplingParams(max_tokens=300, ignore_eos=True, temperature=0.7, seed=3)
    prompts = [[11 + i, 3, 90, 4 + i] for i in range(6)]
    off = [[31 + i, 8, 60] for i in range(4)]
    with Client(fleet.target) as c, ThreadPoolExecutor(len(prompts)) as pool:   # at once: both replicas work
        want = list(pool.map(lambda p: list(c.complete(p, params, VERIFIED).token_ids), prompts))
    runs = [(p, VERIFIED) for p in prompts] + [(p, DeterminismParams(Mode.OFF)) for p in off]
    received = [[] for _ in runs]
    finals, errors, ids = [None] * len(runs), [None] * len(runs), [None] * len(runs)

    def stream(i):
        try:
            with Client(fleet.target) as c:
                call = c.generate(runs[i][0], params, runs[i][1])
                ids[i] = dict(call.initial_metadata())[REQUEST_ID_HEADER]
                for ev in call:
                    if ev.HasField("chunk"):
                        received[i].extend(ev.chunk.token_ids)
                    elif ev.HasField("complete"):
                        finals[i] = ev.complete
        except grpc.RpcError as exc:   # recorded: the assertions below name it
            errors[i] = exc
    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(runs))]
    # The OFF streams first, spread by load over both replicas; then the VERIFIED ones.
    for t in threads[len(prompts):]:
        t.start()
    deadline = time.time() + 60
    while not all(ids[len(prompts):]) and time.time() < deadline:
        time.sleep(0.005)
    for t in threads[:len(prompts)]:
        t.start()
    while not all(received) and time.time() < deadline:
        time.sleep(0.005)
    victim = "replica-0"
    actor = fleet.fleet.actors[victim]
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()))
    with fleet.fleet._lock:
        on_victim = {r.request_id: r.determinism.mode for r in fleet.fleet._requests.values()
                     if r.replica == victim and r.sent}
    os.kill(pid, signal.SIGKILL)
    for t in threads:
        t.join(180)
    verified = len(prompts)
    assert errors[:verified] == [None] * verified
    assert {Mode.VERIFIED, Mode.OFF} <= set(on_victim.values()), f"the kill came too late: {on_victim}"
    assert [list(f.token_ids) for f in finals[:verified]] == want
    assert received[:verified] == want   # the streamed tokens too: nothing sent twice, nothing missing
    assert {f.reproducibility.replica for f in finals[:verified]} <= {"replica-0", "replica-1"}
    for i in range(verified, len(runs)):
        if on_victim.get(ids[i]) is Mode.OFF:
            assert finals[i] is None and "cannot be resumed with the same bits" in errors[i].details()
        else:
            assert errors[i] is None and len(finals[i].token_ids) == params.max_tokens
    # Ray restarts the replica, and it serves again, on the fleet's weights.
    deadline = time.time() + 180
    while victim not in fleet.fleet.serving:
        assert time.time() < deadline, "the killed replica did not come back"
        time.sleep(0.2)
    assert ray.get(actor.state.remote()).weight_version == fleet.fleet.weight_version


def http_health(fleet) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{fleet.server.http.port}/health", timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_health_is_not_serving_while_no_replica_answers_and_serving_once_one_does(fleet, monkeypatch):
    """Both replicas stopped (SIGSTOP: they neither answer nor die): once the fleet
    stops hearing from them, gRPC health is NOT_SERVING and HTTP /health 503, as one
    server whose engine died reports, and a request is refused UNAVAILABLE; one
    replica answering again makes both SERVING again."""
    f = fleet.fleet
    monkeypatch.setattr(fleet_module, "STATE_TIMEOUT_S", 2.0)   # how long the watcher waits for an answer
    pids = {n: ray.get(a.__ray_call__.remote(lambda self: os.getpid())) for n, a in sorted(f.actors.items())}
    wait_for(fleet.target, SERVING)
    assert http_health(fleet) == 200
    stopped = set()
    try:
        for name, pid in pids.items():
            os.kill(pid, signal.SIGSTOP)
            stopped.add(name)
        wait_for(fleet.target, NOT_SERVING, timeout=60)
        assert http_health(fleet) == 503 and not f.serving
        with Client(fleet.target) as c, pytest.raises(grpc.RpcError) as refused:
            c.complete(PROMPTS[0], GREEDY, VERIFIED, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        os.kill(pids["replica-1"], signal.SIGCONT)
        stopped.discard("replica-1")
        wait_for(fleet.target, SERVING, timeout=60)
        assert http_health(fleet) == 200 and f.serving == {"replica-1"}
        with Client(fleet.target) as c:
            r = c.complete(PROMPTS[0], GREEDY, VERIFIED, timeout=60)
        assert (r.reproducibility.replica, r.reproducibility.weight_version) == ("replica-1", f.weight_version)
    finally:
        for name in stopped:
            os.kill(pids[name], signal.SIGCONT)
    deadline = time.time() + 60
    while f.serving != set(f.actors):
        assert time.time() < deadline, "the other replica did not serve again"
        time.sleep(0.1)
