"""Each part of a serving process's resident memory.

    python bench/memory.py [--model X.gguf] [--pid PID]

Without --pid: the serving process's path in one process, its RSS after each stage
(the interpreter; `import torch`; the serving modules, gRPC and the HTTP front; the
model's weights with its tokenizer; the engine, whose KV cache it allocates and whose
self-check it runs), with glibc's count of the C heap in use, and then the RSS of the
whole by what holds it (/proc/self/smaps). With --pid: the same split of a running
server's RSS (gateeng serve, llama-server, ...), read from /proc/PID/smaps.

`parts(pid)` is that split: the model file's mapped pages, torch's libraries, the other
libraries and the interpreter, the C heap ([heap], the main arena's brk), and the other
anonymous memory (large allocations, tensors among them, other arenas, Python's object
arenas, thread stacks). `served_bytes(gguf, positions)` gives what the weights and a KV
cache of `positions` take as gateeng serves the file (stored types served quantized
count their stored bytes, the others bf16, an untied quantized embedding nothing: it is
read by rows from the file; the KV cache bf16 K and V per layer), so the rest of
the RSS is the runtime's.
"""
from __future__ import annotations

import argparse
import ctypes
import re
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MIB = 2 ** 20
PARTS = ("model file (mapped)", "torch's libraries", "other libraries, interpreter", "C heap ([heap])",
         "other anonymous")
_MAPPING = re.compile(r"^[0-9a-f]+-[0-9a-f]+ ")


def parts(pid="self", model_file: str = "") -> dict:
    """{part: resident bytes} of process `pid` from its smaps (PARTS, in that order)."""
    out = Counter(dict.fromkeys(PARTS, 0))
    where = PARTS[4]
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if _MAPPING.match(line):
                fields = line.split()
                path = fields[5] if len(fields) > 5 else ""
                if model_file and path == str(Path(model_file).resolve()):
                    where = PARTS[0]
                elif path.startswith("/") and "/torch/" in path:
                    where = PARTS[1]
                elif path.startswith("/"):
                    where = PARTS[2]
                elif path == "[heap]":
                    where = PARTS[3]
                else:
                    where = PARTS[4]
            elif line.startswith("Rss:"):
                out[where] += int(line.split()[1]) * 1024
    return dict(out)


def served_bytes(gguf: str, positions: int) -> dict:
    """{"weights": bytes, "KV cache": bytes} as gateeng serves `gguf` on CPU with a KV
    cache of `positions` (an untied quantized embedding stays in the file, read by rows: not
    counted); reads the tensor table and config its first start cached."""
    from gateeng.model.cache import converted
    from gateeng.model.families import gguf_family
    from gateeng.model.gguf_weights import SERVED_QUANTIZED, TENSOR_TABLE, GGUFTensors
    from gateeng.model.loader import convert_in_child, read_model_config
    header = converted(Path(gguf), lambda g, out: convert_in_child(g, out, header_only=True), kind="header")
    cfg = read_model_config(header)
    tensors = GGUFTensors(Path(gguf), header / TENSOR_TABLE)
    family = gguf_family(tensors.architecture, cfg.moe is not None)
    mapped = () if cfg.tie_word_embeddings else family.block.embed.gguf
    weights = 0
    for t in tensors.tensors.values():
        values = 1
        for n in t.shape:
            values *= n
        if t.type in SERVED_QUANTIZED:
            weights += 0 if t.name in mapped else t.nbytes
        else:
            weights += 2 * values
    kv = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * positions
    return {"weights": weights, "KV cache": kv}


def rss(pid="self") -> dict:
    """VmRSS and VmHWM (the peak) in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


START = rss()   # before this bench imports anything


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_in_use() -> int:
    """Bytes glibc's malloc has handed out and not taken back (0 elsewhere)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
    except (OSError, AttributeError):
        return 0
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd


def table(split: dict, total: int) -> str:
    lines = ["| part | MiB | share |", "| --- | --- | --- |"]
    for name, n in split.items():
        lines.append(f"| {name} | {n / MIB:.0f} | {n / total:.0%} |")
    lines.append(f"| RSS | {total / MIB:.0f} | |")
    return "\n".join(lines)


def stages(model) -> None:
    """The serving path in this process, the RSS after each stage."""
    from gateeng import heap
    heap.limit_arenas()   # as `gateeng serve` does first
    rows = [f"| the interpreter | {START['VmRSS'] / MIB:.0f} | | |"]

    def stage(what: str) -> None:
        r = rss()
        rows.append(f"| {what} | {r['VmRSS'] / MIB:.0f} | {heap_in_use() / MIB:.0f} | {r['VmHWM'] / MIB:.0f} |")
    import torch  # noqa: F401
    stage("import torch")
    from gateeng.serving.http_api import OpenAIFront  # noqa: F401
    from gateeng.serving.server import Server  # noqa: F401
    stage("the serving modules (gRPC, the HTTP front, the engine)")
    from gateeng.model.loader import default_model_path, load
    path = model or str(default_model_path())
    loaded = load(path)
    heap.trim_heap()
    stage("the model: weights, tokenizer")
    from gateeng.config import EngineConfig
    from gateeng.engine.engine import Engine
    cfg = EngineConfig(model=path)
    engine = Engine(cfg, loaded=loaded)
    stage("the engine: KV cache, plans, self-check")
    print("| after | RSS, MiB | C heap in use, MiB | peak RSS, MiB |\n| --- | --- | --- | --- |")
    print("\n".join(rows))
    from gateeng.config import kv_blocks
    model_bytes = served_bytes(path, kv_blocks(cfg) * cfg.block_size)
    total = rss()["VmRSS"]
    print(f"\n{Path(path).name}, the whole process by what holds it:\n")
    print(table(parts(model_file=path), total))
    rest = total - sum(model_bytes.values())
    print("\n" + " + ".join(f"{k} {v / MIB:.0f}" for k, v in model_bytes.items())
          + f" MiB (their bytes); the rest, the runtime: {rest / MIB:.0f} MiB")
    engine.shutdown(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="a GGUF file (default: the embedded model)")
    ap.add_argument("--pid", type=int, default=None, help="split this running process's RSS instead")
    ap.add_argument("--model-file", default="", help="with --pid: the file it maps, counted apart")
    args = ap.parse_args()
    from common import command, commit, machine
    print(f"`{command()}` at {commit()}; {machine()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}\n")
    if args.pid is not None:
        print(table(parts(args.pid, args.model_file), rss(args.pid)["VmRSS"]))
        return 0
    stages(args.model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
