"""How busy the host is, as this process sees it: the share of the CPU time torch's
threads ask for that they get. 0.99 on a quiet host (OpenMP's threads spin rather
than sleep between regions), 0.5 beside two busy processes on two cores, 0.5-0.7
beside one."""
from __future__ import annotations

import time

import torch


def cpu_share(seconds: float = 0.05) -> float:
    """The share over `seconds` of small matmuls on every thread: bounded in time
    however busy the host is, where a decode pass of a fresh process, with its
    one-time set-up, took a second beside two busy processes."""
    a = torch.randn(256, 256)
    threads = torch.get_num_threads()
    cpu, wall = time.process_time(), time.perf_counter()
    while time.perf_counter() - wall < seconds:
        a @ a
    return (time.process_time() - cpu) / ((time.perf_counter() - wall) * threads)
