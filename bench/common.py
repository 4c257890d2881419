"""Shared bench helpers: prompts, timing, and appending tables to bench/RESULTS.md."""
from __future__ import annotations

import os
import platform
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
    return (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, python {sys.version.split()[0]}")
