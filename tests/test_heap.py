"""gateeng.heap: the command line's cap on glibc's arenas holds when threads allocate."""
import subprocess
import sys
import textwrap

import pytest

from gateeng import heap

# Threads that each allocate, then glibc's own count of its arenas (malloc_info's <heap>s).
COUNT_ARENAS = textwrap.dedent("""
    import ctypes, sys, tempfile, threading
    from gateeng import heap
    if sys.argv[1] == "capped":
        assert heap.limit_arenas()
    barrier = threading.Barrier(6)
    def work():
        barrier.wait()
        keep = [bytearray(1 << 16) for _ in range(64)]   # malloc'd, not pymalloc's
        barrier.wait()
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    libc = ctypes.CDLL("libc.so.6")
    libc.fopen.restype = ctypes.c_void_p
    with tempfile.NamedTemporaryFile("r", suffix=".xml") as out:
        f = libc.fopen(out.name.encode(), b"w")
        libc.malloc_info(0, ctypes.c_void_p(f))
        libc.fclose(ctypes.c_void_p(f))
        print(out.read().count("<heap nr="))
""")


def arenas(mode: str) -> int:
    run = subprocess.run([sys.executable, "-c", COUNT_ARENAS, mode], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return int(run.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_the_cap_holds_where_threads_would_make_more():
    assert arenas("free") > heap.SERVER_ARENAS
    assert arenas("capped") <= heap.SERVER_ARENAS
