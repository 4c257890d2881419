"""Weights in place at --tensor-parallel-size 2 on one machine, on the tiny random-weight
Llama and Qwen3-MoE: every rank reads its own shard of the new checkpoint by byte ranges and all swap
together. After the same update, a size-2 engine has a size-1 engine's fingerprint and
weight_version and its VERIFIED bits (tokens and logprobs); a broken checkpoint (a
tensor misshaped, a file truncated, a value that only rank 1 reads not finite) changes no
rank: the old answers, fingerprint and version, the KV accounting and a request running
beside the refused update are untouched."""
import re

import pytest
from safetensors.torch import load_file, save_file

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.engine.errors import WeightsRefused
from gateeng.model import loader
from gateeng.plans import reference_ops
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tests.test_weight_update import broken
from tests.tiny import hf_family, save_family

VERIFIED = DeterminismParams(Mode.VERIFIED)
GREEDY = SamplingParams(max_tokens=8, logprobs=2, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=8, temperature=0.9, seed=7, logprobs=2, ignore_eos=True)
ASKED = [("hello world", GREEDY), ("the quick brown fox", SEEDED)]


@pytest.fixture(scope="module", autouse=True)
def reference_runs():
    if not reference_ops.runnable():
        pytest.skip("no build of the reference runs here")


def old_and_new(root, family: str) -> tuple:
    """(the served checkpoint, a new one of the same architecture): Hugging Face directories."""
    save_family(family, root / "old")
    hf_family(family, seed=1).save_pretrained(root / "new", safe_serialization=True)
    for f in (root / "old").glob("*token*"):   # so that it also starts a server of its own
        (root / "new" / f.name).write_bytes(f.read_bytes())
    return root / "old", root / "new"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return old_and_new(tmp_path_factory.mktemp("tpw"), "llama")


def engine(model_dir, size: int) -> Engine:
    return Engine(EngineConfig(model=str(model_dir), dtype="bfloat16", tensor_parallel_size=size, num_threads=1,
                               num_kv_blocks=64, max_num_seqs=8, verified_route="speculative"))


def bits(c) -> tuple:
    lps = [(lp.token, lp.logprob.hex(), tuple((t, v.hex()) for t, v in lp.top)) for lp in c.logprobs]
    return tuple(c.token_ids), tuple(lps)


def answers(e: Engine) -> list:
    return [bits(e.generate(prompt, params, VERIFIED)) for prompt, params in ASKED]


def state(e: Engine) -> tuple:
    """What a refused update must leave as it was: the answers, the weights' names and
    the KV accounting."""
    blocks = e.core.blocks
    blocks.check_integrity()
    return (answers(e), e.loaded.fingerprint, e.reproducibility.model_fingerprint, e.weight_version,
            blocks.num_free, e.counts.running, e.counts.waiting)


def test_an_update_at_size_2_gives_size_1s_fingerprint_version_and_verified_bits(dirs):
    update_at_2_is_update_at_1(*dirs)


def test_a_mixture_of_experts_update_at_size_2_gives_size_1s_fingerprint_version_and_verified_bits(tmp_path):
    """Per-expert files (save_pretrained's), then fused expert tensors (transformers 5's
    state_dict) of other weights."""
    old, new = old_and_new(tmp_path, "qwen3_moe")
    fused = tmp_path / "fused"
    fused.mkdir()
    for f in new.iterdir():
        (fused / f.name).write_bytes(f.read_bytes())
    tensors = {k: v.contiguous() for k, v in hf_family("qwen3_moe", seed=2).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    save_file(tensors, fused / "model.safetensors", metadata={"format": "pt"})
    update_at_2_is_update_at_1(old, new, fused)


def update_at_2_is_update_at_1(old, new, *later) -> None:
    """`new`, then each of `later`, at size 1 and at size 2: the same fingerprints,
    versions and VERIFIED bits after each."""
    one = engine(old, 1)
    try:
        before = answers(one)
        want = []
        for path in (new, *later):
            done = one.update_weights(path)
            want.append((answers(one), done.model_fingerprint, done.weight_version))
    finally:
        one.shutdown()
    assert want[0][0] != before   # the new weights answer otherwise
    for path, (_, fingerprint, _) in zip((new, *later), want):
        assert fingerprint == loader.load(str(path), "bfloat16").fingerprint
    two = engine(old, 2)
    try:
        assert answers(two) == before
        # prepared on every rank, then dropped everywhere: nothing changes
        two.discard_weights(two.prepare_weights(new))
        assert answers(two) == before and two.weight_version == 0
        got = []
        for path in (new, *later):
            done = two.update_weights(path)
            got.append((answers(two), done.model_fingerprint, done.weight_version))
        record = two.generate("abc", GREEDY, VERIFIED).reproducibility
    finally:
        two.shutdown()
    assert got == want and [g[2] for g in got] == list(range(1, len(got) + 1))
    assert (record.model_fingerprint, record.weight_version, record.tensor_parallel_size) == \
        (want[-1][1], len(want), 2)


def nan_in_rank_1s_rows(tmp_path, new_dir):
    """A copy of new_dir with one NaN in rank 1's rows of a column-parallel weight (its
    MLP columns 64..127 of 128), which rank 0 never reads; returns (its path, what the
    refusal must name)."""
    d = tmp_path / "rank1"
    d.mkdir()
    for f in new_dir.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    tensors = load_file(d / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"][100, 3] = float("nan")
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    return d, "rank 1: model.layers.0.mlp.up_proj.weight: 1 of this rank's values are NaN"


def test_a_broken_checkpoint_changes_no_rank(dirs, tmp_path):
    old, new = dirs
    two = engine(old, 2)
    try:
        before = state(two)
        cases = [broken(tmp_path, new, "shape"), broken(tmp_path, new, "truncated"),
                 nan_in_rank_1s_rows(tmp_path, new)]
        for path, names in cases:
            # a VERIFIED request runs beside the refused update and keeps the old weights' bits
            running = two.submit(*ASKED[0], VERIFIED)
            with pytest.raises(WeightsRefused, match=re.escape(names)) as refused:
                two.update_weights(path)
            assert "rank 0" not in str(refused.value)   # rank 1's refusal alone stopped the last one
            assert bits(running.result()) == before[0][0]
            assert state(two) == before, path.name
    finally:
        two.shutdown()

