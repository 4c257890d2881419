"""The reference kernels (kernels/ref_ops.cpp): the arithmetic of kernels/SPEC.md,
built for one of three instruction sets, each giving the spec's bits.

  avx512_bf16  VDPBF16PS (x86-64-v4 + AVX512_BF16)
  avx2         AVX2 FMA emulating VDPBF16PS's pair steps (x86-64-v3)
  scalar       the portable C++ source without vectorization (any CPU with a C++ compiler)

The default is the first of them this CPU runs; GATEENG_CPU_ISA forces one. Each is
built without fast math and with -ffp-contract=off (the spec decides every rounding,
not the compiler), on first use, into $GATEENG_CACHE. Before a build serves, a
probe checks its vector code against its own portable code (the matmul on inputs
that include denormals and cancellations, attention at the vector scores' shapes);
a build that disagrees is never used (the default then falls back to the next
one). Where none can be had, `load` raises ReferenceUnavailable, whose message
says why: VERIFIED requests are then refused.
"""
from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from gateeng import kernels
from gateeng.logs import log
from gateeng.plans import cpp_build
from gateeng.plans.kernel_names import AVX2, AVX512_BF16, ISA_ENV, REFERENCE, REFERENCE_ISAS, SCALAR

SOURCE = Path(kernels.__file__).resolve().parent / "ref_ops.cpp"

# What each build needs from the CPU (its /proc/cpuinfo flags) and from the compiler.
NEEDS = {AVX512_BF16: {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_bf16"},   # cpuinfo flags
         AVX2: {"avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe", "abm"},   # cpuinfo flags
         SCALAR: set()}
ISA_CFLAGS = {AVX512_BF16: [cpp_build.MARCH[AVX512_BF16], "-mavx512bf16", "-DGATEENG_REF_AVX512BF16"],
              AVX2: [cpp_build.MARCH[AVX2], "-DGATEENG_REF_AVX2"],
              SCALAR: ["-fno-tree-vectorize"]}


def isa_cflags(isa: str) -> list:
    """The build's own flags. The scalar build stays scalar (no vectorizer); on an x86
    CPU with FMA, std::fma becomes the scalar FMA instruction instead of a library
    call: the same exact result, inlined."""
    extra = ["-mfma"] if isa == SCALAR and "fma" in cpp_build.cpu_flags().split() else []
    return ISA_CFLAGS[isa] + extra


# No fast math, no contraction: every rounding is the spec's. -fno-trapping-math lets the
# compiler vectorize loops with selects (exp's range cases, bf16's NaN case); it
# changes no value, only the floating-point exception flags nobody reads. -fopenmp:
# at::parallel_for runs on torch's OpenMP threads (cpu_ops.py says why).
CFLAGS = ["-O3", "-fno-fast-math", "-ffp-contract=off", "-fno-trapping-math", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_lock = threading.Lock()
_modules: dict = {}


class ReferenceUnavailable(RuntimeError):
    """No build of the reference can serve here; the message says why."""


def runnable(flags: Optional[str] = None) -> list:
    """The builds this CPU runs, preferred first."""
    have = set((flags if flags is not None else cpp_build.cpu_flags()).split())
    x86 = os.uname().machine in ("x86_64", "AMD64")
    return [isa for isa in REFERENCE_ISAS if isa == SCALAR or (x86 and NEEDS[isa] <= have)]


def requested() -> Optional[str]:
    """The build GATEENG_CPU_ISA forces, or None; an unknown name is refused."""
    isa = os.environ.get(ISA_ENV, "").strip()
    if not isa:
        return None
    if isa not in REFERENCE_ISAS:
        raise ReferenceUnavailable(f"{ISA_ENV}={isa!r} is not a reference build: use one of "
                                   f"{', '.join(REFERENCE_ISAS)}")
    return isa


def load(isa: Optional[str] = None):
    """The reference module for `isa` (default: GATEENG_CPU_ISA, else the best this CPU
    runs that builds and passes its probe). Raises ReferenceUnavailable."""
    forced = isa or requested()
    if forced is not None:
        if forced not in runnable():
            raise ReferenceUnavailable(f"this CPU cannot run the {forced} build of {REFERENCE} (it lacks "
                                       f"{', '.join(sorted(NEEDS[forced] - set(cpp_build.cpu_flags().split())))})")
        return _usable(forced)
    reasons = []
    for candidate in runnable():
        try:
            return _usable(candidate)
        except ReferenceUnavailable as exc:
            reasons.append(str(exc))
            log(f"{exc}; trying the next build")
    raise ReferenceUnavailable("; ".join(reasons))


def _usable(isa: str):
    with _lock:
        if isa not in _modules:
            _modules[isa] = _build(isa)
    module = _modules[isa]
    if isinstance(module, ReferenceUnavailable):
        raise module
    return module


def _build(isa: str):
    """The module, or the ReferenceUnavailable to raise (kept, so a failed build is
    not retried on every call)."""
    cflags = CFLAGS + isa_cflags(isa)
    try:
        digest = cpp_build.digest(SOURCE, cflags)
        key = hashlib.sha256(f"{digest}:{isa}".encode()).hexdigest()[:16]
        module = cpp_build.build(f"gateeng_ref_{isa}", SOURCE, cflags, LDFLAGS, key,
                                 f"the {REFERENCE} kernels ({isa})")
    except Exception as exc:   # no compiler, no headers, a failed build
        return ReferenceUnavailable(f"the {isa} build of {REFERENCE} failed ({cpp_build.failure(exc)})")
    module.digest = digest
    problem = probe(module)
    if problem:
        return ReferenceUnavailable(f"the {isa} build of {REFERENCE} disagrees with the spec here ({problem})")
    return module


def probe_inputs(seed: int = 0) -> tuple:
    """bf16 x [5, 96] and w [37, 96] whose products include denormals (flushed by the
    spec), exact cancellations and sums that land near the flush boundary."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(5, 96, generator=gen)
    w = torch.randn(37, 96, generator=gen)
    x[1] *= 2.0 ** -64                           # products near 2^-126: flushed or not
    w[3] *= 2.0 ** -63
    x[2, :48] = x[2, 48:]                         # cancellation: sums of x2 * (w_a - w_a)
    w[5, 48:] = -w[5, :48]
    x[3, ::7] = torch.tensor(2.0 ** -130)         # denormal inputs (read as zero)
    w[7, 1::5] = torch.tensor(-(2.0 ** -133))
    return x.to(torch.bfloat16), w.to(torch.bfloat16)


def tiny_normals(k: int) -> torch.Tensor:
    """bf16 [k]: normal values just below 2^-114 (binary32 exponent -115), both signs: the
    largest the AVX2 build's 4-bit kernel must not scale (ref_ops.cpp scaled_nibbles)."""
    j = torch.arange(k)
    return ((1 - 2 * (j % 2)) * (1 + (j % 7) / 8) * 2.0 ** -115).to(torch.bfloat16)


def exact_block_inputs(k: int, seed: int = 0) -> torch.Tensor:
    """bf16 [5, k] whose 32-value blocks take each path of the AVX2 build's one-row tiles
    on 4- and 6-bit integers (ref_ops.cpp ExactBlocks; multiply a row alone to reach
    them), all with odd significands (the lowest set bit 2^(e - 7)):
    row 0's values within 2^8 of each other (one int16 limb); row 1's two per 16 values
    2^9 above the rest (two limbs); row 2's spread over 2^40 (the FMA chain); row 3's
    blocks alternate a unit of 2^-126 (the smallest exact) and 2^-127 (the chain); row
    4's a unit of 2^104 (the largest exact) and 2^105."""
    gen = torch.Generator().manual_seed(seed)
    odd = ((1 + (2 * torch.randint(0, 64, (5, k), generator=gen) + 1) / 128)
           * (1 - 2 * torch.randint(0, 2, (5, k), generator=gen)))
    j = torch.arange(k)
    block = (j // 32) % 2
    exps = torch.stack([-torch.randint(0, 8, (k,), generator=gen), torch.where(j % 16 == 0, 0, -9),
                        -torch.randint(0, 41, (k,), generator=gen), -119 - block, 111 + block])
    return (odd * 2.0 ** exps.double()).to(torch.bfloat16)


# (GGML type id, bytes per block of 32 values) of the quantized types the probe checks.
QUANT_PROBES = ((8, 34), (2, 18), (3, 20))


def quantized_probe(n: int, k: int, block: int, seed: int) -> torch.Tensor:
    """GGUF rows [n, k/32 blocks] of random integers with binary16 scales (and minimums)
    from 2^-24 to 2^4, some tiny enough that products flush."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, k // 32, block), generator=gen, dtype=torch.uint8)
    scales = (torch.rand(n, k // 32, 2, generator=gen) * 2 - 1) * 2.0 ** torch.randint(-24, 5, (n, k // 32, 2),
                                                                                    generator=gen)
    raw[:, :, :4] = scales.to(torch.float16).view(torch.uint8).view(n, k // 32, 4)
    return raw.view(n, -1)


def probe(module) -> str:
    """'' when the module's vector code equals its portable code, bit for bit: the
    matmul against the portable dot on probe_inputs (both outputs, every pair of
    rows), the quantized matmul of each type against its portable loops, attention
    against the portable attention; else what differs."""
    x, w = probe_inputs()
    got = module.linear(x, module.pack(w), w.shape[0], True)
    rows = torch.arange(x.shape[0]).repeat_interleave(w.shape[0])
    cols = torch.arange(w.shape[0]).repeat(x.shape[0])
    want = module.dot_rows(x[rows].contiguous(), w[cols].contiguous()).view(x.shape[0], w.shape[0])
    if not torch.equal(got.view(torch.int32), want.view(torch.int32)):
        bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
        return f"matmul: {bad} of {got.numel()} probe outputs differ from the portable dot"
    rounded = module.linear(x, module.pack(w), w.shape[0], False)
    if not torch.equal(rounded.view(torch.int16), want.to(torch.bfloat16).view(torch.int16)):
        return "matmul: the bf16 outputs are not the binary32 sums rounded to nearest even"
    tiny = x.clone()   # a row of normal inputs below 2^-114: the 4-bit kernels' other path (ref_ops.cpp)
    tiny[4] = tiny_normals(x.shape[1])
    for ggml, block in QUANT_PROBES:
        packed = module.qpack(quantized_probe(w.shape[0], x.shape[1], block, seed=ggml), ggml)
        for xq in (x, tiny, *exact_block_inputs(x.shape[1]).split(1)):
            fast, spec = (module.qlinear(xq, packed, w.shape[0], True, portable) for portable in (False, True))
            if not torch.equal(fast.view(torch.int32), spec.view(torch.int32)):
                return f"quantized matmul (GGML type {ggml}) differs from the portable code"
    gen = torch.Generator().manual_seed(1)
    for d, group in ((64, 3), (128, 8)):   # the vector scores' head dims and group sizes
        k_cache, v_cache = (torch.randn(12, 16, 2, d, generator=gen).to(torch.bfloat16) for _ in range(2))
        q = (torch.randn(3, 2 * group, d, generator=gen) * 3).to(torch.bfloat16)
        tables, lens = torch.randperm(12, generator=gen)[:9].view(3, 3), torch.tensor([1, 21, 48])
        args = (q, k_cache, v_cache, tables, lens, d ** -0.5)
        if not torch.equal(module.decode_attention(*args).view(torch.int16),
                           module.decode_attention(*args, portable=True).view(torch.int16)):
            return f"attention (head dim {d}, {group} heads per KV head) differs from the portable code"
    return ""
