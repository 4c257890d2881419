"""The disk facts the caches share (converted models, compiled kernels, route costs):
what a full disk or an exhausted quota looks like, the one-line error that says so,
file hashes, a file written whole."""
from __future__ import annotations

import errno
import hashlib
import os
import secrets
import shutil
from pathlib import Path
from typing import Optional

# What a full disk or an exhausted quota looks like where it arrives as text instead of
# an OSError: a compiler's or ninja's output, safetensors' Rust I/O error.
_NO_SPACE_TEXT = ("no space left on device", "disk quota exceeded", "os error 28", "os error 122",
                  "storagefull", "filesystemquotaexceeded")


class NoSpace(OSError):
    """Writing into the cache failed for lack of space or quota; str() is one line that
    names the folder, what was written before it failed, what is free, and what to do."""

    def __str__(self) -> str:
        return self.strerror


def is_no_space(exc: BaseException) -> bool:
    """Whether `exc` (or what it was raised from) is a full disk or an exhausted quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if any(words in str(exc).lower() for words in _NO_SPACE_TEXT):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def tree_size(path: Path) -> int:
    """Bytes in the files under `path` (0 where it is gone)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


def no_space(folder: Path, doing: str, written: int, needed: str = "",
             advice: str = "free space there, or set GATEENG_CACHE to a folder on a disk with room") -> NoSpace:
    """The one-line error for a write into `folder` that ran out of space."""
    try:
        free = f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free / 2 ** 20:.0f} MiB"
    except OSError:
        free = "unknown"
    need = f"; {needed}" if needed else ""
    return NoSpace(errno.ENOSPC, f"no space left on the disk of {folder} while {doing} "
                                 f"({written / 2 ** 20:.1f} MiB written when it failed, {free} free now{need}): {advice}")


def write_whole(path: Path, text: str) -> None:
    """`text` into `path` whole: written to a temporary file beside it, flushed to the
    disk and renamed into place, so a reader, or a start after a crash, finds the old
    file or the new one and never a part of either. The temporary file goes whatever
    stops the write."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_differs(path: Path, size, sha256) -> Optional[str]:
    """Why the file at `path` is not the one recorded with this size and sha256, or
    None when it is."""
    if not path.is_file():
        return f"{path.name} is missing"
    if path.stat().st_size != size:
        return f"{path.name} has {path.stat().st_size} bytes, expected {size}"
    if sha256_file(path) != sha256:
        return f"{path.name} does not match its recorded sha256"
    return None
