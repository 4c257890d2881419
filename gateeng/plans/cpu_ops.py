"""The CPU kernels both plans use (kernels/cpu_ops.cpp): RMSNorm (alone and after
the residual add), RoPE with the K/V store, the SiLU gate, attention that reads
the paged KV cache in place, one query row per call row, and, where the CPU has
AVX-512 BF16, a VDPBF16PS matmul on the reference's packed layout. Each
computes a row start to finish in one thread, so all are row-invariant at any row
count.

Built on first use with torch's C++ extension builder (a C++ compiler is needed;
about a minute on 2 cores) into $GATEENG_CACHE, keyed by the source, the torch
version and the CPU's flags, since the code is compiled for this CPU
(-march=native, or the instruction set GATEENG_CPU_ISA names) and the machine
under a cache can change. One process builds
while others wait on its lock, and a build killed at any stage is found and
redone by the next start (cpp_build). Where the build fails, `load()`
returns None, both plans keep their torch ops (the invariant plan's bits and
kernel_plan change with it), and the log says why (EngineConfig.cpu_kernels /
--no-cpu-kernels skips them altogether).
"""
from __future__ import annotations

import hashlib
import threading
from pathlib import Path

from gateeng import kernels
from gateeng.logs import log
from gateeng.plans import cpp_build, reference_ops
from gateeng.plans.kernel_names import AVX2, SCALAR

SOURCE = Path(kernels.__file__).resolve().parent / "cpu_ops.cpp"
_lock = threading.Lock()
_state: dict = {}


# -fopenmp: at::parallel_for in the kernels runs on torch's OpenMP threads (without
# it the pragma is ignored and every kernel runs on one thread). The extension then
# links libgomp.so.1, the soname torch has already loaded, so both share one pool.
CFLAGS = ["-O3", "-ffast-math", "-fopenmp-simd", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
# The instruction set: this CPU's, unless GATEENG_CPU_ISA asks for a reference build
# of a smaller one; then these kernels are built for it too, so that one machine runs
# as the other kind would (an AVX2-only CPU on an AVX-512 one).
MARCH = {isa: cpp_build.MARCH[isa] for isa in (AVX2, SCALAR)}


def load():
    """The compiled module, or None where it cannot be had (see the module doc)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    try:
        cflags = CFLAGS + [MARCH.get(reference_ops.requested() or "", "-march=native")]
        digest = cpp_build.digest(SOURCE, cflags)
        key = hashlib.sha256(digest.encode() + cpp_build.cpu_flags().encode()).hexdigest()[:16]
        module = cpp_build.build("gateeng_cpu_ops", SOURCE, cflags, LDFLAGS, key, "the CPU kernels")
        module.digest = digest
        return module
    except Exception as exc:   # no compiler, no headers, a failed build: the torch ops serve
        log(f"the CPU kernels are unavailable ({cpp_build.failure(exc)}); using torch ops")
        return None
