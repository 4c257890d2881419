"""Kernel builds survive being killed at any stage, concurrent starts and a full disk.

A tiny C++ module of our own (Python's C API only, so it compiles in about a second)
is built with gateeng.plans.cpp_build under a GATEENG_CACHE in tmp_path. Every start
after an interruption runs under a timeout, so a start that would wait forever fails."""
import errno
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
import uuid
from pathlib import Path

import pytest
import torch

from gateeng.disk import NoSpace
from gateeng.plans import cpp_build, factory, reference_ops

TINY = textwrap.dedent("""
    #include <Python.h>
    #define GE_CAT2(a, b) a##b
    #define GE_CAT(a, b) GE_CAT2(a, b)
    #define GE_STR2(a) #a
    #define GE_STR(a) GE_STR2(a)
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {nullptr, nullptr, 0, nullptr}};
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, GE_STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
    PyMODINIT_FUNC GE_CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&def); }
""")
KEY = "k0"
WHAT = "the tiny module"
START = 120   # seconds: far above a build of TINY, far below forever

# One start of a process: build (or find) the module and call it.
START_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    from gateeng.plans import cpp_build
    m = cpp_build.build(sys.argv[2], Path(sys.argv[1]), ["-O1"], [], sys.argv[3], "the tiny module")
    print(m.answer(), m.__file__)
""")


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    """(source, cache root, module name): a name of its own per test, so torch's
    per-process bookkeeping of names never links two tests."""
    source = tmp_path / "tiny.cpp"
    source.write_text(TINY)
    root = tmp_path / "cache"
    monkeypatch.setenv("GATEENG_CACHE", str(root))
    return source, root, f"tiny_{uuid.uuid4().hex[:8]}"


def entries(folder: Path) -> list:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def child(source: Path, name: str, env: dict = None, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", START_SCRIPT, str(source), name, KEY],
                            env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kw)


def start(source: Path, name: str) -> tuple:
    """A new process's start: (stdout, stderr); a hang fails the test."""
    proc = child(source, name)
    try:
        out, err = proc.communicate(timeout=START)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail(f"a start did not finish within {START}s")
    assert proc.returncode == 0, err
    return out, err


def build_within(source: Path, name: str, seconds: float = START):
    """cpp_build.build in this process, failing the test if it has not returned in time."""
    box = {}

    def run():
        try:
            box["module"] = cpp_build.build(name, source, ["-O1"], [], KEY, WHAT)
        except BaseException as exc:   # noqa: BLE001 - handed to the test
            box["error"] = exc
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"the build did not finish within {seconds}s"
    if "error" in box:
        raise box["error"]
    return box["module"]


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_builds_once_and_imports_from_the_final_folder(tiny, capfd):
    source, root, name = tiny
    module = build_within(source, name)
    final = root / name / KEY
    assert module.answer() == 42
    assert Path(module.__file__).parent == final
    assert entries(root / name) == [KEY, f"{KEY}.lock"]
    assert cpp_build.check(final) is None
    assert build_within(source, name).answer() == 42
    assert capfd.readouterr().err.count("building the tiny module into") == 1


def test_killed_during_compile_is_built_again(tiny, tmp_path):
    """SIGKILL the whole starting process (and its compiler) in the middle of its
    compile: the next start finds the interrupted build, says so, builds and serves."""
    source, root, name = tiny
    started = tmp_path / "compiling"
    cxx = tmp_path / "slow-c++"
    cxx.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        for a in "$@"; do
          if [ "$a" = -c ]; then touch {started}; sleep 120; fi
        done
        exec c++ "$@"
    """))
    cxx.chmod(0o755)
    proc = child(source, name, env={"CXX": str(cxx)}, start_new_session=True)
    deadline = time.time() + START
    while not started.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.time() < deadline, "the compile never started"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    left = entries(root / name)
    assert KEY not in left and any(n.startswith(f"{KEY}.tmp-{proc.pid}-") for n in left), left
    out, err = start(source, name)
    assert out.split()[0] == "42" and Path(out.split()[1]).parent == root / name / KEY
    assert f"found an interrupted build of {WHAT} ({KEY}.tmp-{proc.pid}-" in err
    assert f"pid {proc.pid} is gone); building again" in err
    assert entries(root / name) == [KEY, f"{KEY}.lock"]


def _torch_lock_in_final(folder: Path, key: str, pid: int) -> None:
    """What an earlier gateeng, building in place, left when killed mid-build: torch's
    lock (which made every later start wait forever) and a half-written library."""
    (folder / key).mkdir(parents=True)
    (folder / key / "lock").touch()
    (folder / key / "build.ninja").write_text("ninja_required_version = 1.3\n")
    (folder / key / "tiny.so").write_bytes(b"\x7fELF\x02\x01\x01")


def _no_library_in_final(folder: Path, key: str, pid: int) -> None:
    (folder / key).mkdir(parents=True)
    (folder / key / "tiny.o").write_bytes(b"\x7fELF")


def _empty_tmp(folder: Path, key: str, pid: int) -> None:
    """Killed after making its private folder, before the compile."""
    (folder / f"{key}.tmp-{pid}-0a1b2c3d").mkdir(parents=True)


def _tmp_with_torch_lock(folder: Path, key: str, pid: int) -> None:
    """Killed mid-link: torch's lock and a half library in its private folder."""
    tmp = folder / f"{key}.tmp-{pid}-0a1b2c3d"
    tmp.mkdir(parents=True)
    (tmp / "lock").touch()
    (tmp / "tiny.so").write_bytes(b"\x7fELF\x02")


def _tmp_before_rename(folder: Path, key: str, pid: int) -> None:
    """Killed after writing its record, before the rename."""
    tmp = folder / f"{key}.tmp-{pid}-0a1b2c3d"
    tmp.mkdir(parents=True)
    (tmp / "tiny.so").write_bytes(b"\x7fELF\x02")
    (tmp / "built.json").write_text('{"so": "tiny.so", "size": 5, "sha256": "x"}')


@pytest.mark.parametrize("plant, words", [
    (_torch_lock_in_final, "torch's build lock is left in it"),
    (_no_library_in_final, "it has no finished module"),
    (_empty_tmp, "pid {pid} is gone"),
    (_tmp_with_torch_lock, "pid {pid} is gone"),
    (_tmp_before_rename, "pid {pid} is gone"),
], ids=["torch lock in the final folder", "final folder without a library", "before the compile",
        "mid-build with torch's lock", "before the rename"])
def test_a_leftover_interrupted_build_is_found_and_built_again(tiny, capfd, plant, words):
    source, root, name = tiny
    pid = dead_pid()
    plant(root / name, KEY, pid)
    module = build_within(source, name)
    assert module.answer() == 42 and Path(module.__file__).parent == root / name / KEY
    err = capfd.readouterr().err
    assert f"found an interrupted build of {WHAT}" in err and words.format(pid=pid) in err
    assert "building again" in err
    assert entries(root / name) == [KEY, f"{KEY}.lock"]


def test_a_live_process_folder_is_left_alone(tiny):
    """A .tmp folder whose pid is alive may be a build in progress elsewhere."""
    source, root, name = tiny
    own = root / name / f"{KEY}.tmp-{os.getpid()}-0a1b2c3d"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = root / name / f"{KEY}.tmp-{other.pid}-0a1b2c3d"
        theirs.mkdir(parents=True)
        own.mkdir()   # this process's own (it builds nothing else now): a leftover, removed
        assert build_within(source, name).answer() == 42
        assert theirs.is_dir() and not own.exists()
    finally:
        other.kill()
        other.wait()


def test_a_damaged_build_is_built_again(tiny, capfd):
    source, root, name = tiny
    build_within(source, name)
    so = next((root / name / KEY).glob("*.so"))
    # A new, truncated file in its place: this process has the original mapped, and
    # truncating a mapped library under it would crash the process, not test anything.
    cut = so.with_name("cut")
    cut.write_bytes(so.read_bytes()[:100])
    os.replace(cut, so)
    assert "bytes, expected" in cpp_build.check(root / name / KEY)
    assert build_within(source, name).answer() == 42
    assert "found a damaged build of the tiny module" in capfd.readouterr().err
    assert cpp_build.check(root / name / KEY) is None


def test_a_finished_build_from_before_records_is_kept(tiny, capfd):
    """A whole folder torch built in place (its lock gone, its .so there) serves as it is."""
    source, root, name = tiny
    build_within(source, name)
    (root / name / KEY / "built.json").unlink()
    assert cpp_build.check(root / name / KEY) == "no record"
    capfd.readouterr()
    assert build_within(source, name).answer() == 42
    assert "building" not in capfd.readouterr().err
    assert cpp_build.check(root / name / KEY) is None


def test_two_processes_starting_at_once_both_get_the_module(tiny):
    source, root, name = tiny
    procs = [child(source, name) for _ in range(2)]
    results = []
    for proc in procs:
        try:
            results.append(proc.communicate(timeout=START))
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"a start did not finish within {START}s")
        assert proc.returncode == 0, results[-1][1]
    assert [out.split()[0] for out, _ in results] == ["42", "42"]
    assert {out.split()[1] for out, _ in results} == {str(next((root / name / KEY).glob("*.so")))}
    assert sum(err.count("building the tiny module into") for _, err in results) == 1
    assert entries(root / name) == [KEY, f"{KEY}.lock"]


def _fake_load(exc: Exception):
    def load(name, sources, build_directory, **kw):
        (Path(build_directory) / "partial.o").write_bytes(b"\0" * (1 << 20))
        raise exc
    return load


@pytest.mark.parametrize("exc", [
    OSError(errno.ENOSPC, "No space left on device"),
    OSError(errno.EDQUOT, "Disk quota exceeded"),
    RuntimeError("Error building extension 'tiny': [1/2] c++ -c tiny.cpp -o tiny.o\nFAILED: tiny.o\n"
                 "{root}/x.o: No space left on device\nninja: build stopped: subcommand failed."),
], ids=["ENOSPC", "EDQUOT", "compiler output"])
def test_full_disk_during_a_build_is_one_clear_line_and_leaves_nothing(tiny, monkeypatch, exc):
    source, root, name = tiny
    if isinstance(exc, RuntimeError):
        exc = RuntimeError(str(exc).replace("{root}", str(root / name)))
    import torch.utils.cpp_extension
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_load(exc))
    with pytest.raises(NoSpace) as info:
        cpp_build.build(name, source, ["-O1"], [], KEY, WHAT)
    text = str(info.value)
    assert "\n" not in text and str(root / name) in text and "1.0 MiB written" in text
    assert "GATEENG_CACHE" in text and "free space" in text
    assert cpp_build.failure(info.value) == f"NoSpace: {text}"
    assert entries(root / name) == [f"{KEY}.lock"]   # no partial folder


def test_full_temporary_disk_during_a_compile_names_it(tiny, monkeypatch):
    source, root, name = tiny
    exc = RuntimeError("Error building extension 'tiny'\n"
                       "cc1plus: fatal error: error writing to /var/tmpfull/ccAb12.s: No space left on device")
    import torch.utils.cpp_extension
    monkeypatch.setattr(torch.utils.cpp_extension, "load", _fake_load(exc))
    with pytest.raises(NoSpace) as info:
        cpp_build.build(name, source, ["-O1"], [], KEY, WHAT)
    assert "/var/tmpfull" in str(info.value) and "TMPDIR" in str(info.value)
    assert entries(root / name) == [f"{KEY}.lock"]


def test_failure_names_the_compiler_error_line():
    exc = RuntimeError("Error building extension 'x': [1/2] c++ -c x.cpp\nFAILED: x.o\n"
                       "x.cpp:3:5: error: 'foo' was not declared in this scope\nninja: build stopped: subcommand failed.")
    assert cpp_build.failure(exc) == "RuntimeError: x.cpp:3:5: error: 'foo' was not declared in this scope"
    assert cpp_build.failure(ImportError("bad.so: undefined symbol: f")) == "ImportError: bad.so: undefined symbol: f"


def test_a_reference_that_cannot_be_built_refuses_verified_with_the_reason(monkeypatch, capfd):
    """The build's reason reaches the refusal and the log, never silently."""
    full = NoSpace(errno.ENOSPC, "no space left on the disk of /c (...): free space there, or set GATEENG_CACHE")

    def build(*args, **kw):
        raise full
    monkeypatch.setattr(reference_ops.cpp_build, "build", build)
    monkeypatch.setattr(reference_ops, "_modules", {})
    monkeypatch.setattr(reference_ops, "runnable", lambda flags=None: ["scalar"])
    monkeypatch.delenv("GATEENG_CPU_ISA", raising=False)
    model = types.SimpleNamespace(dtype=torch.bfloat16, projections=lambda: [torch.zeros(2, 4)])
    ops, why = factory._reference_ops(model)
    assert ops is None and "no space left on the disk of /c" in why and "GATEENG_CACHE" in why
    err = capfd.readouterr().err
    assert "no space left on the disk of /c" in err and "VERIFIED requests will be refused" in err
