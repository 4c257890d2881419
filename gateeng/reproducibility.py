"""The Reproducibility record: everything a VERIFIED request's bits depend on.

Built once per engine. Two engines whose records are equal give equal VERIFIED
bits for the same request. Where `reference` is the written spec (gateeng-ref-1,
kernels/SPEC.md: a bf16 model), equal model_fingerprint, dtype and reference
suffice, on any machine: the device, ISA, torch and thread fields are then
information. Otherwise (a float32 model's machine-specific invariant plan) a
record that differs in any field but the self-check's wording promises nothing:
the CPU's ISA is in it because the kernels torch picks (AVX2 emulated bf16,
AVX-512 BF16, AMX) round differently. `differences` owns that rule.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import json
import platform
import dataclasses
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from gateeng.config import BFLOAT16
from gateeng.plans.kernel_names import ISA_ENV, REFERENCE

# The ISA extensions that change which CPU kernels run (and so their rounding).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "avx512_vnni", "avx_vnni",   # cpuinfo flags
             "amx_tile", "amx_bf16", "amx_int8")
# The settings that make this machine run as a smaller one (the AVX2 emulation: kernels
# built for x86-64-v3, torch and oneDNN capped at AVX2).
ISA_CAPS = (ISA_ENV, "ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


@dataclass(frozen=True)
class Reproducibility:
    engine_version: str
    model_fingerprint: str
    dtype: str
    device_kind: str       # one line: "cpu:<arch>:<model>:<isa>" or "cuda:<name>:sm_<cc>"
    device_name: str       # CPU model or GPU name
    isa: str               # CPU ISA flags (comma-separated) or the GPU's compute capability
    kernel_plan: str      # "<engine plan>; <reference>"
    reference: str        # the arithmetic VERIFIED bits follow: a spec's name, or the machine-specific plan
    torch_version: str
    triton_version: str
    cuda_version: str
    num_threads: int
    self_check_passed: bool
    self_check: str
    # Information only: tensor parallelism runs only on the reference, whose bits are
    # the same at every size; so the fingerprint leaves it out.
    tensor_parallel_size: int = 1
    # Information only: which weights (0 at start, +1 per applied update; the
    # model_fingerprint decides the bits) and, in a fleet, which replica answered.
    weight_version: int = 0
    replica: str = ""

    def fingerprint(self) -> str:
        """A short stable id of what decides the bits: equal for replicas and restarts
        that give equal bits. The self-check's wording (which carries its duration),
        the tensor-parallel size, the weight version and the replica are information and stay out of it; whether the
        self-check passed stays in, since it decides whether VERIFIED is served."""
        fields = {k: v for k, v in asdict(self).items() if k not in UNFINGERPRINTED}
        blob = json.dumps(fields, sort_keys=True).encode()
        return "gateeng-" + hashlib.sha256(blob).hexdigest()[:16]


def cpu_model_and_isa(cpuinfo: str = "/proc/cpuinfo") -> tuple[str, str]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and value.strip():
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                if flags and key == "":
                    break   # the first processor's block is enough
    except OSError:
        pass
    isa = ",".join(f for f in ISA_FLAGS if f in flags) or "none"
    return model, isa


def device_identity(device: str) -> tuple[str, str]:
    """(device name, ISA or compute capability)."""
    if device == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return torch.cuda.get_device_name(), f"sm_{major}{minor}"
    return cpu_model_and_isa()


def _triton_version() -> str:
    # Read from the package metadata: importing triton on a CPU machine costs seconds.
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "none"


def build(*, engine_version: str, model_fingerprint: str, dtype: str, device: str, plan: str, reference: str,
          self_check_passed: bool, self_check: str, num_threads: Optional[int] = None,
          tensor_parallel_size: int = 1) -> Reproducibility:
    name, isa = device_identity(device)
    kind = "cuda" if device == "cuda" else f"cpu:{platform.machine()}"
    return Reproducibility(
        engine_version=engine_version, model_fingerprint=model_fingerprint, dtype=dtype,
        device_kind=f"{kind}:{name}:{isa}", device_name=name, isa=isa, kernel_plan=f"{plan}; {reference}",
        reference=reference,
        torch_version=torch.__version__, triton_version=_triton_version(),
        cuda_version=torch.version.cuda or "none",
        num_threads=num_threads or torch.get_num_threads(),
        self_check_passed=self_check_passed, self_check=self_check, tensor_parallel_size=tensor_parallel_size)


# Fields that describe a record rather than decide its bits.
INFORMATION = ("self_check", "self_check_passed", "tensor_parallel_size", "weight_version", "replica")
UNFINGERPRINTED = ("self_check", "tensor_parallel_size", "weight_version", "replica")
# Where the reference is a written spec, only these decide the bits.
SPEC_FIELDS = ("reference", "model_fingerprint", "dtype")


def differences(stored: dict, here: dict) -> list:
    """Why a target whose record is `here` cannot reproduce a response whose record
    is `stored` (both as plain fields: asdict, or as a response carries them), as
    "field: stored X, here Y" lines; empty when it can. A spec reference
    (REFERENCE) needs equal SPEC_FIELDS, on any machine; any other needs every
    field equal but the self-check's wording."""
    spec = stored.get("reference") == REFERENCE
    fields = SPEC_FIELDS if spec else [f.name for f in dataclasses.fields(Reproducibility)
                                       if f.name not in INFORMATION]
    out = [f"{f}: stored {stored.get(f)!r}, here {here.get(f)!r}" for f in fields if stored.get(f) != here.get(f)]
    if not here.get("self_check_passed"):
        out.append(f"self_check: here {here.get('self_check')}")
    return out


def untrainable(fields: dict) -> str:
    """Why a trainer (gateeng.train.Policy: the written reference in bf16, on a
    transformers checkpoint's weights) cannot compute the VERIFIED bits of a server,
    or of an answer, whose record has these fields; empty when it can."""
    reference, dtype = fields.get("reference"), fields.get("dtype")
    if reference == REFERENCE and dtype == BFLOAT16:
        return ""
    if str(reference).startswith(REFERENCE):   # the reference on weights kept quantized (its version names them)
        return (f"a GGUF's quantized weights are served as stored ({reference}), and a trainer computes on "
                f"bf16 weights: serve it with --dequantize")
    return (f"its VERIFIED bits follow {reference!r} in {dtype}, not the written reference {REFERENCE!r} in "
            f"bfloat16 that a trainer computes: serve it with --dtype bfloat16")
