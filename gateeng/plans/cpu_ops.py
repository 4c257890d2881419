"""The CPU kernels both plans use (kernels/cpu_ops.cpp): RMSNorm (alone and after
the residual add), RoPE with the K/V store, the SiLU gate, attention that reads
the paged KV cache in place, one query row per call row, and a matmul on packed
weights (VDPBF16PS where the CPU has AVX-512 BF16, AVX2 FMA elsewhere). Each
computes a row start to finish in one thread, so all are row-invariant at any row
count.

Built on first use with torch's C++ extension builder (a C++ compiler is needed;
about a minute on 2 cores) into $GATEENG_CACHE, keyed by the source, the torch
version and the CPU's flags, since the code is compiled for this CPU
(-march=native) and the machine under a cache can change. One process builds
while others wait on the builder's lock. Where the build fails, `load()`
returns None, both plans keep their torch ops (the invariant plan's bits and
kernel_plan change with it), and the log says why (EngineConfig.cpu_kernels /
--no-cpu-kernels skips them altogether).
"""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import torch

from gateeng import kernels
from gateeng.config import cache_root
from gateeng.logs import log

SOURCE = Path(kernels.__file__).resolve().parent / "cpu_ops.cpp"
_lock = threading.Lock()
_state: dict = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _compiler() -> str:
    """The C++ compiler's version line (the one torch's builder calls): another
    compiler may vectorize a reduction differently, which changes bits."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# -fopenmp: at::parallel_for in the kernels runs on torch's OpenMP threads (without
# it the pragma is ignored and every kernel runs on one thread). The extension then
# links libgomp.so.1, the soname torch has already loaded, so both share one pool.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fopenmp"]
LDFLAGS = ["-fopenmp"]


def _digest() -> str:
    """What the kernels' bits depend on besides the CPU: their source, the compiler,
    its flags and torch. The invariant plan's description (kernel_plan) carries it."""
    key = SOURCE.read_bytes() + _compiler().encode() + " ".join(CFLAGS).encode() + torch.__version__.encode()
    return hashlib.sha256(key).hexdigest()[:12]


def _build_dir(digest: str) -> Path:
    key = hashlib.sha256(digest.encode() + _cpu_flags().encode()).hexdigest()[:16]
    return cache_root() / "cpu_ops" / key


def load():
    """The compiled module, or None where it cannot be had (see the module doc)."""
    with _lock:
        if "module" not in _state:
            _state["module"] = _build()
        return _state["module"]


def _build():
    try:
        from torch.utils.cpp_extension import load as build
        # torch's builder runs `ninja` from PATH; the one this environment installed sits
        # beside its Python, which is not on PATH when the venv is not activated.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
        digest = _digest()   # runs the compiler once, for the build key and kernel_plan
        out = _build_dir(digest)
        out.mkdir(parents=True, exist_ok=True)
        if not any(out.glob("*.so")):
            log(f"building the CPU kernels into {out} (once per CPU kind and torch version; "
                f"about a minute)")
        module = build("gateeng_cpu_ops", [str(SOURCE)], build_directory=str(out),
                       extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
        module.digest = digest
        return module
    except Exception as exc:   # no compiler, no headers, a failed build: the torch ops serve
        log(f"the CPU kernels are unavailable ({type(exc).__name__}: "
            f"{str(exc).strip().splitlines()[-1] if str(exc).strip() else ''}); using torch ops")
        return None
