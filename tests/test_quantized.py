"""A GGUF served as stored: Q8_0, Q4_0 and Q4_1 weights (the K-quants:
tests/test_kquant_serving.py) stay quantized and are
multiplied by the reference (kernels/SPEC.md, "Quantized weights"), in every build,
in both plans; other types are converted to bf16 and named in the log; what is not
served quantized fails closed."""
import os

import numpy as np
import pytest
import torch

from gateeng.config import EngineConfig
from gateeng.engine.engine import Engine
from gateeng.model import loader
from gateeng.plans import packing, reference_ops
from gateeng.plans.kernel_names import REFERENCE, REFERENCE_ISAS
from gateeng.request import DeterminismParams, Mode, SamplingParams

TYPES = {"Q8_0": 8, "Q4_0": 2, "Q4_1": 3}
BUILDS = [pytest.param(isa, marks=pytest.mark.skipif(isa not in reference_ops.runnable(),
                                                      reason=f"this CPU cannot run the {isa} build"))
          for isa in REFERENCE_ISAS]


@pytest.fixture(scope="module")
def files(tiny_gguf):
    out = {t: tiny_gguf(t) for t in TYPES}
    out["mixed"] = tiny_gguf({"blk.*.ffn_down.weight": "Q5_0", "*": "Q4_0"}, tie=False, intermediate=256, seed=1)
    return out


def stored(gguf_type: str, n: int, k: int, seed: int = 0):
    """(GGUF rows [n, row bytes], the integers [n, k], scales [n, k/32], minimums or None)."""
    from gguf import GGMLQuantizationType, quants
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((n, k)).astype(np.float32)
    w[1] *= 2.0 ** -20            # scales near binary16's smallest
    raw = quants.quantize(w, GGMLQuantizationType[gguf_type]).view(np.uint8).reshape(n, -1)
    blocks = raw.reshape(n, k // 32, -1)
    d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0]
    m = blocks[:, :, 2:4].copy().view(np.float16)[:, :, 0] if gguf_type == "Q4_1" else None
    qs = blocks[:, :, 4 if m is not None else 2:]
    if gguf_type == "Q8_0":
        q = qs.view(np.int8).reshape(n, k).astype(np.int64)
    else:
        n4 = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k).astype(np.int64)
        q = n4 if m is not None else n4 - 8
    return np.ascontiguousarray(raw), q, d, m


@pytest.mark.parametrize("isa", BUILDS)
@pytest.mark.parametrize("gguf_type", list(TYPES))
def test_every_build_multiplies_quantized_weights_as_the_oracle(gguf_type, isa):
    from tests import oracle
    ops = reference_ops.load(isa)
    for n, k, m in ((37, 96, 3), (21, 576, 2)):
        raw, q, d, mins = stored(gguf_type, n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
        x[0, :7] = 2.0 ** -128                    # denormal inputs: read as zero
        x[1, 32:64] = x[1, :32]                   # cancellations across blocks
        x[1, 64:66] = 2.0 ** -114                 # the smallest inputs the AVX2 4-bit kernel scales
        packed = ops.qpack(torch.from_numpy(raw), TYPES[gguf_type])
        blocks = reference_ops.exact_block_inputs(k, seed=n).split(1)   # each path of the AVX2 one-row tiles
        cases = [(x, True), (x, False), (tiny_normal(x), True)] + [(b, f32) for b in blocks for f32 in (True, False)]
        for x, f32 in cases:
            xb = x.view(torch.int16).numpy().view(np.uint16)
            got = ops.qlinear(x, packed, n, f32)
            want = oracle.qlinear(xb, q, d, mins, f32=f32)
            assert np.array_equal(got.view(torch.int32 if f32 else torch.int16).numpy(),
                                  np.asarray(want).view(np.int32 if f32 else np.int16)), (gguf_type, n, k, f32)
            assert torch.equal(got, ops.linear(x, packed, n, f32))   # linear takes a quantized packed weight
            assert torch.equal(got, ops.qlinear(x, packed, n, f32, True))   # the portable loops
        rows = ops.qrows(packed, torch.arange(n))
        assert np.array_equal(rows.view(torch.int16).numpy(), np.asarray(oracle.qvalues(q, d, mins)).view(np.int16))


def tiny_normal(x: torch.Tensor) -> torch.Tensor:
    """x with normal inputs below 2^-114, whose x / 4096 would be denormal: the AVX2
    build's 4-bit kernel multiplies such a call's integers unscaled (ref_ops.cpp
    scaled_nibbles); the bits are the spec's either way."""
    x = x.clone()
    x[0] = reference_ops.tiny_normals(x.shape[1])
    return x


def test_a_gguf_is_served_as_stored_by_default(files):
    loaded = loader.load(str(files["Q4_0"]["path"]))
    # GGUF tensors: embed (tied) + 7 per layer
    assert packing.quantized(loaded.model) and packing.of(loaded.model).stored_types == {"Q4_0": 15}
    deq = loader.load(str(files["Q4_0"]["path"]), dequantize=True)
    assert not packing.quantized(deq.model)
    assert loaded.fingerprint != deq.fingerprint, "the same file served two ways is two models"
    assert loader.load(str(files["Q4_0"]["path"])).fingerprint == loaded.fingerprint
    # float32 serves the file dequantized (the log says so)
    assert not packing.quantized(loader.load(str(files["Q4_0"]["path"]), dtype="float32").model)


@pytest.mark.parametrize("gguf_type", list(TYPES))
def test_quantized_logits_follow_the_file_and_the_plans_agree(files, gguf_in_transformers, gguf_type):
    """Logits of the quantized model are close to transformers' on the dequantized file,
    and the fast plan, the reference and a batch give the same VERIFIED tokens."""
    path = files[gguf_type]["path"]
    loaded = loader.load(str(path))
    hf = gguf_in_transformers(path)
    prompt = [1, 500, 9000, 77, 4242, 31000]
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1]
    # The speculative route: every VERIFIED token comes from the fast plan, checked by the
    # reference (the adaptive route may decode them on the reference directly), and the
    # start prices no routes.
    engine = Engine(EngineConfig(plan="fast", num_kv_blocks=64, max_model_len=128, verified_route="speculative"),
                    loaded=loaded)
    verified, params = DeterminismParams(Mode.VERIFIED), SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    try:
        alone = engine.submit(prompt, params, verified).result()
        many = engine.submit_many([prompt, prompt[:3], [5, 6, 7, 8, 9]], [params] * 3, verified)
        assert many[0].result().token_ids == alone.token_ids
        assert [lp.logprob for lp in many[0].result().logprobs] == [lp.logprob for lp in alone.logprobs]
        record = alone.reproducibility
        assert f"{REFERENCE} ({gguf_type} weights)" in record.kernel_plan
        assert record.model_fingerprint == loaded.fingerprint
    finally:
        engine.shutdown()
    assert int(want.argmax()) == alone.token_ids[0]


def test_other_types_are_converted_to_bf16_and_named(files, capsys):
    loaded = loader.load(str(files["mixed"]["path"]))
    assert packing.of(loaded.model).stored_types == {"Q4_0": 14}   # all but the two Q5_0 ffn_down
    err = capsys.readouterr().err
    assert "dequantized to bf16 (not served as stored): 2 Q5_0" in err, err


def test_an_untied_quantized_embedding_is_read_from_the_file_as_stored(files, monkeypatch):
    """An untied embedding stays in the file, read by rows: its rows are the file's values
    (the reference's dequantization, SPEC.md), wherever a batch looks them up, a row the
    batch looks up more than once read once, and the whole packed copy tensor
    parallelism hands its ranks holds the same values."""
    from gateeng.model.gguf_weights import GGUFTensors
    path = files["mixed"]["path"]
    loaded = loader.load(str(path))
    model, ops = loaded.model, reference_ops.load()
    raw = GGUFTensors(path).raw("token_embd.weight")
    want = ops.qrows(ops.qpack(torch.from_numpy(raw), TYPES["Q4_0"]), torch.arange(raw.shape[0]))
    assert id(model.embed) in packing.of(model).stored_rows and id(model.embed) not in packing.of(model).shared
    ids = torch.tensor([7, 0, 7, raw.shape[0] - 1, 4242, 0, 7])
    reads, pread = [], os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, at: reads.append(at) or pread(fd, buffers, at))
    assert torch.equal(packing.embed_rows(model, ids), want[ids])
    assert len(reads) == len(set(ids.tolist())) == 4
    monkeypatch.undo()
    whole = packing.quantized_embedding(model)
    assert torch.equal(ops.qrows(whole.data, torch.arange(whole.n)), want)


def test_an_untied_embedding_keeps_the_loaded_files_rows_when_its_path_is_replaced(files, tmp_path):
    """The embedding's rows are read from the file as it was loaded, not from whatever
    later sits at its path."""
    import shutil
    path = tmp_path / "model.gguf"
    shutil.copy(files["mixed"]["path"], path)
    loaded = loader.load(str(path))
    ids = torch.tensor([4242, 0, 7])
    want = packing.embed_rows(loaded.model, ids)
    other = tmp_path / "other.gguf"
    other.write_bytes(bytes(path.stat().st_size))
    other.replace(path)
    assert torch.equal(packing.embed_rows(loaded.model, ids), want)
    assert want.abs().sum() > 0


def test_quantized_weights_fail_closed(files, tmp_path):
    from gateeng.engine.weights import WeightUpdateUnavailable
    loaded = loader.load(str(files["Q8_0"]["path"]))
    with pytest.raises(ValueError, match="no transformers checkpoint"):
        loaded.model.hf_state_dict()
    with pytest.raises(RuntimeError, match="no plain copy"):
        packing.restore_plain_weights(loaded.model)
    engine = Engine(EngineConfig(num_kv_blocks=32, max_model_len=64, verified_route="speculative"),   # unpriced
                    loaded=loaded)
    try:
        with pytest.raises(WeightUpdateUnavailable, match="--dequantize"):
            engine.update_weights(str(tmp_path))
        assert engine.submit([1, 2, 3], SamplingParams(max_tokens=2)).result().token_ids   # still serving
    finally:
        engine.shutdown()


def _int8_kernels() -> list:
    """The fast plan's int8 matmuls this CPU's build of cpu_ops has, by name."""
    from gateeng.plans import cpu_ops
    kernels = cpu_ops.load()
    return [name for name in ("vnni", "avx2") if getattr(kernels, "q" + name, False)]


@pytest.mark.skipif(not _int8_kernels(), reason="this CPU has no AVX2: the fast plan takes the reference's matmul")
@pytest.mark.parametrize("gguf_type", list(TYPES))
def test_the_fast_plans_int8_matmuls_are_row_invariant_and_close_to_the_reference(gguf_type):
    """Each int8 matmul (AVX-512 VNNI, AVX2): a row's bits do not depend on the rows
    beside it, within 2% of the reference, its bf16 output its binary32 one rounded;
    where the build has both, the same bits from both (the same float steps)."""
    from gateeng.plans import cpu_ops
    kernels, ops = cpu_ops.load(), reference_ops.load()
    raw, _, _, _ = stored(gguf_type, 40, 576)
    packed = ops.qpack(torch.from_numpy(raw), TYPES[gguf_type])
    x = torch.randn(9, 576, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    want = ops.qlinear(x, packed, 40, True)
    outs = []
    for name in _int8_kernels():
        qlinear = getattr(kernels, "qlinear_" + name)
        many = qlinear(x, packed, 40, True)
        for r in (0, 4, 8):   # a row's bits do not depend on the rows beside it
            assert torch.equal(qlinear(x[r:r + 1].contiguous(), packed, 40, True)[0], many[r]), name
        assert float((many - want).norm()) <= 0.02 * float(want.norm()), name   # inputs quantized to int8: ~0.5% off
        assert torch.equal(qlinear(x, packed, 40, False), many.to(torch.bfloat16)), name
        outs.append(many)
    assert all(torch.equal(out.view(torch.int32), outs[0].view(torch.int32)) for out in outs)
