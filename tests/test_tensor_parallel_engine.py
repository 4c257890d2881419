"""Tensor parallelism end to end on the tiny random-weight Llama: an Engine whose
model is split over 2 processes (gloo, one thread each) gives VERIFIED tokens and
logprob bits equal to one process, alone and in a mixed batch, and so does a GGUF
served with its quantized weights as stored; OFF works; a killed worker makes the
engine fail closed; sizes it cannot run are refused at start-up."""
import os
import signal
import time
from pathlib import Path

import pytest
import torch

from gateeng.config import EngineConfig, ModelConfig
from gateeng.engine.engine import Engine
from gateeng.engine.errors import EngineDead
from gateeng.model import loader, shard
from gateeng.plans import packing
from gateeng.plans.tp_shapes import QUANT_BLOCK
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tests.tiny import tiny_loaded
from tests.tiny_gguf import write_tiny_gguf

VERIFIED = DeterminismParams(Mode.VERIFIED)
PROMPTS = ["hello world", "abc", "the quick brown fox jumps over", "x" * 40]
GREEDY = SamplingParams(max_tokens=24, logprobs=3, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, seed=7, logprobs=3, ignore_eos=True)


def engine(size: int, **changes) -> Engine:
    cfg = dict(tensor_parallel_size=size, num_kv_blocks=96, max_num_seqs=16, num_threads=1, **changes)
    return Engine(EngineConfig(**cfg), loaded=tiny_loaded("bfloat16"))


@pytest.fixture(scope="module")
def one():
    e = engine(1)
    yield e
    e.shutdown()


@pytest.fixture
def two():   # one tensor-parallel engine per process at a time (torch.distributed's default group)
    e = engine(2)
    yield e
    e.shutdown()


def bits(c) -> tuple:
    """A completion's tokens and every logprob, as exact bits."""
    lps = [(lp.token, lp.logprob.hex(), tuple((t, v.hex()) for t, v in lp.top)) for lp in c.logprobs]
    return tuple(c.token_ids), tuple(lps)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_verified_alone_has_the_bits_of_one_process(one, two, params):
    for prompt in PROMPTS:
        want, got = one.generate(prompt, params, VERIFIED), two.generate(prompt, params, VERIFIED)
        assert len(got.token_ids) == params.max_tokens
        assert bits(got) == bits(want), prompt
    assert got.reproducibility.tensor_parallel_size == 2 and want.reproducibility.tensor_parallel_size == 1
    assert got.reproducibility.reference == want.reproducibility.reference == "gateeng-ref-1"


def test_verified_in_a_mixed_batch_has_the_bits_of_one_process_alone_and_off_works(one, two):
    alone = {(p, i): bits(one.generate(p, params, VERIFIED)) for p in PROMPTS for i, params in enumerate((GREEDY,
                                                                                                         SEEDED))}
    noise = [f"noise {i} " * (1 + i % 5) for i in range(8)]
    off_params = SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)
    prompts = [p for p in PROMPTS for _ in (GREEDY, SEEDED)] + noise
    params = [GREEDY, SEEDED] * len(PROMPTS) + [off_params] * len(noise)
    det = [VERIFIED] * (2 * len(PROMPTS)) + [DeterminismParams(Mode.OFF)] * len(noise)
    results = [h.result() for h in two.submit_many(prompts, params, det)]
    for (p, i), got in zip(alone, results):
        assert bits(got) == alone[(p, i)], p
    for c in results[2 * len(PROMPTS):]:   # OFF: served in full, from the vocabulary; its bits promise nothing
        assert c.mode == Mode.OFF and len(c.token_ids) == 20 and all(0 <= t < 256 for t in c.token_ids)


def test_one_tensor_parallel_engine_per_process(two):
    with pytest.raises(ValueError, match="already runs a tensor-parallel engine"):
        engine(2)


def test_attention_whole_on_every_rank_at_four_ranks_keeps_the_bits(one):
    # 2 KV heads over 4 ranks: attention is whole on every rank and o splits on its K
    # blocks, as for the embedded model (9 heads, 3 KV heads) at 2 and 4.
    four = engine(4)
    try:
        assert not four.core.model.tp.layout.attention_split
        for params in (GREEDY, SEEDED):
            for prompt in PROMPTS[:2]:
                assert bits(four.generate(prompt, params, VERIFIED)) == bits(one.generate(prompt, params, VERIFIED))
    finally:
        four.shutdown()


STACKS = {"blk.*.attn_q.weight": "Q4_K", "blk.*.attn_k.weight": "Q5_K", "blk.*.attn_v.weight": "Q6_K",
          "blk.*.ffn_gate.weight": "Q5_K", "blk.*.ffn_up.weight": "Q4_K", "*": "Q8_0"}
STACKS_SHAPE = dict(hidden=256, heads=4, kv_heads=4, head_dim=128, intermediate=512, layers=1)


@pytest.mark.parametrize("qtype,sizes,shape", [
    # heads and o's GGUF blocks split alike: attention by head
    ("Q4_0", (2,), dict(hidden=64, heads=4, kv_heads=2, head_dim=128, intermediate=512)),
    # SmolLM2's shape and types as shipped: attention whole on every rank; o's 18 blocks in
    # lanes of 2, so at 4 ranks the last holds none
    ({"token_embd.weight": "Q8_0", "*": "Q4_1"}, (4,), dict(hidden=576, heads=9, kv_heads=3, head_dim=64,
                                                           intermediate=1536, layers=1)),
    # the K-quants (Q4_K, Q5_K, Q6_K) as stored: down's 16 super-blocks in lanes of 1, o's one
    # super-block whole on rank 0 (attention whole on every rank)
    ({"blk.*.ffn_down.weight": "Q6_K", "blk.*.ffn_gate.weight": "Q5_K", "blk.*.ffn_up.weight": "Q5_K",
      "output.weight": "Q6_K", "*": "Q4_K"}, (2,), dict(hidden=256, heads=2, kv_heads=1, head_dim=128,
                                                        intermediate=4096, layers=1, tie=False)),
    ({"blk.*.ffn_down.weight": "Q6_K", "*": "Q4_K"}, (4,), dict(hidden=256, heads=2, kv_heads=1, head_dim=128,
                                                                intermediate=4096, layers=1)),
    # stacks of several types (q, k, v in three; gate, up in two), split by head and by MLP
    # columns part by part (o and down in Q8_0: 16 blocks, an even split), at 2 and 4 ranks
    # against one process's answers
    (STACKS, (2, 4), STACKS_SHAPE),
], ids=["q4_0-by-head", "smollm2-mix-whole-attention", "k-quants-2", "k-quants-4", "stacks-2-and-4"])
def test_a_quantized_gguf_served_as_stored_has_the_bits_of_one_process(tmp_path, capsys, qtype, sizes, shape):
    path = write_tiny_gguf(tmp_path / "q.gguf", qtype, **shape)["path"]
    answers, plans = {}, {}
    for n in (1,) + sizes:
        e = Engine(EngineConfig(model=str(path), tensor_parallel_size=n, num_kv_blocks=64, max_num_seqs=8,
                                num_threads=1))
        try:
            assert packing.quantized(e.core.model) and "dequantized" not in capsys.readouterr().err
            if n > 1:
                assert e.core.model.tp.layout.attention_split == (shape["heads"] == 4)
            # One batch: a VERIFIED answer is the same in any batch (the tests above), so
            # the sizes are compared on a quarter of the steps.
            done = e.generate([p for p in PROMPTS[:2] for _ in (GREEDY, SEEDED)], [GREEDY, SEEDED] * 2, VERIFIED)
            answers[n] = [bits(c) for c in done]
            plans[n] = {c.reproducibility.kernel_plan for c in done}
        finally:
            e.shutdown()
    for size in sizes:
        assert answers[size] == answers[1], size
        assert plans[size] == plans[1], size
    assert all("weights)" in p for p in plans[1])   # the reference names the types


def test_a_model_split_weight_by_weight_lets_each_weight_go_and_gives_the_same_shards(tmp_path):
    from gateeng.plans.cpu_linear import Packed
    path = str(write_tiny_gguf(tmp_path / "q.gguf", {"blk.0.ffn_down.weight": "F16", "*": "Q8_0"},
                               intermediate=512)["path"])
    kept, model = loader.load(path).model, loader.load(path).model
    lays = [shard.layout(model.cfg, 2, r, shard.row_units(model, 2)) for r in range(2)]
    want, got = shard.shard_tensors(kept, lays), shard.shard_tensors(model, lays, release=True)

    def same(a, b) -> bool:
        if isinstance(a, Packed):
            return (a.n, a.k, a.per) == (b.n, b.k, b.per) and torch.equal(a.data, b.data)
        return torch.equal(a, b)
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(same(a[name], b[name]) for name in a)
    weights = model.projections() + [model.lm_head]
    assert not any(id(w) in packing.of(model).shared for w in weights)   # every packed copy let go
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)       # and every plain one
    assert any(isinstance(t, Packed) for t in got[1].values()) and packing.quantized(kept)


def test_layers_that_mix_quantized_and_bf16_split_only_where_both_split_alike(tmp_path):
    # down is F16 (served in bf16) in layer 0 and Q4_0 in layer 1: 128 MLP columns are 4
    # GGUF blocks, one lane each, so the two split differently over 2 ranks; 512 are 16.
    mixed = {"blk.0.ffn_down.weight": "F16", "*": "Q4_0"}
    narrow = loader.load(str(write_tiny_gguf(tmp_path / "a.gguf", mixed)["path"]))
    with pytest.raises(ValueError, match="down projections are quantized in some layers.*--dequantize"):
        shard.row_units(narrow.model, 2)
    wide = write_tiny_gguf(tmp_path / "b.gguf", mixed, intermediate=512)["path"]
    assert shard.row_units(loader.load(str(wide)).model, 2) == (QUANT_BLOCK, 2)   # o quantized everywhere
    answers = {}
    for n in (1, 2):
        e = Engine(EngineConfig(model=str(wide), tensor_parallel_size=n, num_kv_blocks=64, num_threads=1))
        try:
            answers[n] = [bits(e.generate(p, GREEDY, VERIFIED)) for p in PROMPTS[:2]]
        finally:
            e.shutdown()
    assert answers[2] == answers[1]


def kill_a_worker(e: Engine) -> None:
    os.kill(e.core.tp_group.workers[0].pid, signal.SIGKILL)


def test_a_worker_killed_mid_request_fails_every_request_within_10s():
    e = engine(2)
    deaths = []
    e.on_death.append(deaths.append)
    try:
        handles = e.submit_many(["a long one", "another"], SamplingParams(max_tokens=400, ignore_eos=True),
                                [VERIFIED, DeterminismParams(Mode.OFF)])
        next(iter(handles[1]))   # the OFF request's first chunk: decoding has started
        kill_a_worker(e)
        t0 = time.monotonic()
        for h in handles:
            with pytest.raises(Exception, match="tensor-parallel"):
                h.result(timeout=10)
        assert time.monotonic() - t0 < 10
        assert deaths and "tensor-parallel" in str(deaths[0])
        with pytest.raises(EngineDead):
            e.submit("after", SamplingParams(max_tokens=2))
    finally:
        e.shutdown()


def test_a_hung_worker_fails_every_request_after_the_timeout():
    e = engine(2, tensor_parallel_timeout=3)
    worker = e.core.tp_group.workers[0]
    try:
        handles = e.submit_many(["one", "two"], SamplingParams(max_tokens=400, ignore_eos=True),
                                [VERIFIED, DeterminismParams(Mode.OFF)])
        next(iter(handles[1]))
        os.kill(worker.pid, signal.SIGSTOP)   # alive, but answers no collective
        t0 = time.monotonic()
        for h in handles:
            with pytest.raises(RuntimeError, match="tensor-parallel collective failed"):
                h.result(timeout=10)
        assert time.monotonic() - t0 < 10
        with pytest.raises(EngineDead):
            e.submit("after", SamplingParams(max_tokens=2))
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        e.shutdown()


def test_a_worker_killed_while_idle_ends_the_engine_within_10s():
    e = engine(2)
    deaths = []
    e.on_death.append(deaths.append)
    try:
        kill_a_worker(e)
        deadline = time.monotonic() + 10
        while not deaths and time.monotonic() < deadline:
            time.sleep(0.05)
        assert deaths and "exited with code -9" in str(deaths[0])
        with pytest.raises(EngineDead):
            e.submit("after", SamplingParams(max_tokens=2))
    finally:
        e.shutdown()


@pytest.mark.parametrize("changes,why", [
    (dict(tensor_parallel_size=3), "not a power of two"),
    (dict(tensor_parallel_size=32), "not a power of two"),
    (dict(tensor_parallel_size=2, dtype="float32"), "needs a bf16 model"),
    (dict(tensor_parallel_size=2, fast_logit_noise=0.1), "not supported with tensor parallelism"),
])
def test_sizes_and_settings_it_cannot_run_are_refused_at_start_up(changes, why):
    cfg = dict(dict(num_kv_blocks=16, num_threads=1), **changes)
    with pytest.raises(ValueError, match=why):
        Engine(EngineConfig(**cfg), loaded=tiny_loaded(cfg.get("dtype", "bfloat16")))


def test_a_model_whose_mlp_does_not_split_is_refused_with_the_reason():
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=100, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, architecture="llama")
    with pytest.raises(ValueError, match="100 MLP columns"):
        shard.layout(cfg, 8, 0)


def test_layouts_tile_the_model():
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, architecture="llama")
    for size in (2, 4, 8, 16):
        lays = [shard.layout(smollm2, size, r) for r in range(size)]
        assert not any(lay.attention_split for lay in lays)
        assert all(lay.heads == range(9) and lay.kv_heads == range(3) for lay in lays)
        for field, total in (("mlp", 1536), ("vocab", 49152)):
            parts = [getattr(lay, field) for lay in lays]
            assert parts[0].start == 0 and parts[-1].stop == total
            assert all(a.stop == b.start for a, b in zip(parts, parts[1:]))
        assert [(lay.o.start, lay.o.stop) for lay in lays] == [(r * 576 // size, (r + 1) * 576 // size)
                                                               for r in range(size)]
    tiny = ModelConfig(vocab_size=250, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, architecture="llama")
    lays = [shard.layout(tiny, 2, r) for r in range(2)]
    assert all(lay.attention_split for lay in lays)
    assert [lay.heads for lay in lays] == [range(0, 2), range(2, 4)]
    assert [lay.kv_heads for lay in lays] == [range(0, 1), range(1, 2)]
    assert [lay.vocab for lay in lays] == [range(0, 125), range(125, 250)]


def test_quantized_layouts_split_on_gguf_blocks():
    units = (QUANT_BLOCK, QUANT_BLOCK)
    smollm2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64, architecture="llama")
    lays = [shard.layout(smollm2, 4, r, units) for r in range(4)]
    # o's 18 blocks in lanes of 2: 8, 8, 2 and 0 blocks; down's 48 in lanes of 3: even
    assert [(lay.o.start, lay.o.stop) for lay in lays] == [(0, 256), (256, 512), (512, 576), (576, 576)]
    assert [lay.mlp for lay in lays] == [range(r * 384, (r + 1) * 384) for r in range(4)]
    tinyllama = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=32,
                            num_kv_heads=4, head_dim=64, architecture="llama")
    for size in (2, 4):   # 2048 and 5632 values are 64 and 176 blocks: whole lanes, even splits, heads split
        quantized, plain = ([(lay.attention_split, lay.heads, lay.mlp, lay.o[:2], lay.down[:2])
                             for lay in (shard.layout(tinyllama, size, r, u) for r in range(size))]
                            for u in (units, (2, 2)))
        assert quantized == plain and all(split for split, *_ in quantized)
    # heads that divide evenly but whose GGUF blocks do not: attention whole on every rank
    narrow = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=512, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, architecture="llama")
    assert shard.layout(narrow, 2, 0).attention_split and not shard.layout(narrow, 2, 0, units).attention_split


def test_calibrate_runs_both_plans_at_two_ranks():
    from gateeng.tools import calibrate as cal
    loaded = tiny_loaded("bfloat16")
    prompts = [loaded.tokenizer.encode(p) for p in PROMPTS]
    report = cal.calibrate(loaded, prompts, n_tokens=6, batch_sizes=(1, 2), show_progress=False,
                           tensor_parallel_size=2)
    assert report.steps == 2 * len(PROMPTS) * 5 and report.machine["tensor_parallel_size"] == 2


def test_a_server_whose_worker_dies_turns_not_serving_and_exits_non_zero(tmp_path):
    from grpc_health.v1 import health_pb2
    from tests.test_server import start_server, wait_health
    from tests.tiny import save_family
    save_family("llama", tmp_path)
    proc, target, _ = start_server("--model", str(tmp_path), "--tensor-parallel-size", "2", "--threads", "1",
                                   "--kv-blocks", "64")
    try:
        wait_health(target, health_pb2.HealthCheckResponse.SERVING, timeout=120)
        workers = [pid for task in Path(f"/proc/{proc.pid}/task").iterdir()
                   for pid in (task / "children").read_text().split()
                   if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        assert len(workers) == 1
        os.kill(int(workers[0]), signal.SIGKILL)
        t0 = time.monotonic()
        code = proc.wait(timeout=10)
        assert code != 0 and time.monotonic() - t0 < 10
        assert "exited with code -9" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
