"""Shared bench helpers: prompts, timing, and appending tables to bench/RESULTS.md."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import torch

TOPICS = ["the ocean", "a small robot", "ancient Rome", "quantum computers", "a lighthouse keeper",
          "bread baking", "the moon landing", "a jazz club", "mountain goats", "a chess match",
          "volcanoes", "a lost key", "the printing press", "honeybees", "a desert caravan", "winter"]


# Engine settings for --torch-ops: both plans on torch ops and plain weights.
TORCH_OPS = dict(cpu_kernels=False, pack_fast_weights=False)


def prompt_set(n: int, mixed: bool) -> list:
    out = []
    for i in range(n):
        t = TOPICS[i % len(TOPICS)]
        if mixed:
            extra = " Include details about history, people and places." * (i % 5)
            out.append(f"Write about {t}.{extra}")
        else:
            out.append(f"Write a short story about {t}.")
    return out


def timed(fn):
    t0 = time.perf_counter()
    r = fn()
    return r, time.perf_counter() - t0


def machine() -> str:
    """The CPU model and its ISA flags first: AVX2-only and AMX machines give different
    bits and very different bf16 costs, so a number means little without them."""
    from gateeng.reproducibility import ISA_CAPS, cpu_model_and_isa
    model, isa = cpu_model_and_isa()
    capped = [f"{k}={os.environ[k]}" for k in ISA_CAPS if os.environ.get(k)]
    return (f"{model} [{isa}], {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}"
            + (f"; ISA capped by {' '.join(capped)}" if capped else ""))


def report_path(name: str) -> Path:
    """Where a bench writes its report by default: outside the tree, so a run leaves the
    checkout clean ($GATEENG_BENCH_OUT, else a gateeng-bench folder in the temporary
    directory). `--out bench/NAME` refreshes the report RESULTS.md cites."""
    import tempfile
    where = Path(os.environ.get("GATEENG_BENCH_OUT") or Path(tempfile.gettempdir()) / "gateeng-bench")
    where.mkdir(parents=True, exist_ok=True)
    return where / name


def commit() -> str:
    """The commit a run measured, marked when the work tree differs from it: every
    section of RESULTS.md names the code it describes."""
    here = Path(__file__).resolve().parent
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=here).stdout.strip() or "unknown"
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=here).stdout.strip()
    return head + (" (with uncommitted changes)" if dirty else "")


def command() -> str:
    """The command line as a reader would type it again."""
    return " ".join(["python", "bench/" + Path(sys.argv[0]).name] + sys.argv[1:])


def header() -> str:
    """What every bench prints first: its command, the commit and the machine."""
    return f"`{command()}` at {commit()}; {machine()}"


def decode_step_ms(loaded, batch: int, steps: int = 8, fast_plan=None, rounds: int = 3) -> float:
    """Wall time of a steady-state decode step with `batch` running OFF requests (the
    engine is stepped by hand, without its thread): the best of `rounds` means over
    `steps` steps, since neighbours on a shared host only ever add time.
    `fast_plan` replaces the fast plan."""
    from gateeng.config import EngineConfig
    from gateeng.engine.core import EngineCore
    from gateeng.request import SamplingParams
    engine = EngineCore(EngineConfig(dtype="bfloat16"), loaded=loaded)
    if fast_plan is not None:
        engine.replace_fast_plan(fast_plan)
    for p in prompt_set(batch, False):
        engine.add_request(engine.new_request(p, SamplingParams(max_tokens=160, ignore_eos=True), chat=True))
    steady_decode(engine)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        best = min(best, (time.perf_counter() - t0) / steps * 1000)
    return best


def steady_decode(engine, extra: int = 2) -> None:
    """Step until every request has finished its prompt (prefill is chunked and
    interleaved with decodes, so at 32 prompts that takes tens of steps), then
    `extra` decode steps more: what follows are pure decode steps. `engine`: an
    EngineCore stepped by hand."""
    while not engine.prefilled():
        engine.step()
    for _ in range(extra):
        engine.step()
