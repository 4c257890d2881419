"""Building a C++ kernel module with torch's extension builder, once per key, into
$GATEENG_CACHE: shared by the fast plan's kernels (cpu_ops) and the reference's
(reference_ops). One process builds while others wait on the builder's lock."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from gateeng.config import cache_root
from gateeng.logs import log


def cpu_flags() -> str:
    """The CPU's feature flags (/proc/cpuinfo), or "unknown"."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def compiler() -> str:
    """The C++ compiler's version line (the one torch's builder calls)."""
    try:
        out = subprocess.run([os.environ.get("CXX", "c++"), "--version"], capture_output=True, text=True, timeout=30)
        return out.stdout.splitlines()[0] if out.stdout else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def digest(source: Path, cflags: list) -> str:
    """What a build's bits depend on besides the CPU: the source, the compiler, its
    flags and torch."""
    import torch
    key = source.read_bytes() + compiler().encode() + " ".join(cflags).encode() + torch.__version__.encode()
    return hashlib.sha256(key).hexdigest()[:12]


def build(name: str, source: Path, cflags: list, ldflags: list, key: str, what: str):
    """The compiled module `name` from `source`, built under cache_root()/<name>/<key>;
    raises whatever the build raises. `what` names it in the log line of a first build."""
    from torch.utils.cpp_extension import load
    # torch's builder runs `ninja` from PATH; the one this environment installed sits
    # beside its Python, which is not on PATH when the venv is not activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    out = cache_root() / name / key
    out.mkdir(parents=True, exist_ok=True)
    if not any(out.glob("*.so")):
        log(f"building {what} into {out} (once per build kind and torch version; about a minute)")
    return load(name, [str(source)], build_directory=str(out), extra_cflags=cflags, extra_ldflags=ldflags,
                verbose=False)


def failure(exc: Exception) -> str:
    """A failed build in one line: the exception's type and its last line."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1] if text else ''}"
