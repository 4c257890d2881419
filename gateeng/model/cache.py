"""The converted-model cache: a GGUF file becomes a Hugging Face directory once.

Layout under $GATEENG_CACHE (default ~/.cache/gateeng), keyed by the GGUF's sha256:

    gguf-<sha16>/             a whole conversion: config, safetensors, tokenizer, manifest
    gguf-<sha16>.lock         flock'ed by the one process converting or repairing it
    gguf-<sha16>.tmp-<pid>    a conversion in progress

Invariants:
- `gguf-<sha16>/` only ever appears by renaming a finished conversion into place,
  so a process killed mid-conversion leaves at most a .tmp folder, never a half cache.
- A .tmp folder seen while holding the lock belongs to a converter that died: it is
  removed before converting again, so an interrupted conversion never doubles the cache.
- The manifest (gateeng.json) records every file's size and sha256. Each start checks
  them (one read of the files), so a truncated or edited cache is reported and
  converted again instead of failing every start. (The model fingerprint is not the
  files': gateeng.model.fingerprint.)
- A conversion that runs out of space (ENOSPC, EDQUOT) removes its .tmp folder and
  raises gateeng.disk.NoSpace: one line naming the folder, what was written and what is free,
  and what to do. Kernel builds (gateeng.plans.cpp_build) raise the same.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

from gateeng.config import cache_root
from gateeng.disk import file_differs, is_no_space, no_space, sha256_file, tree_size
from gateeng.logs import log

MANIFEST = "gateeng.json"
# What a conversion writes; an entry written to another format is converted again.
# 2: the conversion records the GGUF's tensor types (loader.GGUF_TYPES); 3: a header
# conversion records the GGUF's tensor table (gguf_weights.TENSOR_TABLE); 4: a mixture of
# experts' header records its family and expert fields (a format-3 entry of one lacks them).
FORMAT = 4

def hash_dir(hf_dir: Path) -> dict:
    """{file name: {size, sha256}} for every file but the manifest."""
    files = {}
    for path in sorted(p for p in hf_dir.iterdir() if p.is_file() and p.name != MANIFEST):
        files[path.name] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return files


def check(target: Path) -> Optional[str]:
    """None for a whole cache entry, else what is wrong with it."""
    meta = target / MANIFEST
    if not target.is_dir():
        return "missing"
    try:
        manifest = json.loads(meta.read_text())
        want = manifest["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except KeyError:
        return f"{MANIFEST} lists no files (a cache from an older gateeng)"
    except (ValueError, TypeError) as exc:
        return f"{MANIFEST} is unreadable ({type(exc).__name__})"
    if manifest.get("format") != FORMAT:
        return f"written in format {manifest.get('format', 1)} by an older gateeng, not {FORMAT}"
    for name, entry in want.items():
        why = file_differs(target / name, entry.get("size"), entry.get("sha256"))
        if why:
            return why
    return None


@contextmanager
def _locked(lock_path: Path):
    try:
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        fh = open(lock_path, "a")
    except OSError as exc:
        if is_no_space(exc):
            raise no_space(lock_path.parent, f"creating {lock_path.name}", 0) from exc
        raise
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process to finish converting ({lock_path.name}) ...")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _remove(path: Path) -> None:
    """Rename away first, so a crash mid-delete never leaves a half entry under the real name."""
    trash = path.with_name(f"{path.name}.tmp-trash{os.getpid()}")
    os.replace(path, trash)
    shutil.rmtree(trash, ignore_errors=True)


def converted(gguf: Path, convert: Callable[[Path, Path], None], kind: str = "") -> Path:
    """The cache directory for a GGUF file, converting it if needed.

    `convert(gguf, out_dir)` writes an HF directory into the empty `out_dir`. `kind`
    names a partial conversion kept apart from the whole one (gguf-<kind>-<sha16>/:
    "header", the config and tokenizer a GGUF served as stored needs)."""
    digest = sha256_file(gguf)
    target = cache_root() / f"gguf-{kind + '-' if kind else ''}{digest[:16]}"
    problem = check(target)
    if problem is None:
        return target
    with _locked(target.with_name(target.name + ".lock")):
        problem = check(target)   # another process may have converted it meanwhile
        if problem is None:
            return target
        if problem != "missing":
            log(f"the cached model in {target} is damaged ({problem}): converting it again")
            _remove(target)
        for stale in target.parent.glob(target.name + ".tmp*"):   # also older ".tmp<pid>" names
            log(f"removing {stale.name}, left by an interrupted conversion")
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        t0 = time.time()
        what = "'s config and tokenizer" if kind else " to safetensors"
        log(f"converting {gguf.name}{what} (once; cached in {target}) ...")
        try:
            tmp.mkdir()
            convert(gguf, tmp)
            manifest = {"format": FORMAT, "source": str(gguf), "sha256": digest, "files": hash_dir(tmp)}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            for path in tmp.iterdir():
                with open(path, "rb") as f:
                    os.fsync(f.fileno())   # a full disk may surface only here
            os.replace(tmp, target)
        except BaseException as exc:
            # Nothing half-written stays behind, whatever stopped the conversion.
            written = tree_size(tmp)
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, Exception) and is_no_space(exc):
                size = gguf.stat().st_size / 2 ** 20
                raise no_space(target.parent, f"converting {gguf.name}", written,
                               f"it needs at least the GGUF's {size:.0f} MiB, about {2 * size:.0f} MiB "
                               f"or more for a 16-bit or quantized GGUF") from exc
            raise
        log(f"  converted in {time.time() - t0:.0f}s")
    return target
