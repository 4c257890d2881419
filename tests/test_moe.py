"""Mixtures of experts (Qwen3-MoE, Mixtral, OLMoE) on tiny random models: the config
each family's transformers class writes, logits against transformers, VERIFIED
answers equal to the reference alone and in a batch on every CPU build of the
reference, the routing rule (ties included) against the spec's oracle, and the
refusals: unsupported families and config fields, broken checkpoints by name."""
import numpy as np
import pytest
import torch

import oracle
from gateeng.config import SOFTMAX_TOPK, TOPK_SOFTMAX, EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model.families import config_from_hf
from gateeng.plans import reference_ops
from gateeng.plans.generic import FastPlan
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE_ISAS
from gateeng.request import DeterminismParams, Mode, SamplingParams
from test_model import prefill_logits
from test_model_families import SEQS, TINY
from tiny import MOE_FAMILIES, hf_family, save_family, tiny_loaded

BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in reference_ops.runnable(),
                                                      reason=f"this CPU cannot run the {isa} build"))
          for isa in REFERENCE_ISAS]
VERIFIED = DeterminismParams(Mode.VERIFIED)


def bf16_rounded(family: str):
    """The family's tiny transformers model in float32 on bf16-rounded weights: the
    numbers a bf16 engine serves."""
    hf = hf_family(family).float()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return hf


def reference_answer(loaded, prompt, params):
    """The reference's tokens for one prompt (an engine with plan=invariant)."""
    ref = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
    try:
        return ref.generate(prompt, params).token_ids
    finally:
        ref.shutdown()


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def family(request):
    return request.param, bf16_rounded(request.param)


def test_config_reads_each_familys_routing(family):
    name, hf = family
    cfg = config_from_hf(hf.config)
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k) == (4, 2)
    assert moe.routing == (TOPK_SOFTMAX if name == "mixtral" else SOFTMAX_TOPK)
    assert moe.norm_topk_prob == (name == "qwen3_moe")
    assert moe.sparse_layers == ((0,) if name == "qwen3_moe" else (0, 1))   # Qwen3-MoE's layer 1: mlp_only_layers
    assert moe.intermediate_size == 32
    assert cfg.qk_norm == (name != "mixtral")
    assert cfg.qk_norm_scope == ("projection" if name == "olmoe" else "head")


def test_float32_logits_match_transformers_on_the_same_bf16_weights(family):
    """The bound of the dense families (test_model_families): 1e-3 at every position."""
    _, hf = family
    ours = prefill_logits(tiny_loaded("float32", hf), FastPlan(), SEQS, chunk=7)
    for s, lg in zip(SEQS, ours):
        with torch.no_grad():
            want = hf(torch.tensor([s])).logits[0].float()
        assert (lg - want).abs().max().item() < 1e-3


@pytest.mark.parametrize("isa", BUILDS)
def test_verified_alone_and_in_a_batch_equals_the_reference(family, isa, monkeypatch):
    monkeypatch.setenv(ISA_ENV, isa)
    _, hf = family
    loaded = tiny_loaded("bfloat16", hf)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    want = reference_answer(loaded, SEQS[0], params)
    # A noisy fast path provokes rollbacks; the batch around the VERIFIED request routes
    # other tokens to the same experts at every step.
    engine = Engine(EngineConfig(dtype="bfloat16", fast_logit_noise=0.5, **TINY), loaded=loaded)
    try:
        alone = engine.generate(SEQS[0], params, VERIFIED)
        batch = engine.generate([SEQS[1], SEQS[0], SEQS[2], [9] * 30], params, [None, VERIFIED, None, None])
    finally:
        engine.shutdown()
    assert alone.token_ids == want and batch[1].token_ids == want
    assert batch[1].stats.triggers + batch[1].stats.direct_steps > 0


def test_the_reference_is_the_same_on_every_build(family):
    _, hf = family
    runnable = [isa for isa in REFERENCE_ISAS if isa in reference_ops.runnable()]
    if len(runnable) < 2:
        pytest.skip("one reference build runs here")
    loaded = tiny_loaded("bfloat16", hf)
    answers = []
    for isa in runnable:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(ISA_ENV, isa)
            ref = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
            try:
                res = ref.generate(SEQS[2], SamplingParams(max_tokens=12, ignore_eos=True, logprobs=1))
            finally:
                ref.shutdown()
        answers.append((res.token_ids, [lp.logprob for lp in res.logprobs]))
    assert all(a == answers[0] for a in answers)


def route_cases():
    """Router logits [rows, 6]: random, and rows with exact ties at the k-th place, at
    the top, everywhere, and at a flushed exp."""
    gen = torch.Generator().manual_seed(5)
    z = torch.randn(40, 6, generator=gen) * 3
    z[0] = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, -1.0])    # three-way tie across the k-th place
    z[1] = torch.tensor([3.0, 3.0, 3.0, 3.0, 3.0, 3.0])     # all equal
    z[2] = torch.tensor([0.0, 5.0, 1.0, 1.0, -100.0, 1.0])  # tie for 2nd and 3rd; an exp below -86
    z[3] = torch.tensor([7.0, 7.0, -2.0, 0.0, 0.0, 1.0])
    return z


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("rule", [(True, True), (True, False), (False, False)],
                         ids=["softmax-topk-renorm", "softmax-topk", "topk-softmax"])
@pytest.mark.parametrize("k", [1, 2, 3, 6])
def test_routing_and_combine_are_the_specs(isa, rule, k):
    ops = reference_ops.load(isa)
    z = route_cases()
    ids, weights, margins = ops.moe_route(z, k, *rule)
    for r in range(z.shape[0]):
        want_ids, want_w, want_margin = oracle.moe_route(z[r].numpy(), k, *rule)
        assert ids[r].tolist() == want_ids, r
        assert weights[r].numpy().view(np.uint32).tolist() == want_w.view(np.uint32).tolist(), r
        assert np.float32(margins[r].item()).view(np.uint32) == want_margin.view(np.uint32), r
    y = (torch.randn(z.shape[0], k, 24, generator=torch.Generator().manual_seed(2)) * 4).to(torch.bfloat16)
    got = ops.moe_combine(y, weights)
    for r in range(z.shape[0]):
        want = oracle.moe_combine(y[r].view(torch.int16).numpy().view(np.uint16), weights[r].numpy())
        assert got[r].view(torch.int16).numpy().view(np.uint16).tolist() == want.tolist(), r


def test_ties_rank_the_lower_expert_first():
    """Exactly equal scores: the lower id is chosen at the k-th place (and the margin is 0)."""
    ops = reference_ops.load()
    z = torch.tensor([[2.0, 1.0, 1.0, 0.5], [0.0, 4.0, 0.0, 0.0], [1.0, 3.0, 3.0, 0.0]])
    for softmax_first in (True, False):
        ids, _, margins = ops.moe_route(z, 2, softmax_first, False)
        assert ids.tolist() == [[0, 1], [0, 1], [1, 2]]
        assert margins.tolist()[:2] == [0.0, 0.0] and margins.tolist()[2] > 0
        ids, _, margins = ops.moe_route(z, 1, softmax_first, False)
        assert ids.tolist() == [[0], [1], [1]]
        assert margins.tolist()[2] == 0.0


def test_a_model_whose_router_ties_two_experts_routes_by_the_written_rule():
    """Router rows 1 and 2 equal: their logits are equal for every token, so expert 2 is
    chosen only beside expert 1; and some token chooses 1 without 2 (the tie sat at the
    k-th place)."""
    hf = bf16_rounded("olmoe")
    with torch.no_grad():
        for layer in hf.model.layers:
            layer.mlp.gate.weight[2] = layer.mlp.gate.weight[1]
    loaded = tiny_loaded("bfloat16", hf)
    engine = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
    plan = engine.core.invariant_plan
    seen = []
    route = type(plan).route

    def recording(self, logits, moe):
        ids, weights, margins = route(self, logits, moe)
        assert torch.equal(logits[:, 1], logits[:, 2])
        seen.append(ids)
        return ids, weights, margins
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(plan), "route", recording)
            # The per-op path, which calls route; the one calls give its bits, ties included
            # (test_the_references_one_call_routing_layer_is_the_per_op_path,
            # test_reference_one_call.py).
            mp.setattr(type(plan), "decode_layers", lambda *a: None)
            mp.setattr(type(plan), "moe_layer", lambda *a: None)
            engine.generate(SEQS[0], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        engine.shutdown()
    chosen = [set(row) for ids in seen for row in ids.tolist()]
    assert all(1 in c for c in chosen if 2 in c)
    assert any(1 in c and 2 not in c for c in chosen)


@pytest.mark.parametrize("model_type", ["qwen2_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"])
def test_families_with_parts_the_engine_does_not_compute_are_refused_by_name(model_type):
    from types import SimpleNamespace
    with pytest.raises(ValueError, match=model_type):
        config_from_hf(SimpleNamespace(model_type=model_type))


@pytest.mark.parametrize("family, field, value", [("mixtral", "router_jitter_noise", 0.1),
                                                  ("olmoe", "clip_qkv", 8.0)])
def test_a_config_field_the_engine_does_not_honour_is_refused(family, field, value):
    hf = hf_family(family)
    setattr(hf.config, field, value)
    with pytest.raises(ValueError, match=field):
        config_from_hf(hf.config)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A Qwen3-MoE directory as save_pretrained writes it (one tensor per expert)."""
    path = tmp_path_factory.mktemp("qwen3_moe")
    save_family("qwen3_moe", path)
    return path


def rewrite(src, dst, change):
    """A copy of directory `src` whose weights are change(tensors)."""
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    save_file(change(dict(tensors)), str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_fused_expert_tensors_load_as_the_same_model(saved, tmp_path):
    """transformers 5's fused [experts, rows, cols] tensors: the same weights and the same
    fingerprint as the per-expert files."""
    from gateeng.model.loader import load
    hf = hf_family("qwen3_moe")
    fused = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused
    directory = rewrite(saved, tmp_path / "fused", lambda _: fused)
    a, b = load(str(saved), "bfloat16"), load(str(directory), "bfloat16")
    assert a.fingerprint == b.fingerprint
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), name


def test_per_expert_names_round_trip_and_are_what_weight_updates_expect(saved):
    """hf_state_dict writes the per-expert names the hub stores (save_pretrained's), and
    load_hf_state_dict takes them back bit for bit."""
    from safetensors.torch import load_file

    from gateeng.engine.weights import expected_shapes
    from gateeng.model.llama import LlamaModel
    from gateeng.model.loader import read_model_config
    stored = load_file(str(saved / "model.safetensors"))
    cfg = read_model_config(saved)
    model = LlamaModel(cfg, torch.float32)
    model.load_hf_state_dict(stored)
    got = model.hf_state_dict()
    assert set(got) == set(stored) and all(torch.equal(got[n], stored[n].float()) for n in stored)
    assert expected_shapes(cfg) == {name: tuple(t.shape) for name, t in stored.items()}


@pytest.mark.parametrize("broken, expected", [
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.experts.1.up_proj.weight"},
     "no tensor model.layers.0.mlp.experts.1.up_proj.weight"),
    (lambda t: dict(t, **{"model.layers.0.mlp.experts.3.down_proj.weight": torch.zeros(64, 31)}),
     r"model.layers.0.mlp.experts.3.down_proj.weight has shape \(64, 31\), expected \(64, 32\)"),
    (lambda t: {k: v for k, v in t.items() if k != "model.layers.0.mlp.gate.weight"},
     "no tensor model.layers.0.mlp.gate.weight"),
], ids=["missing-expert", "misshaped-expert", "missing-router"])
def test_a_broken_checkpoint_is_refused_naming_the_tensor(saved, tmp_path, broken, expected):
    from gateeng.model.loader import load
    with pytest.raises(ValueError, match=expected):
        load(str(rewrite(saved, tmp_path / "broken", broken)), "bfloat16")


def test_a_mixture_of_experts_is_refused_where_its_reference_is_not_built():
    loaded = tiny_loaded("float32", hf_family("mixtral"))
    with pytest.raises(ValueError, match="bfloat16 on CPU"):
        Engine(EngineConfig(dtype="float32", **TINY), loaded=loaded)


def test_the_gate_triggers_on_a_router_margin_within_its_bound():
    from gateeng.engine.gate import decide
    from gateeng.request import Reason
    assert decide(1.0, 0, False, 0.3, 32, router_margin=0.05, router_tau=0.1) is Reason.ROUTER
    assert decide(1.0, 0, False, 0.3, 32, router_margin=0.0, router_tau=0.0) is Reason.ROUTER   # a tie
    assert decide(1.0, 0, False, 0.3, 32, router_margin=0.2, router_tau=0.1) is None
    assert decide(1.0, 0, False, 0.3, 32) is None                                              # a dense model
    assert decide(0.1, 0, False, 0.3, 32, router_margin=0.0) is Reason.MARGIN                   # margin first


def test_router_triggers_are_verified_and_counted():
    """Every token's router margin within the bound: each triggers a replay under the
    reason `router`, and the answer is the reference's."""
    loaded = tiny_loaded("bfloat16", bf16_rounded("olmoe"))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = reference_answer(loaded, SEQS[1], params)
    engine = Engine(EngineConfig(dtype="bfloat16", margin_threshold=0.0, router_margin_threshold=1e9,
                                 verified_route="speculative", **TINY), loaded=loaded)
    try:
        got = engine.generate([SEQS[1], SEQS[2]], params, [VERIFIED, None])[0]
    finally:
        engine.shutdown()
    assert got.token_ids == want
    assert got.stats.triggers_router > 0 and got.stats.triggers_margin == 0


def test_calibrate_measures_the_router_margins_of_a_mixture_of_experts(tmp_path):
    """`gateeng calibrate` on a MoE: every fast step's router margin is measured, and the
    router table (beside the chosen tau) catches more flips as its bound grows."""
    import json

    from gateeng.tools import calibrate as cal
    prompts = [[i + 1, i + 7, i + 3, 200 - i] for i in range(4)]
    report = cal.calibrate(tiny_loaded("bfloat16", bf16_rounded("olmoe")), prompts, n_tokens=8, batch_sizes=(1, 2),
                           block_size=4, target_miss=0.5, show_progress=False, fast=FastPlan(logit_noise=3.0))
    assert report.steps == 2 * 4 * 7 and len(report.router_margins) == report.steps
    assert all(0 <= m < 1 for m in report.router_margins)   # OLMoE's: differences of probabilities
    rows = report.router_rows
    assert [r.tau for r in rows] == list(cal.ROUTER_BOUNDS)
    assert all(a.trigger_rate <= b.trigger_rate and a.misses >= b.misses for a, b in zip(rows, rows[1:]))
    assert rows[-1].trigger_rate > rows[0].trigger_rate   # a bound above some routers' margins triggers them
    js, _ = cal.write(report, tmp_path, {"model": "tiny-olmoe"})
    assert len(json.loads(js.read_text())["router_table"]) == len(cal.ROUTER_BOUNDS)
    assert "router bound" in cal.markdown(report)


def test_new_weights_in_place_serve_what_a_fresh_start_on_them_serves(saved, tmp_path):
    """A mixture of experts' weight update (per-expert files, as save_pretrained writes
    them): the new fingerprint and the new reference answers, as a fresh start gives."""
    from gateeng.model.loader import load
    gen = torch.Generator().manual_seed(3)
    new = rewrite(saved, tmp_path / "new",
                  lambda t: {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in t.items()})
    fresh = load(str(new), "bfloat16")
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    want = reference_answer(fresh, SEQS[1], params)
    engine = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=load(str(saved), "bfloat16"))
    try:
        update = engine.update_weights(new)
        got = engine.generate(SEQS[1], params, VERIFIED)
    finally:
        engine.shutdown()
    assert update.model_fingerprint == fresh.fingerprint
    assert got.token_ids == want


def fused_state(seed: int) -> dict:
    """A tiny Qwen3-MoE's tensors as transformers 5 holds them (fused experts)."""
    tensors = {k: v.contiguous() for k, v in hf_family("qwen3_moe", seed=seed).state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in tensors
    return tensors


def test_new_fused_weights_in_place_serve_what_a_fresh_start_on_them_serves(saved, tmp_path):
    """A weight update from fused expert tensors (transformers 5's save): the fingerprint
    and VERIFIED answers of a fresh start on that same directory."""
    from gateeng.model.loader import load
    new = rewrite(saved, tmp_path / "new", lambda _: fused_state(seed=1))
    fresh = load(str(new), "bfloat16")
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2)
    engine = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=load(str(saved), "bfloat16"))
    try:
        before = engine.generate(SEQS[1], params, VERIFIED)
        update = engine.update_weights(new)
        got = engine.generate(SEQS[1], params, VERIFIED)
    finally:
        engine.shutdown()
    started = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=fresh)
    try:
        want = started.generate(SEQS[1], params, VERIFIED)
    finally:
        started.shutdown()
    assert update.model_fingerprint == fresh.fingerprint == started.reproducibility.model_fingerprint
    assert got.token_ids != before.token_ids   # the new weights answer otherwise
    assert (got.token_ids, got.logprobs) == (want.token_ids, want.logprobs)


def misshaped_gate_up(t: dict) -> dict:
    name = "model.layers.0.mlp.experts.gate_up_proj"
    return dict(t, **{name: t[name][:, :-1].contiguous()})


def fused_and_per_expert(t: dict) -> dict:
    return dict(t, **{"model.layers.0.mlp.experts.2.down_proj.weight": t["model.layers.0.mlp.experts.down_proj"][2].clone()})


def without(name: str):
    return lambda t: {k: v for k, v in t.items() if k != name}


@pytest.mark.parametrize("broken, refusal", [
    (misshaped_gate_up, r"model.layers.0.mlp.experts.gate_up_proj: shape \[4, 64, 64\] expected, got \[4, 63, 64\]"),
    (fused_and_per_expert, "the checkpoint holds model.layers.0.mlp.experts.2.down_proj.weight both on its own "
                           "and in model.layers.0.mlp.experts.down_proj"),
    (without("model.layers.0.mlp.experts.down_proj"), "missing tensor model.layers.0.mlp.experts.0.down_proj.weight"),
], ids=["misshaped", "both-layouts", "missing"])
def test_a_broken_fused_checkpoint_is_refused_by_name_and_changes_nothing(saved, tmp_path, broken, refusal):
    from gateeng.engine.errors import WeightsRefused
    from gateeng.model.loader import load
    bad = rewrite(saved, tmp_path / "bad", lambda _: broken(fused_state(seed=1)))
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    engine = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=load(str(saved), "bfloat16"))
    try:
        before = engine.generate(SEQS[1], params, VERIFIED), engine.reproducibility.model_fingerprint
        with pytest.raises(WeightsRefused, match=refusal):
            engine.update_weights(bad)
        after = engine.generate(SEQS[1], params, VERIFIED), engine.reproducibility.model_fingerprint
        assert engine.weight_version == 0
    finally:
        engine.shutdown()
    assert (after[0].token_ids, after[0].logprobs, after[1]) == (before[0].token_ids, before[0].logprobs, before[1])


def one_call_and_per_op(plan, model, x: torch.Tensor, layer) -> tuple:
    """A routing layer on rows x by the reference's one call (plan.moe_layer) and by the
    per-op path (LlamaModel._moe with no one call: router_logits, route, each expert's
    linear, silu_mul, linear, then combine): each (output, router margins)."""
    got = plan.moe_layer(model, x, layer)
    assert got is not None
    meta = type("Meta", (), {"router_margin": None})()
    plan.moe_layer = lambda *a: None   # the instance's: the per-op path
    try:
        want = model._moe(plan, x, layer, meta)
    finally:
        del plan.moe_layer
    return got, (want, meta.router_margin)


def assert_one_call_is_per_op(loaded, tie: bool = True) -> None:
    """The reference's one-call routing layer gives the per-op path's output and router
    margins bit for bit, in every routing layer, at 1 row and at several (rows sharing
    experts and not), and with router rows 1 and 2 equal (a tie at the k-th place)."""
    from gateeng.plans.reference import ReferencePlan
    model = loaded.model
    gen = torch.Generator().manual_seed(3)
    layers = [layer for layer in model.step_layers if layer.experts is not None]
    assert layers
    for tied in (False, True) if tie else (False,):
        if tied:
            for layer in layers:
                with torch.no_grad():
                    layer.router[2] = layer.router[1]
        plan = ReferencePlan(model, reference_ops.load())
        for rows in (1, 2, 7, 64):
            x = (torch.randn(rows, model.cfg.hidden_size, generator=gen) * 2).to(torch.bfloat16)
            x[rows // 2] = x[0]   # rows with the same experts
            for layer in layers:
                (out, margins), (want, want_margins) = one_call_and_per_op(plan, model, x, layer)
                assert out.dtype == torch.bfloat16 and out.shape == x.shape and out.abs().sum() > 0
                assert torch.equal(out.view(torch.int16), want.view(torch.int16))
                assert torch.equal(margins.view(torch.int32), want_margins.view(torch.int32))
                if tied and rows == 64:
                    assert (margins == 0).any()   # some row's k-th place is the tie


def test_the_references_one_call_routing_layer_is_the_per_op_path(family):
    _, hf = family
    assert_one_call_is_per_op(tiny_loaded("bfloat16", hf))
