"""The process's C heap (glibc malloc): how many arenas it keeps, and handing what
start-up freed back to the OS. Elsewhere (another libc) both do nothing.

glibc gives each thread that allocates an arena of its own, up to 8 per core (then
they share). A server's threads (the engine's step loop, torch's OpenMP
workers, gRPC's and the HTTP front's) each fill one with short-lived tensors and
buffers, and each arena keeps its own partly used pages: serving bench/peer.py's load
on a 1.17B Q8_0 model left the process about 20 MB larger than before it, none of it
given back by malloc_trim; with two arenas, about 2 MB.
"""
from __future__ import annotations

import ctypes

M_ARENA_MAX = -8          # glibc's <malloc.h>
SERVER_ARENAS = 2


def _libc():
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def limit_arenas(arenas: int = SERVER_ARENAS) -> bool:
    """Cap the arenas at `arenas`: threads that start allocating afterwards share them.
    glibc settles its cap for good once it has made more than eight arenas, so this is
    called before the threads start (the command line's entry does). True where glibc
    took it."""
    libc = _libc()
    return bool(libc is not None and hasattr(libc, "mallopt") and libc.mallopt(M_ARENA_MAX, arenas) == 1)


def trim_heap() -> None:
    """Hand the memory freed at start-up (a float32 tensor read while loading, plain
    weights that were packed and released) back to the OS. glibc keeps freed blocks
    of up to 32 MiB in its heap for reuse, so without this the process holds on to
    them."""
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
