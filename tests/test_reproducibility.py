"""The Reproducibility record names what VERIFIED bits depend on, the CPU's ISA included."""
import dataclasses

import torch

from gateeng import reproducibility as rp

CPUINFO = """processor\t: 0
model name\t: {model}
flags\t\t: fpu sse sse2 {flags}

processor\t: 1
model name\t: {model}
flags\t\t: fpu sse sse2 {flags}
"""


def fake_cpu(tmp_path, model, flags):
    p = tmp_path / f"cpuinfo-{len(flags)}"
    p.write_text(CPUINFO.format(model=model, flags=flags))
    return rp.cpu_model_and_isa(str(p))


def test_isa_is_read_from_cpuinfo_and_tells_cpu_kinds_apart(tmp_path):
    avx2 = fake_cpu(tmp_path, "AMD EPYC 7B13", "avx avx2 fma")
    amx = fake_cpu(tmp_path, "Intel(R) Xeon(R) Platinum 8481C", "avx2 fma avx512f avx512_bf16 amx_tile amx_bf16")
    assert avx2 == ("AMD EPYC 7B13", "avx2,fma")
    assert amx == ("Intel(R) Xeon(R) Platinum 8481C", "avx2,fma,avx512f,avx512_bf16,amx_tile,amx_bf16")


def test_records_are_equal_exactly_when_every_field_is():
    kw = dict(engine_version="1.2.3", model_fingerprint="abc", dtype="bfloat16", device="cpu",
              plan="fast", reference="invariant(rows=8,split=64)", self_check_passed=True, self_check="ok")
    a, b = rp.build(**kw), rp.build(**kw)
    assert a == b and a.fingerprint() == b.fingerprint()
    assert a.torch_version == torch.__version__ and a.num_threads == torch.get_num_threads()
    assert a.isa in a.device_kind and a.device_name in a.device_kind and a.cuda_version
    other_cpu = dataclasses.replace(a, isa=a.isa + ",avx512_bf16")   # any other ISA list
    assert other_cpu != a and other_cpu.fingerprint() != a.fingerprint()


def test_the_fingerprint_leaves_out_the_self_checks_wording_but_not_its_verdict():
    kw = dict(engine_version="1.2.3", model_fingerprint="abc", dtype="bfloat16", device="cpu",
              plan="fast", reference="invariant(rows=8,split=64)", self_check_passed=True,
              self_check="passed (0.06s)")
    a = rp.build(**kw)
    restarted = dataclasses.replace(a, self_check="passed (0.11s)", tensor_parallel_size=2)
    assert restarted.fingerprint() == a.fingerprint()
    failed = dataclasses.replace(a, self_check_passed=False)
    assert failed.fingerprint() != a.fingerprint()
    assert dataclasses.replace(a, model_fingerprint="abd").fingerprint() != a.fingerprint()


def test_two_starts_of_one_model_give_one_fingerprint():
    from gateeng.config import EngineConfig
    from gateeng.engine.core import EngineCore
    from tiny import tiny_loaded
    cfg = EngineConfig(dtype="bfloat16", num_kv_blocks=32, max_model_len=64, block_size=4, verified_route="direct")
    first, second = (EngineCore(cfg, loaded=tiny_loaded("bfloat16")) for _ in range(2))
    try:
        assert first.reproducibility.fingerprint() == second.reproducibility.fingerprint()
        assert first.reproducibility.self_check_passed
    finally:
        first.close()
        second.close()
