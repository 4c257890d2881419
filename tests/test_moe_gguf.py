"""Mixtures of experts from GGUF files as llama.cpp writes them (tests/tiny_gguf.py:
Qwen3-MoE as qwen3moe, Mixtral as llama with experts; OLMoE in tests/test_olmoe_gguf.py): a bf16 file is
the model of its Hugging Face directory (config, weights, VERIFIED answers); Q8_0, Q4_0
and Q4_1 experts (and K-quant ones) are served as stored, each expert once, and give the same VERIFIED
answer alone and in a batch; broken or unserved files are refused by name."""
import contextlib
import shutil
import types

import numpy as np
import pytest
import torch

from gateeng.config import SOFTMAX_TOPK, EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model import families, loader
from gateeng.model.gguf_weights import GGUFLoad, GGUFTensors
from gateeng.model.llama import LlamaModel
from gateeng.plans import packing, reference_ops
from gateeng.plans.generic import FastPlan
from gateeng.request import DeterminismParams, Mode, SamplingParams
from test_model import prefill_logits
from test_model_families import SEQS, TINY
from test_moe import assert_one_call_is_per_op
from tiny import hf_family
from tiny_gguf import byte_tokenizer_kv, moe_tensors, write_file, write_tiny_moe_gguf

VERIFIED = DeterminismParams(Mode.VERIFIED)
PARAMS = SamplingParams(max_tokens=12, ignore_eos=True)
# Each family's file, and how its weights are stored: bf16 throughout, or its experts
# quantized beside bf16 attention (the llama-quantize mixes of a MoE keep more in 8 bits).
# (K-quant rows are 256 values: that file's hidden size and expert width are 256.)
FILES = {"qwen3_moe-bf16": ("qwen3_moe", "BF16"), "mixtral-bf16": ("mixtral", "BF16"),
         "mixtral-q4": ("mixtral", {"*_exps.weight": "Q4_0", "*": "BF16"}),
         "qwen3_moe-q8": ("qwen3_moe", {"*ffn_down_exps.weight": "Q4_1", "*_exps.weight": "Q8_0", "*": "Q8_0"}),
         "olmoe-q4": ("olmoe", {"*_exps.weight": "Q4_0", "*": "BF16"}),
         "mixtral-k": ("mixtral", {"*ffn_down_exps.weight": "Q6_K", "*_exps.weight": "Q4_K", "*": "BF16"},
                       dict(hidden_size=256, intermediate_size=256)),
         # gate and up in different types: each expert's gate_up a stack of two parts
         "qwen3_moe-mixed": ("qwen3_moe", {"*ffn_gate_exps.weight": "Q4_0", "*ffn_up_exps.weight": "Q8_0",
                                           "*ffn_down_exps.weight": "Q4_1", "*": "BF16"})}


def tiny_moe(family: str, seed: int = 0, **over):
    """A tiny random mixture of experts as llama.cpp can write it: every layer routes
    (llama.cpp's graphs have no plain-MLP layers in these architectures), and its
    special ids are byte_tokenizer_kv's."""
    over.update(bos_token_id=254, eos_token_id=255)
    if family == "qwen3_moe":
        over["mlp_only_layers"] = []
    return hf_family(family, seed, **over)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    where = tmp_path_factory.mktemp("moe_gguf")
    out = {}
    for name, (family, qtype, *over) in FILES.items():
        hf = tiny_moe(family, **(over[0] if over else {}))
        out[name] = dict(write_tiny_moe_gguf(where / f"{name}.gguf", hf, qtype), hf=hf)
    return out


def answers(loaded, prompt=SEQS[0]):
    """The reference's answer, and VERIFIED answers alone and in a batch whose other rows
    route tokens to the same experts, from a noisy fast path (rollbacks happen)."""
    ref = Engine(EngineConfig(dtype="bfloat16", plan="invariant", **TINY), loaded=loaded)
    try:
        want = ref.generate(prompt, PARAMS).token_ids
    finally:
        ref.shutdown()
    engine = Engine(EngineConfig(dtype="bfloat16", fast_logit_noise=0.5, **TINY), loaded=loaded)
    try:
        alone = engine.generate(prompt, PARAMS, VERIFIED).token_ids
        batch = engine.generate([SEQS[1], prompt, SEQS[2]], PARAMS, [None, VERIFIED, None])[1].token_ids
    finally:
        engine.shutdown()
    return want, alone, batch


@pytest.mark.parametrize("name", ["qwen3_moe-bf16", "mixtral-bf16"])
def test_a_bf16_gguf_is_its_hf_directorys_model(files, name, tmp_path, capsys):
    f = files[name]
    hf_dir = tmp_path / "hf"
    f["hf"].save_pretrained(hf_dir, safe_serialization=True)
    got = loader.load(str(f["path"]))
    err = capsys.readouterr().err
    header = loader.gguf_header(f["path"])
    for tok in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(header / tok, hf_dir / tok)
    want = loader.load(str(hf_dir))
    assert got.config == want.config and got.config.moe is not None
    assert got.config.moe.sparse_layers == (0, 1)
    assert "no tensor served as stored" in err and "F32/F16/BF16 tensors in bf16" in err, err
    for (n, a), (_, b) in zip(got.model.named_parameters(), want.model.named_parameters()):
        assert torch.equal(a, b), n
    ours, theirs = answers(got), answers(want)
    assert ours == theirs and len(set(map(tuple, ours))) == 1


@pytest.mark.parametrize("name,stored", [("mixtral-q4", {"Q4_0": 6}), ("qwen3_moe-q8", {"Q4_1": 2, "Q8_0": 14}),
                                         ("mixtral-k", {"Q4_K": 4, "Q6_K": 2})])
def test_quantized_experts_are_served_as_stored(files, name, stored, capsys):
    loaded = loader.load(str(files[name]["path"]))
    err = capsys.readouterr().err
    assert packing.of(loaded.model).stored_types == stored
    assert "served as stored" in err and "dequantized" not in err, err
    # Each expert's matrices are held once, in the reference's packed copy of its stored blocks.
    held = packing.of(loaded.model).shared
    for layer in loaded.model.layers:
        for expert in layer.experts:
            for w in (expert.gate_up, expert.down):
                assert id(w) in held and w.untyped_storage().nbytes() == 0
        assert layer.router.dtype == torch.bfloat16 and layer.router.untyped_storage().nbytes() > 0
    want, alone, batch = answers(loaded)
    assert alone == want and batch == want
    # Dequantized to bf16 it is another model, named so.
    deq = loader.load(str(files[name]["path"]), dequantize=True)
    assert not packing.quantized(deq.model) and deq.fingerprint != loaded.fingerprint
    assert "dequantized to bf16 (not served as stored)" in capsys.readouterr().err
    assert loader.load(str(files[name]["path"])).fingerprint == loaded.fingerprint


@contextlib.contextmanager
def int8_fast_plan(files, name):
    """(the fast plan, the model) of an engine serving file `name`; skipped where the
    CPU has no int8 AVX2 kernels."""
    loaded = loader.load(str(files[name]["path"]))
    engine = Engine(EngineConfig(dtype="bfloat16", **TINY), loaded=loaded)
    try:
        plan = engine.core.fast_plan
        if plan.kernels is None or not getattr(plan.kernels, "qavx2", False):
            pytest.skip("no int8 AVX2 kernels on this CPU")
        yield plan, loaded.model
    finally:
        engine.shutdown()


@pytest.mark.parametrize("name", ["mixtral-q4", "qwen3_moe-q8", "mixtral-k"])
def test_the_fast_plans_one_call_experts_are_each_rows_experts_combined(files, name):
    """cpu_ops' moe_experts (a routing layer's experts in one call, as moe_layer runs them) gives each row the
    weighted sum of its own experts' MLPs on the int8 kernels, whatever the other rows
    chose: the same as each (row, expert) pair multiplied alone, summed in binary32."""
    with int8_fast_plan(files, name) as (plan, model):
        moe = model.cfg.moe
        gen = torch.Generator().manual_seed(0)
        for layer in model.step_layers:
            rows = 7
            x = torch.randn(rows, model.cfg.hidden_size, generator=gen).to(torch.bfloat16)
            chosen = torch.stack([torch.randperm(moe.num_experts, generator=gen)[:moe.top_k].sort().values
                                  for _ in range(rows)])
            chosen[3] = chosen[0]   # rows sharing experts
            weights = torch.rand(rows, moe.top_k, generator=gen)
            gate_up, down, gate_up_n, down_n = packing.of(model).expert_layers[id(layer.experts[0][0])]
            got = plan.kernels.moe_experts(x, chosen, weights, gate_up, down, gate_up_n, down_n,
                                           bool(getattr(plan.kernels, "qvnni", False)))
            assert got is not None and got.shape == x.shape and got.dtype == torch.bfloat16
            want = torch.zeros(rows, x.shape[1])
            for r in range(rows):
                for i, e in enumerate(chosen[r].tolist()):
                    gate_up, down = layer.experts[e]
                    y = plan.linear(plan.silu_mul(plan.linear(x[r:r + 1], gate_up)), down)
                    want[r] += weights[r, i] * y[0].float()
            torch.testing.assert_close(got.float(), want.to(torch.bfloat16).float(), rtol=2 ** -7, atol=1e-6)
            assert got.float().abs().sum() > 0


def test_quantized_experts_are_refused_across_ranks_at_start_up(files):
    loaded = loader.load(str(files["mixtral-q4"]["path"]))
    with pytest.raises(ValueError, match="too few for every one of 2 ranks.*--dequantize at this tensor-parallel size"):
        Engine(EngineConfig(tensor_parallel_size=2, num_kv_blocks=96, num_threads=1), loaded=loaded)


def broken(files, tmp_path, name: str, change) -> GGUFTensors:
    """The file `name` written again with its tensors changed by `change` ({gguf name:
    array} -> the same), read by the native reader."""
    family = FILES[name][0]
    hf = files[name]["hf"]
    arch = families.FAMILIES[family].gguf
    tensors = change(dict(moe_tensors(hf, arch)))
    path = tmp_path / f"broken-{name}.gguf"

    def experts(writer):
        writer.add_expert_count(4)
        writer.add_expert_used_count(2)

    write_file(path, arch, "broken", hf, [(g, w, "F32") for g, w in tensors.items()], {"*": "F32"}, experts,
               byte_tokenizer_kv())
    return GGUFTensors(path)


def load_into(files, tensors: GGUFTensors, name: str):
    cfg = loader.load(str(files[name]["path"])).config
    model = LlamaModel(cfg, torch.bfloat16)
    model.finalize()
    GGUFLoad(tensors, cfg, reference_ops.load()).into(model)


def test_a_broken_moe_gguf_is_refused_naming_the_tensor(files, tmp_path):
    def no_router(t):
        del t["blk.1.ffn_gate_inp.weight"]
        return t

    def short_expert(t):
        t["blk.0.ffn_up_exps.weight"] = t["blk.0.ffn_up_exps.weight"][:3]   # 3 experts of 4
        return t

    def shared_expert(t):
        t["blk.0.ffn_gate_shexp.weight"] = np.zeros((32, 64), np.float32)
        return t

    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_gate_inp\.weight is missing"):
        load_into(files, broken(files, tmp_path, "mixtral-bf16", no_router), "mixtral-bf16")
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_up_exps\.weight has shape \(3, 32, 64\), "
                                         r"expected \(4, 32, 64\)"):
        load_into(files, broken(files, tmp_path, "qwen3_moe-bf16", short_expert), "qwen3_moe-bf16")
    with pytest.raises(ValueError, match=r"tensor blk\.0\.ffn_gate_shexp\.weight is not part of a qwen3moe "
                                         "mixture of experts"):
        load_into(files, broken(files, tmp_path, "qwen3_moe-bf16", shared_expert), "qwen3_moe-bf16")


def test_a_qwen3moe_gguf_with_a_plain_mlp_layer_is_refused_naming_its_tensor(tmp_path):
    """llama.cpp's qwen3moe graph routes every layer, and its metadata has no
    mlp_only_layers or decoder_sparse_step: a file whose layer 1 holds a plain MLP
    (tests/tiny.py's Qwen3-MoE, quantized experts beside it) is refused naming that
    layer's tensor, never served with another layout. (Its Hugging Face directory is
    served, VERIFIED alone and in a batch equal to the reference: tests/test_moe.py.)"""
    hf = hf_family("qwen3_moe", bos_token_id=254, eos_token_id=255)
    assert hf.config.mlp_only_layers == [1]
    path = write_tiny_moe_gguf(tmp_path / "plain-layer.gguf", hf, "Q8_0")["path"]
    with pytest.raises(ValueError, match=r"tensor blk\.1\.ffn_down\.weight is not part of a qwen3moe mixture of "
                                         "experts gateeng serves"):
        loader.load(str(path))


def test_unserved_moe_architectures_and_metadata_are_refused_by_name():
    with pytest.raises(ValueError, match="mixture-of-experts GGUF of architecture 'qwen2moe' is not served"):
        families.gguf_family("qwen2moe", True)
    with pytest.raises(ValueError, match="mixture-of-experts GGUF of architecture 'deepseek2' is not served"):
        families.gguf_family("deepseek2", True)
    assert families.gguf_family("olmoe", True) is families.FAMILIES["olmoe"]   # tests/test_olmoe_gguf.py
    with pytest.raises(ValueError, match="GGUF architecture 'qwen3moe' is not read natively"):
        families.gguf_family("qwen3moe", False)
    qwen = families.FAMILIES["qwen3_moe"]
    meta = {"expert_count": 8, "expert_used_count": 2, "expert_feed_forward_length": 64}
    assert qwen.gguf_config(meta)["norm_topk_prob"] is True   # llama.cpp's qwen3moe graph renormalizes
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_shared_count=1 is not supported"):
        qwen.gguf_config(dict(meta, expert_shared_count=1))
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_gating_func=2 is not supported"):
        qwen.gguf_config(dict(meta, expert_gating_func=2))
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_feed_forward_length is missing"):
        qwen.gguf_config({"expert_count": 8, "expert_used_count": 2})
    mixtral = families.FAMILIES["mixtral"].gguf_config({"expert_count": 8, "expert_used_count": 2,
                                                         "feed_forward_length": 96})
    assert (mixtral["model_type"], mixtral["num_local_experts"], mixtral["intermediate_size"]) == ("mixtral", 8, 96)


def test_a_moe_gguf_is_refused_in_float32(files):
    """transformers converts no mixture of experts' GGUF; the native reader serves bf16."""
    with pytest.raises(ValueError, match=r"mixtral-q4\.gguf is a mixture of experts, read natively only: serve it "
                                         r"in bfloat16 on CPU \(not float32 on cpu\)"):
        loader.load(str(files["mixtral-q4"]["path"]), "float32")


@pytest.mark.parametrize("name", ["mixtral-q4", "qwen3_moe-q8", "olmoe-q4"])
def test_the_fast_plans_routing_follows_the_references_rule(files, name):
    """cpu_ops' moe_layer routes by the family's rule in its own arithmetic: on random
    rows away from ties it picks the reference's experts (moe_route, kernels/SPEC.md),
    with weights and margins close to the reference's; on a tie the lower expert id
    wins; its output is those experts' moe_experts; a NaN router logit is refused."""
    with int8_fast_plan(files, name) as (plan, model):
        moe, ref = model.cfg.moe, reference_ops.load()
        softmax_first = moe.routing == SOFTMAX_TOPK
        vnni = bool(getattr(plan.kernels, "qvnni", False))
        gen = torch.Generator().manual_seed(1)
        layer = model.step_layers[0]
        experts = packing.of(model).expert_layers[id(layer.experts[0][0])]

        def both(x, router):
            got = plan.kernels.moe_layer(x, router, moe.top_k, softmax_first, moe.norm_topk_prob, *experts, vnni)
            want = ref.moe_route(torch.nn.functional.linear(x.float(), router.float()), moe.top_k, softmax_first,
                                 moe.norm_topk_prob)
            return got, want
        x = torch.randn(200, model.cfg.hidden_size, generator=gen).to(torch.bfloat16)
        (out, margins, ids, weights), (want_ids, want_weights, want_margins) = both(x, layer.router)
        far = want_margins > 1e-3 * (1 if softmax_first else 10)
        assert far.sum() > 150
        assert torch.equal(ids[far], want_ids[far])
        assert torch.equal(ids, ids.sort(-1).values)
        torch.testing.assert_close(weights[far], want_weights[far], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(margins, want_margins, rtol=1e-3, atol=1e-5)
        assert torch.equal(out, plan.kernels.moe_experts(x, ids, weights, *experts, vnni))
        assert out.float().abs().sum() > 0
        # Ties: experts 1 and 2 share a router row, both ranked after expert 0's and
        # before expert 3's: the k-th place goes to expert 1 (lower id), margin 0.
        router = layer.router.clone()
        e = moe.num_experts
        base = torch.randn(model.cfg.hidden_size, generator=gen)
        rows = torch.stack([base * (e - j) for j in range(e)]).to(torch.bfloat16)
        rows[2] = rows[1]
        xt = (base / base.norm()).to(torch.bfloat16)[None].repeat(3, 1)
        router.copy_(rows)
        (_, tie_margins, tie_ids, _), (ref_ids, _, _) = both(xt, router)
        assert moe.top_k == 2 and e == 4
        assert tie_ids.tolist() == [[0, 1]] * 3 == ref_ids.tolist() and tie_margins.tolist() == [0.0] * 3
        router[3] = float("nan")
        with pytest.raises(RuntimeError, match="router logit is not finite"):
            plan.kernels.moe_layer(xt, router, moe.top_k, softmax_first, moe.norm_topk_prob, *experts, vnni)


@pytest.mark.parametrize("name", ["qwen3_moe-q8", "mixtral-q4", "mixtral-k", "olmoe-q4"])
def test_one_call_decode_layers_of_a_mixture_of_experts_give_the_op_by_op_bits(files, name):
    """On quantized experts the fast plan's C++ decode layers (a decode step in one call:
    q/k norms, routing and experts included) run the same kernels in the same order as
    the op-by-op forward (moe_layer per routing layer): the same logits and router
    margins, bit for bit."""
    with int8_fast_plan(files, name) as (engine_plan, model):
        stored = packing.of(model)
        assert stored.fused_layers is not None and stored.fused_layers.routing is not None
        plan = FastPlan(0.0, stored.packed, engine_plan.kernels, stored.dense_head)
        metas, make_meta = [], plan._meta
        plan._meta = lambda *a: metas.append(make_meta(*a)) or metas[-1]
        one_call, calls = plan.decode_layers, []
        plan.decode_layers = lambda *a: calls.append(one_call(*a)) or calls[-1]
        seqs = [list(range(5, 30)), [7, 3, 9, 11, 200, 13], list(range(100, 110))]
        loaded = types.SimpleNamespace(model=model, config=model.cfg)
        fused = prefill_logits(loaded, plan, seqs, chunk=1)   # one row per sequence a step: decode steps
        fused_margins = [m.router_margin for m in metas]
        assert calls and all(c is not None for c in calls)
        fused_layers, stored.fused_layers = stored.fused_layers, None
        try:
            metas.clear()
            op_by_op = prefill_logits(loaded, plan, seqs, chunk=1)
        finally:
            stored.fused_layers = fused_layers
        assert all(torch.equal(a, b) for a, b in zip(fused, op_by_op))
        assert len(fused_margins) == len(metas) and all(torch.equal(a, m.router_margin)
                                                        for a, m in zip(fused_margins, metas))
        assert all(bool((m >= 0).all()) for m in fused_margins)


@pytest.mark.parametrize("name", ["qwen3_moe-bf16", "mixtral-q4", "qwen3_moe-q8", "olmoe-q4", "mixtral-k",
                                  "qwen3_moe-mixed"])
def test_the_references_one_call_routing_layer_is_the_per_op_path_on_stored_experts(files, name):
    """bf16 experts, and experts served as stored (Q4_0; Q8_0 with Q4_1; the K-quants; gate
    and up in two types), through the reference's one call and its per-op path alike."""
    loaded = loader.load(str(files[name]["path"]))
    if name == "qwen3_moe-mixed":
        layer = loaded.model.step_layers[0]
        assert len(packing.of(loaded.model).shared[id(layer.experts[0][0])].parts) == 2
    assert_one_call_is_per_op(loaded)
