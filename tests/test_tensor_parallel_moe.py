"""Tensor parallelism of a mixture of experts on tiny random Qwen3-MoE, Mixtral and
OLMoE models: each expert split as a plain MLP, the router whole on every rank, so an
Engine over 2 and 4 processes gives VERIFIED tokens and logprob bits equal to one
process, alone and in a mixed batch (OFF rows routed to the same experts), and when
the fast plan speculates and the router margin triggers its replays; OFF works; what
does not split is refused at start-up, by name."""
import functools
from dataclasses import replace

import pytest
import torch

from gateeng.config import SOFTMAX_TOPK, EngineConfig, ModelConfig, MoeConfig
from gateeng.engine.engine import Engine
from gateeng.model import shard
from gateeng.plans import packing, reference_ops
from gateeng.plans.cpu_linear import Packed
from gateeng.request import DeterminismParams, Mode
from tests.test_quantized import TYPES, stored
from tests.test_tensor_parallel_engine import GREEDY, PROMPTS, SEEDED, VERIFIED, bits
from tests.tiny import hf_family, tiny_loaded

OFF = DeterminismParams(Mode.OFF)


def engine(loaded, size: int, **changes) -> Engine:
    return Engine(EngineConfig(tensor_parallel_size=size, num_kv_blocks=96, max_num_seqs=16, num_threads=1,
                               **changes), loaded=loaded)


def answers(e: Engine, prompts) -> list:
    return [bits(e.generate(p, params, VERIFIED)) for p in prompts for params in (GREEDY, SEEDED)]


@functools.lru_cache(maxsize=None)
def one_process(family: str) -> tuple:
    """(the family's bf16 tiny model, its VERIFIED answers to PROMPTS on one process)."""
    loaded = tiny_loaded("bfloat16", hf_family(family))
    one = engine(loaded, 1)
    try:
        return loaded, answers(one, PROMPTS)
    finally:
        one.shutdown()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "olmoe"])
def test_verified_alone_and_in_a_batch_has_the_bits_of_one_process_at_two_ranks(family):
    loaded, want = one_process(family)
    two = engine(loaded, 2)
    try:
        shard_model = two.core.model
        assert shard_model.tp.layout.attention_split == (family != "olmoe")   # OLMoE's q/k norms span q and k
        assert shard_model.cfg.moe.intermediate_size == 16                    # each expert's 32 columns, halved
        assert shard_model.layers[0].router.shape == (4, 64)                   # the router whole
        assert answers(two, PROMPTS[:2]) == want[:4]
        verified = [(p, params) for p in PROMPTS for params in (GREEDY, SEEDED)]
        noise = [f"noise {i} " * (1 + i % 5) for i in range(6)]
        results = [h.result() for h in two.submit_many(
            [p for p, _ in verified] + noise, [params for _, params in verified] + [GREEDY] * len(noise),
            [VERIFIED] * len(verified) + [OFF] * len(noise))]
    finally:
        two.shutdown()
    assert [bits(c) for c in results[:len(verified)]] == want
    for c in results[len(verified):]:   # OFF: served in full, from the vocabulary; its bits promise nothing
        assert c.mode == Mode.OFF and len(c.token_ids) == GREEDY.max_tokens and all(0 <= t < 256 for t in c.token_ids)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_verified_has_the_bits_of_one_process_at_four_ranks(family):
    loaded, want = one_process(family)
    four = engine(loaded, 4)
    try:
        assert four.core.model.cfg.moe.intermediate_size == 8
        assert answers(four, PROMPTS[:1]) == want[:2]
    finally:
        four.shutdown()


def test_speculative_verified_triggered_by_the_router_margin_has_the_bits_of_one_process():
    """The fast plan decodes at two ranks (its routing rank 0's), every token's router
    margin within the bound: each triggers a replay under the reason `router`, and the
    answers are one process's."""
    loaded, want = one_process("olmoe")
    two = engine(loaded, 2, verified_route="speculative", margin_threshold=0.0, router_margin_threshold=1e9)
    try:
        done = [two.generate(p, params, VERIFIED) for p in PROMPTS[:2] for params in (GREEDY, SEEDED)]
    finally:
        two.shutdown()
    assert [bits(c) for c in done] == want[:4]
    assert all(c.stats.triggers_router > 0 and c.stats.triggers_margin == 0 for c in done)


def test_a_mixture_of_experts_split_weight_by_weight_lets_each_weight_go_and_gives_the_same_shards():
    kept, model = (tiny_loaded("bfloat16", hf_family("qwen3_moe")).model for _ in range(2))
    lays = [shard.layout(model.cfg, 2, r) for r in range(2)]
    want, got = shard.shard_tensors(kept, lays), shard.shard_tensors(model, lays, release=True)
    for a, b in zip(want, got):
        assert a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)
    router, expert = kept.layers[0].router, kept.layers[0].experts[3]
    for r, part in enumerate(want):   # the router whole; expert 3's columns of gate and of up, its K of down
        assert torch.equal(part["layers.0.router"], router)
        lo, hi = 16 * r, 16 * (r + 1)
        gate_up = torch.cat([expert.gate_up[lo:hi], expert.gate_up[32 + lo:32 + hi]])
        assert torch.equal(part["layers.0.experts.3.gate_up"], gate_up)
        assert torch.equal(part["layers.0.experts.3.down"], expert.down[:, lo:hi])
    weights = model.projections() + model.routers() + [model.lm_head]
    assert all(w.untyped_storage().nbytes() == 0 for w in weights)   # every weight let go once split


def moe_config(expert_inter: int, sparse_layers=(0, 1), intermediate: int = 128) -> ModelConfig:
    return ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=intermediate, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=16, architecture="qwen3_moe", qk_norm=True,
                       moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=expert_inter, routing=SOFTMAX_TOPK,
                                     norm_topk_prob=True, sparse_layers=sparse_layers))


def test_sizes_whose_experts_do_not_split_on_block_boundaries_are_refused_by_name():
    with pytest.raises(ValueError, match="expert MLP down projection's K = 48 is not a multiple of 32"):
        shard.layout(moe_config(48), 2, 0)
    # layer 1, a plain MLP, splits as a dense model's
    with pytest.raises(ValueError, match="MLP down projection.s K = 100"):
        shard.layout(moe_config(32, sparse_layers=(0,), intermediate=100), 2, 0)
    # Every layer routes: the dense width is used by no layer, and is not refused.
    lays = [shard.layout(moe_config(32, intermediate=100), 4, r) for r in range(4)]
    assert [lay.expert_mlp for lay in lays] == [range(8 * r, 8 * (r + 1)) for r in range(4)]
    assert [lay.expert_down[:2] for lay in lays] == [(8 * r, 8 * (r + 1)) for r in range(4)]
    assert shard.local_config(moe_config(32), lays[0]).moe == replace(moe_config(32).moe, intermediate_size=8)


def test_experts_served_quantized_are_refused_naming_dequantize():
    ops = reference_ops.load()
    loaded = tiny_loaded("bfloat16", hf_family("mixtral"))
    down = loaded.model.layers[1].experts[2].down   # one expert's down as a GGUF's Q8_0, as stored
    raw = torch.from_numpy(stored("Q8_0", *down.shape)[0])
    packing.set_packed(loaded.model, down, Packed(ops.qpack(raw, TYPES["Q8_0"]), *down.shape), ops)
    with pytest.raises(ValueError, match="experts are quantized as stored.*--dequantize"):
        engine(loaded, 2)
