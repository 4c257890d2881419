"""The converted-model cache survives crashes, damage and concurrent starts.

A stand-in converter writes a small HF-like directory, so these run without the
model; one test interrupts a real conversion of the embedded model."""
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from gateeng.disk import NoSpace
from gateeng.model import cache as model_cache


class FakeConverter:
    def __init__(self, delay=0.0):
        self.calls = 0
        self.delay = delay

    def __call__(self, gguf: Path, out: Path) -> None:
        self.calls += 1
        (out / "config.json").write_text('{"model_type": "llama"}')
        (out / "model.safetensors").write_bytes(os.urandom(1 << 16))
        time.sleep(self.delay)
        (out / "tokenizer.json").write_text("{}")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("GATEENG_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF" + os.urandom(1024))
    return tmp_path / "cache", gguf


def entries(root: Path) -> list:
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def test_converts_once_and_then_reads_the_cache(cache):
    root, gguf = cache
    conv = FakeConverter()
    target = model_cache.converted(gguf, conv)
    assert model_cache.converted(gguf, conv) == target
    assert conv.calls == 1 and entries(root) == [target.name]
    assert model_cache.check(target) is None
    assert json.loads((target / "gateeng.json").read_text())["files"]["model.safetensors"]["size"] == 1 << 16


@pytest.mark.parametrize("damage, words", [
    (lambda t: (t / "model.safetensors").write_bytes((t / "model.safetensors").read_bytes()[:1000]), "bytes"),
    (lambda t: (t / "gateeng.json").write_text((t / "gateeng.json").read_text()[:20]), "unreadable"),
    (lambda t: (t / "gateeng.json").unlink(), "missing"),
    (lambda t: (t / "tokenizer.json").unlink(), "missing"),
    (lambda t: (t / "model.safetensors").write_bytes(b"x" * (1 << 16)), "sha256"),
    (lambda t: (t / "gateeng.json").write_text(json.dumps(
        {k: v for k, v in json.loads((t / "gateeng.json").read_text()).items() if k != "format"})), "older gateeng"),
], ids=["truncated weights", "truncated manifest", "no manifest", "lost file", "same-size edit", "older format"])
def test_damaged_cache_is_reported_and_converted_again(cache, capfd, damage, words):
    root, gguf = cache
    conv = FakeConverter()
    target = model_cache.converted(gguf, conv)
    damage(target)
    assert words in model_cache.check(target)
    again = model_cache.converted(gguf, conv)
    assert again == target and conv.calls == 2
    assert model_cache.check(target) is None
    assert "damaged" in capfd.readouterr().err
    assert entries(root) == [target.name]


def test_concurrent_starts_convert_once(cache):
    root, gguf = cache
    conv = FakeConverter(delay=0.5)
    results = []
    threads = [threading.Thread(target=lambda: results.append(model_cache.converted(gguf, conv)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert conv.calls == 1 and len(set(results)) == 1 and entries(root) == [results[0].name]


def test_killed_conversion_leaves_no_cache_and_is_cleaned_up(cache):
    """SIGKILL a converting process mid-write: no half entry under the real name; the
    next start removes the leftover folder and converts again."""
    root, gguf = cache
    script = textwrap.dedent(f"""
        import os, time
        from pathlib import Path
        from gateeng.model import cache as model_cache
        def slow(gguf, out):
            (out / "model.safetensors").write_bytes(os.urandom(1 << 20))
            time.sleep(60)
        model_cache.converted(Path({str(gguf)!r}), slow)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env=dict(os.environ, GATEENG_CACHE=str(root)))
    deadline = time.time() + 60
    while time.time() < deadline and not list(root.glob("*.tmp-*/model.safetensors")):
        time.sleep(0.05)
    assert list(root.glob("*.tmp-*/model.safetensors")), "the converter never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert all(".tmp-" in name for name in entries(root))   # nothing under the real name
    conv = FakeConverter()
    target = model_cache.converted(gguf, conv)
    assert conv.calls == 1 and entries(root) == [target.name]


@pytest.mark.model
def test_killed_real_conversion_then_load(tmp_path, monkeypatch):
    """The user's case: the server (--dequantize) is killed during its first
    conversion of the embedded model; the next start converts again and serves, and
    the cache holds one copy."""
    from gateeng.model.loader import load
    root = tmp_path / "cache"
    env = dict(os.environ, GATEENG_CACHE=str(root))
    proc = subprocess.Popen([sys.executable, "-c", "from gateeng.model.loader import load; load(None, dequantize=True)"],
                            env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not list(root.glob("*.tmp-*/model.safetensors")):
        assert proc.poll() is None, "conversion finished before it could be interrupted"
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    assert all(".tmp-" in name for name in entries(root))
    monkeypatch.setenv("GATEENG_CACHE", str(root))
    loaded = load(None, dequantize=True)
    target = root / entries(root)[0]
    assert entries(root) == [target.name] and ".tmp-" not in target.name
    assert model_cache.check(target) is None and len(loaded.fingerprint) == 64


@pytest.mark.model
def test_model_dir_prints_the_converted_directory_with_its_tokenizer(capsys):
    from pathlib import Path

    from gateeng.tools.cli import main
    assert main(["model-dir"]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert (out / "tokenizer.json").is_file() and (out / "config.json").is_file()
    assert main(["model-dir", "--model", "/nonexistent/model.gguf"]) == 2
    assert "does not exist" in capsys.readouterr().err


@pytest.mark.parametrize("where, exc", [
    ("convert", OSError(errno.ENOSPC, "No space left on device")),
    ("convert", OSError(errno.EDQUOT, "Disk quota exceeded")),
    ("convert", RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, '
                             'message: "No space left on device" })')),
    ("fsync", OSError(errno.ENOSPC, "No space left on device")),
], ids=["ENOSPC", "EDQUOT", "safetensors", "at fsync"])
def test_full_disk_during_conversion_is_one_clear_line_and_leaves_nothing(cache, monkeypatch, where, exc):
    root, gguf = cache

    def full(gguf, out):
        (out / "model.safetensors").write_bytes(b"\0" * (1 << 20))
        if where == "convert":
            raise exc

    def fsync(fd):
        raise exc
    if where == "fsync":
        monkeypatch.setattr(model_cache.os, "fsync", fsync)
    with pytest.raises(NoSpace) as info:
        model_cache.converted(gguf, full)
    text = str(info.value)
    assert "\n" not in text and str(root) in text and "1.0 MiB written" in text
    assert "GATEENG_CACHE" in text and "free space" in text and "at least the GGUF's" in text
    assert entries(root) == []   # no partial folder
    monkeypatch.undo()
    monkeypatch.setenv("GATEENG_CACHE", str(root))
    target = model_cache.converted(gguf, FakeConverter())   # with room again, it converts
    assert model_cache.check(target) is None and entries(root) == [target.name]


def test_serving_a_quantized_gguf_names_what_it_dequantizes(tmp_path):
    """The log line a start prints: a GGUF's quantized tensors are served dequantized,
    and the line names their types, so the change of arithmetic is never silent."""
    from gateeng.model.loader import GGUF_TYPES, served_as
    (tmp_path / GGUF_TYPES).write_text(json.dumps({"F32": 61, "Q4_1": 210, "Q8_0": 1}))
    line = served_as(Path("m.gguf"), tmp_path, "bfloat16")
    assert "210 Q4_1, 1 Q8_0" in line and "dequantized to bfloat16" in line and "F32" not in line
    (tmp_path / GGUF_TYPES).write_text(json.dumps({"BF16": 200, "F32": 61}))
    assert "dequantized" not in served_as(Path("m.gguf"), tmp_path, "bfloat16")
