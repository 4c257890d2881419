"""A GGUF with K-quants (Q4_K, Q5_K, Q6_K) served as stored: the weights stay in their
blocks and the reference multiplies them (kernels/SPEC.md, "Quantized weights"); a
stack whose parts differ in type (llama.cpp's Q4_K_M: v in Q6_K beside q and k in
Q4_K) too, part by part; VERIFIED answers are the same alone, in a batch, on either
plan and on every CPU build."""
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model import loader
from gateeng.plans import cpu_linear, cpu_ops, packing, reference_ops
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE
from gateeng.request import DeterminismParams, Mode, SamplingParams
from tests.tiny_gguf import write_tiny_gguf

# Every projection as stored: q, k, v and o in Q4_K, gate and up in Q5_K, down and the
# lm_head in Q6_K (a Q4_K embedding).
K_MIX = {"blk.*.ffn_down.weight": "Q6_K", "blk.*.ffn_gate.weight": "Q5_K", "blk.*.ffn_up.weight": "Q5_K",
         "output.weight": "Q6_K", "*": "Q4_K"}
# llama-quantize's Q4_K_M mix in spirit: v in Q6_K beside q and k in Q4_K (a stack of two types).
Q4_K_M = {"blk.*.attn_v.weight": "Q6_K", "blk.*.ffn_down.weight": "Q6_K", "output.weight": "Q6_K", "*": "Q4_K"}
# Every stack of several types: q, k, v in three; gate and up in two.
STACKS = {"blk.*.attn_k.weight": "Q5_K", "blk.*.attn_v.weight": "Q6_K", "blk.*.ffn_gate.weight": "Q6_K",
          "output.weight": "Q6_K", "*": "Q4_K"}
SHAPE = dict(hidden=256, heads=2, kv_heads=1, head_dim=128, intermediate=512, tie=False)
VERIFIED = DeterminismParams(Mode.VERIFIED)
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
PROMPT = [1, 500, 9000, 77, 4242, 31000]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    where = tmp_path_factory.mktemp("kquant")
    return {"mix": write_tiny_gguf(where / "tiny-kmix.gguf", K_MIX, **SHAPE),
            "q4_k_m": write_tiny_gguf(where / "tiny-q4_k_m.gguf", Q4_K_M, seed=1, **SHAPE),
            "stacks": write_tiny_gguf(where / "tiny-stacks.gguf", STACKS, seed=2, **SHAPE)}


def bits(c) -> tuple:
    return tuple(c.token_ids), tuple(lp.logprob.hex() for lp in c.logprobs)


def test_k_quants_are_served_as_stored_and_the_log_says_so(files, capsys):
    loaded = loader.load(str(files["mix"]["path"]))
    # 2 layers: q, k, v, o in Q4_K (and the embedding); gate, up in Q5_K; down (and the lm_head) in Q6_K
    assert packing.of(loaded.model).stored_types == {"Q4_K": 9, "Q5_K": 4, "Q6_K": 3}
    err = capsys.readouterr().err
    assert "9 Q4_K, 4 Q5_K, 3 Q6_K tensors served as stored" in err and "dequantized" not in err, err
    deq = loader.load(str(files["mix"]["path"]), dequantize=True)
    assert not packing.quantized(deq.model) and deq.fingerprint != loaded.fingerprint
    assert loader.load(str(files["mix"]["path"])).fingerprint == loaded.fingerprint
    # the embedding's rows are the file's values rounded to bf16, as the dequantized model's
    ids = torch.tensor([0, 7, 49151])
    assert torch.equal(packing.embed_rows(loaded.model, ids), packing.embed_rows(deq.model, ids))


def test_stacks_of_several_types_are_served_as_stored_part_by_part(files, capsys):
    loaded = loader.load(str(files["q4_k_m"]["path"]))
    # per layer q, k, o, gate, up in Q4_K and v, down in Q6_K; the embedding, the lm_head
    assert packing.of(loaded.model).stored_types == {"Q4_K": 11, "Q6_K": 5}
    err = capsys.readouterr().err
    assert "11 Q4_K, 5 Q6_K tensors served as stored" in err and "dequantized" not in err, err
    stored = packing.of(loaded.model)
    qkv = stored.shared[id(loaded.model.layers[0].qkv)]   # q and k packed together, v apart
    assert [(p.n, stored.quant_ops.qtype(p.data)) for p in cpu_linear.parts(qkv)] == [(256 + 128, 12), (128, 14)]
    stacks = loader.load(str(files["stacks"]["path"]))
    layer = stacks.model.layers[1]
    stored = packing.of(stacks.model)
    kinds = {name: [stored.quant_ops.qtype(p.data) for p in cpu_linear.parts(stored.shared[id(w)])]
             for name, w in (("qkv", layer.qkv), ("gate_up", layer.gate_up))}
    assert kinds == {"qkv": [12, 13, 14], "gate_up": [14, 12]}
    assert "dequantized" not in capsys.readouterr().err
    # read back part by part, a stack's values are each part's: those the dequantized model holds
    deq = loader.load(str(files["stacks"]["path"]), dequantize=True)
    assert torch.equal(packing.plain(stacks.model, layer.gate_up), deq.model.layers[1].gate_up)


@pytest.mark.parametrize("name", ["mix", "q4_k_m", "stacks"])
def test_verified_answers_are_the_same_alone_in_a_batch_and_on_either_plan(files, name):
    """The fast plan's VERIFIED answers (checked against the reference's by the
    verifier) equal the invariant plan's, alone and in a batch, and follow the file."""
    from transformers import AutoModelForCausalLM
    path = files[name]["path"]
    answers = {}
    for plan in ("fast", "invariant"):
        # The speculative route: the fast plan's VERIFIED tokens are its own, checked by
        # the reference (the adaptive route may decode them on the reference directly),
        # and the start prices no routes.
        loaded = loader.load(str(path))
        engine = Engine(EngineConfig(plan=plan, num_kv_blocks=64, max_model_len=128, verified_route="speculative"),
                        loaded=loaded)
        try:
            kernels = cpu_ops.load()
            if plan == "fast" and getattr(kernels, "qavx2", False):   # no Python between the layers' matmuls
                int8 = (kernels.qlinear_k_avx2, getattr(kernels, "qlinear_k_vnni", None), kernels.qlinear_int8)
                assert packing.of(loaded.model).fused_layers.matmul in int8
            alone = engine.submit(PROMPT, PARAMS, VERIFIED).result()
            many = engine.submit_many([[5, 6, 7, 8, 9], PROMPT, PROMPT[:3]], [PARAMS] * 3, VERIFIED)
            assert bits(many[1].result()) == bits(alone)
            assert f"{REFERENCE} (" in alone.reproducibility.kernel_plan
            assert "Q4_K" in alone.reproducibility.kernel_plan and "Q6_K" in alone.reproducibility.kernel_plan
            answers[plan] = bits(alone)
        finally:
            engine.shutdown()
    assert answers["fast"] == answers["invariant"]
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0, -1]
    assert int(want.argmax()) == answers["invariant"][0][0]


def test_every_cpu_build_gives_the_same_verified_answers(files, monkeypatch):
    builds = reference_ops.runnable()
    if len(builds) < 2:
        pytest.skip("this CPU runs only the scalar build")
    answers = {}
    for isa in builds:
        monkeypatch.setenv(ISA_ENV, isa)
        engine = Engine(EngineConfig(plan="invariant", num_kv_blocks=64, max_model_len=128),
                        loaded=loader.load(str(files["mix"]["path"])))
        try:
            answers[isa] = [bits(engine.submit(p, PARAMS, VERIFIED).result()) for p in (PROMPT, [3, 1, 4, 1, 5])]
        finally:
            engine.shutdown()
    assert all(a == answers["scalar"] for a in answers.values()), answers


@pytest.mark.kernels
def test_the_triton_reference_keeps_k_quants_as_stored(files):
    """load_gguf(blocks_on=...): the Triton reference's form of a K-quant file (every
    projection of one type per stack) holds each weight's integers and scales
    (QuantBlocks), with the fingerprint and kernel_plan of the file served by the CPU
    reference, and looks its Q4_K embedding up as the CPU reference does. (Its matmul
    is held to the CPU build in tests/test_kquant_kernels.py.)"""
    from gateeng.plans.gpu import TritonReferencePlan
    from gateeng.plans.reference import ReferencePlan
    path = files["mix"]["path"]
    cpu, blocks = loader.load_gguf(path), loader.load_gguf(path, blocks_on="cpu")
    assert cpu.fingerprint == blocks.fingerprint
    stored = packing.of(blocks.model).blocks
    assert len(stored) == 2 * 4 + 2 and not packing.of(blocks.model).shared   # qkv, o, gate_up, down; embed, head
    down = stored[id(blocks.model.layers[0].down)]
    assert down.sc.shape == (256, 512 // 16) and down.m is None and down.mn is None   # Q6_K: 16 sub-blocks of 16
    gate = stored[id(blocks.model.layers[0].gate_up)]
    assert gate.d.shape == gate.m.shape == (1024, 1) and gate.mn.shape == (1024, 8)
    ref, tri = ReferencePlan(cpu.model, reference_ops.load(), 4), TritonReferencePlan(4, blocks.model)
    assert tri.describe() == ref.describe() == f"{REFERENCE} (Q4_K, Q5_K, Q6_K weights)"
    ids = torch.tensor([0, 7, 49151, 7])
    assert torch.equal(tri.embed(blocks.model, ids).view(torch.int16), ref.embed(cpu.model, ids).view(torch.int16))
