"""Building a C++ kernel module with torch's extension builder, once per key, into
$GATEENG_CACHE: shared by the fast plan's kernels (cpu_ops) and the reference's
(reference_ops).

Layout under cache_root()/<name>/:

    <key>/                    a finished build: build.ninja, the object, <module>.so, built.json
    <key>.lock                flock'ed by the one process building <key>; holds its pid
    <key>.tmp-<pid>-<hex>     one build in progress; torch's builder works only in here

Invariants:
- `<key>/` only ever appears by renaming a finished build into place, and built.json
  (the .so's name, size and sha256) is written into it last, before the rename. A
  process killed at any point leaves at most a .tmp folder; a folder under the final
  name is whole, and each start checks the .so against built.json.
- One process builds a key at a time; the others wait on <key>.lock. It is an flock,
  which the kernel releases when its holder dies, however it dies: a killed build
  never leaves a lock that a later start waits on. (torch's own `lock` file, which
  a killed builder leaves behind and which torch would wait on forever, only ever
  exists in that build's private .tmp folder.) A flock rather than two builds racing
  to rename: on a small machine two concurrent compiles would double every start's
  wait for the same bits.
- Holding the lock, a .tmp folder whose pid is dead (or is this process) is an
  interrupted build: it is logged and removed. One whose pid is alive (a reused pid,
  another machine on a shared cache) is left alone.
- The module is imported from the final folder, never the .tmp one: torch builds it
  without importing it as a Python module, and the import reads <key>/<module>.so.
- A build that runs out of space removes its .tmp folder and raises
  gateeng.disk.NoSpace (one line: the folder, what to do).
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from gateeng.config import cache_root
from gateeng.logs import log
from gateeng.plans.kernel_names import AVX2, AVX512_BF16, SCALAR
from gateeng.disk import NoSpace, file_differs, is_no_space, no_space, sha256_file, tree_size

RECORD = "built.json"
# The -march of each instruction set a build may be made for where it is not this
# CPU's own (-march=native): the reference's builds, and the fast plan's kernels when
# GATEENG_CPU_ISA asks for a smaller CPU. Part of each build's flags, hence its key.
MARCH = {AVX512_BF16: "-march=x86-64-v4", AVX2: "-march=x86-64-v3", SCALAR: "-march=x86-64"}
TORCH_LOCK = "lock"   # torch's FileBaton, present while (or after a kill during) its build
_TEMP = re.compile(r"\.(?:tmp|trash)-(\d+)-[0-9a-f]+$")


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
    """What a build's bits depend on besides the CPU: the source and the headers of its
    folder (which it may include), the compiler, its flags and torch."""
    import torch
    headers = b"".join(h.read_bytes() for h in sorted(source.parent.glob("*.h")))
    key = (source.read_bytes() + headers + compiler().encode() + " ".join(cflags).encode()
           + torch.__version__.encode())
    return hashlib.sha256(key).hexdigest()[:12]


def build(name: str, source: Path, cflags: list, ldflags: list, key: str, what: str):
    """The compiled module `name` from `source`, built once under cache_root()/<name>/<key>
    and imported from there; raises whatever the build raises (NoSpace for a full
    disk). `what` names it in the log."""
    # torch's builder runs `ninja` from PATH; the one this environment installed sits
    # beside its Python, which is not on PATH when the venv is not activated.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    root = cache_root() / name
    final = root / key
    if check(final) is None:
        return _import(final)
    try:
        root.mkdir(parents=True, exist_ok=True)
        with _locked(root / f"{key}.lock", what):
            problem = check(final)   # another process may have built it meanwhile
            if problem == "no record" and _adopt(final):
                problem = None
            if problem is not None:
                if problem not in ("missing", "no record"):
                    log(f"found a damaged build of {what} in {final} ({problem}); building again")
                    _remove(final)
                _clear_interrupted(root, key, what)
                _build_into_place(name, source, cflags, ldflags, root, final, what)
    except NoSpace:
        raise
    except OSError as exc:   # the folder, the lock file, a record: a full disk says so in one line
        if is_no_space(exc):
            raise no_space(root, f"building {what}", 0) from exc
        raise
    return _import(final)


def check(final: Path) -> Optional[str]:
    """None for a whole build folder, else what is wrong with it ("missing", "no record"
    for a folder without built.json, or the damage)."""
    if not final.is_dir():
        return "missing"
    try:
        record = json.loads((final / RECORD).read_text())
        so = final / record["so"]
    except FileNotFoundError:
        return "no record"
    except (ValueError, TypeError, KeyError) as exc:
        return f"{RECORD} is unreadable ({type(exc).__name__})"
    return file_differs(so, record.get("size"), record.get("sha256"))


def _adopt(final: Path) -> bool:
    """A folder from before built.json, where torch built in place: whole when its .so is
    there and torch's lock is gone (torch removes it only once its build has ended;
    a builder killed mid-build leaves it). A whole one gets its record and serves."""
    sos = list(final.glob("*.so"))
    if (final / TORCH_LOCK).exists() or len(sos) != 1:
        return False
    _write_record(final, sos[0])
    return True


def _clear_interrupted(root: Path, key: str, what: str) -> None:
    """Logs and removes what interrupted builds of `key` left (called holding its lock)."""
    final = root / key
    if final.is_dir():   # a folder from before built.json whose build never finished
        why = ("torch's build lock is left in it" if (final / TORCH_LOCK).exists()
               else "it has no finished module")
        log(f"found an interrupted build of {what} in {final} ({why}); building again")
        _remove(final)
    for stale in sorted(root.glob(f"{key}.*")):
        match = _TEMP.search(stale.name)
        if match is None or not stale.is_dir():
            continue
        pid = int(match.group(1))
        if pid != os.getpid() and _alive(pid):
            continue
        if ".tmp-" in stale.name:
            log(f"found an interrupted build of {what} ({stale.name}: pid {pid} is gone); building again")
        shutil.rmtree(stale, ignore_errors=True)


def _build_into_place(name: str, source: Path, cflags: list, ldflags: list, root: Path, final: Path,
                      what: str) -> None:
    from torch.utils.cpp_extension import load
    tmp = root / f"{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    log(f"building {what} into {final} (once per build kind and torch version; under a minute)")
    t0 = time.monotonic()
    try:
        tmp.mkdir()
        # is_python_module=False: the .so is built (and dlopen'ed, which runs no module
        # code) but not imported from here; _import reads it from the final folder.
        load(name, [str(source)], build_directory=str(tmp), extra_cflags=cflags, extra_ldflags=ldflags,
             verbose=False, is_python_module=False)
        sos = list(tmp.glob("*.so"))
        if len(sos) != 1:
            raise RuntimeError(f"the build of {what} left {len(sos)} .so files in {tmp}")
        for path in tmp.iterdir():
            if path.is_file():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())   # a full disk may surface only here
        _write_record(tmp, sos[0])
        try:
            os.replace(tmp, final)
        except OSError as exc:
            # Another builder's folder got there first (a cache whose flocks do not
            # exclude, as on some network file systems): its whole build serves.
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST) or check(final) is not None:
                raise
            shutil.rmtree(tmp, ignore_errors=True)
        log(f"  built in {time.monotonic() - t0:.0f}s")
    except BaseException as exc:
        # Nothing half-built stays behind, whatever stopped the build.
        written = tree_size(tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, Exception) and is_no_space(exc):
            # The compiler's temporary files go to $TMPDIR, which may be the disk that filled.
            full = [p for p in re.findall(r"(/[^\s:'\"]+): (?:No space left on device|Disk quota exceeded)", str(exc))
                    if not p.startswith(str(root))]
            if full:
                raise no_space(Path(full[0]).parent, f"building {what}", written, "a build writes a few MiB",
                               "free space there, or set TMPDIR to a folder on a disk with room") from exc
            raise no_space(root, f"building {what}", written, "a build writes a few MiB") from exc
        raise


def _write_record(folder: Path, so: Path) -> None:
    """built.json for `so`, written whole (a temporary file renamed into place)."""
    tmp = folder / f"{RECORD}.tmp"
    with open(tmp, "w") as f:
        json.dump({"so": so.name, "size": so.stat().st_size, "sha256": sha256_file(so)}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, folder / RECORD)


def _import(final: Path):
    """The module in `final`'s .so, as Python imports an extension module. torch comes
    first: the .so resolves libtorch's symbols against the copy torch loaded."""
    import torch  # noqa: F401
    so = final / json.loads((final / RECORD).read_text())["so"]
    spec = importlib.util.spec_from_file_location(so.name.split(".")[0], so)
    if spec is None or spec.loader is None:
        raise ImportError(f"{so} is not an extension module")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _locked(lock_path: Path, what: str):
    with open(lock_path, "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fh.seek(0)
            holder = fh.read().strip()
            log(f"waiting for {'pid ' + holder if holder else 'another process'}, which is building {what} ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            fh.seek(0)
            fh.truncate()
            fh.write(str(os.getpid()))
            fh.flush()
        except OSError:
            pass   # the pid is only for the waiting message
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie has)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat[stat.rindex(")") + 2] != "Z"
    except (OSError, ValueError, IndexError):
        return True


def _remove(path: Path) -> None:
    """Rename away first, so a crash mid-delete never leaves a half folder under the real name."""
    trash = path.with_name(f"{path.name}.trash-{os.getpid()}-{secrets.token_hex(4)}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def failure(exc: Exception) -> str:
    """A failed build in one line: the exception's type and the line that says why (the
    compiler's first error line where the message is a build log, else its last line)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    errors = [line for line in lines[1:] if re.search(r"\berror\b", line, re.IGNORECASE)]
    return f"{type(exc).__name__}: {errors[0] if errors else lines[-1]}"
