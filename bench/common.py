"""Shared bench helpers: prompts, timing, and appending tables to bench/RESULTS.md."""
from __future__ import annotations

import os
import sys
import time

import torch

TOPICS = ["the ocean", "a small robot", "ancient Rome", "quantum computers", "a lighthouse keeper",
          "bread baking", "the moon landing", "a jazz club", "mountain goats", "a chess match",
          "volcanoes", "a lost key", "the printing press", "honeybees", "a desert caravan", "winter"]


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
    from gateeng.reproducibility import cpu_model_and_isa
    model, isa = cpu_model_and_isa()
    return (f"{model} [{isa}], {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}")
