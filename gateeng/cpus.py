"""The CPUs this process may use: its affinity mask and its cgroup's CPU quota.

A server in a Kubernetes pod, a CI job or a shared host runs under a CPU quota
(cgroup v1 `cpu.cfs_quota_us` / `cpu.cfs_period_us`, cgroup v2 `cpu.max`) that its
affinity mask does not show: a 2-CPU limit on a 64-core node still lists 64 cores.
One compute thread more than the quota allows makes every parallel region wait for
the thread the scheduler has parked, a time slice at a time; so the engine runs as
many threads as the smaller of the two allows, rounded down, at least one. The
quota is the tightest along the process's cgroup and its ancestors. Pure reading of
/proc and /sys: no torch, testable on written files.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional


@dataclass(frozen=True)
class CpuBudget:
    threads: int             # what the engine runs: floor(min(affinity, quota)), at least 1
    affinity: int            # cores in the affinity mask
    quota: Optional[float]   # CPUs the cgroup quota allows, None without one
    quota_source: str = ""   # the file that set it, with its values

    def describe(self) -> str:
        """One line for the start-up log: the count and why."""
        cores = f"{self.affinity} core{'s' * (self.affinity != 1)} in the affinity mask"
        if self.quota is None or self.quota >= self.affinity:
            why = cores + (f" (the CPU quota, {self.quota:g} CPUs, allows as many)" if self.quota else "")
        else:
            why = f"a CPU quota of {self.quota:g} CPUs ({self.quota_source}), below the {cores}"
        return f"{self.threads} thread{'s' * (self.threads != 1)}: {why}"


def budget(proc: Path = Path("/proc"), affinity: Optional[int] = None) -> CpuBudget:
    """This process's CPU budget (`proc`: where /proc is, for tests)."""
    cores = affinity if affinity is not None else len(os.sched_getaffinity(0))
    found = cgroup_quota(proc)
    quota, source = found if found is not None else (None, "")
    limit = cores if quota is None else min(cores, quota)
    return CpuBudget(max(1, math.floor(limit + 1e-9)), cores, quota, source)


def cgroup_quota(proc: Path = Path("/proc")) -> Optional[tuple[float, str]]:
    """(CPUs, the file and its values) of the tightest CPU quota on this process's cgroup
    and its ancestors, cgroup v2 or v1; None where there is none or it cannot be read."""
    try:
        groups = (proc / "self/cgroup").read_text().splitlines()
        mounts = (proc / "self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    found = []
    for line in groups:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            mount = _mount(mounts, "cgroup2", None)
            if mount is not None:
                found += [q for q in (_v2(d) for d in _ancestors(mount, path)) if q is not None]
        elif "cpu" in controllers.split(","):
            mount = _mount(mounts, "cgroup", "cpu")
            if mount is not None:
                found += [q for q in (_v1(d) for d in _ancestors(mount, path)) if q is not None]
    return min(found, default=None)


def _mount(mounts: list, fstype: str, controller: Optional[str]) -> Optional[tuple[Path, str]]:
    """(mount point, the cgroup path mounted there) of a cgroup hierarchy, from mountinfo."""
    for line in mounts:   # "id parent dev root point options ... - fstype source superoptions"
        pre, sep, post = line.partition(" - ")
        if not sep:
            continue
        pre_fields, post_fields = pre.split(), post.split()
        if post_fields[0] != fstype:
            continue
        if controller is not None and controller not in post_fields[-1].split(","):
            continue
        return Path(pre_fields[4]), pre_fields[3]
    return None


def _ancestors(mount: tuple[Path, str], path: str) -> list:
    """The cgroup directories from this process's up to the mount's root."""
    point, root = mount
    rel = path if root == "/" else path[len(root):] if path.startswith(root) else path
    parts = [p for p in rel.split("/") if p]
    return [point.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def _v2(directory: Path) -> Optional[tuple[float, str]]:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max" or int(period) <= 0:
        return None
    return int(quota) / int(period), f"cgroup v2 cpu.max {quota} {period}"


def _v1(directory: Path) -> Optional[tuple[float, str]]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    if quota <= 0 or period <= 0:
        return None
    return quota / period, f"cgroup v1 cpu.cfs_quota_us {quota} / cpu.cfs_period_us {period}"


# ---- neighbours: threads chosen between steps -------------------------------------
# The quota says what the process may use; a neighbour on the same cores decides what
# it gets. A compute thread whose core a busy neighbour holds stalls every parallel
# region for a time slice (a 2-thread decode beside one busy process on 2 cores took
# 880 ms a token against 31 ms on one thread), so between steps the engine runs as
# many threads as the cores its neighbours leave free.

# A core counts as free while its neighbours use less than this share of it: a
# neighbour at half a core already costs a 2-thread step a time slice now and then.
FREE_SHARE = 0.75
# How often the counters are read, and how many readings in a row must agree before
# the count changes (one busy tick of a neighbour changes nothing).
INTERVAL_S = 0.5
AGREE = 2


def _busy_ticks(stat: str, cores: set) -> tuple:
    """(busy, total) clock ticks of `cores` from /proc/stat: busy is everything but
    idle and iowait, steal included (a hypervisor's neighbours hold the core too)."""
    busy = total = 0
    for line in stat.splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cores:
            continue
        ticks = [int(v) for v in values[:8]]   # user nice system idle iowait irq softirq steal
        total += sum(ticks)
        busy += sum(ticks) - ticks[3] - ticks[4]
    return busy, total


def _own_ticks(self_stat: str) -> int:
    """This process's utime + stime (every thread's), in clock ticks, from /proc/self/stat."""
    fields = self_stat[self_stat.rindex(")") + 2:].split()   # after "pid (comm) "
    return int(fields[11]) + int(fields[12])                 # fields 14 and 15 of proc(5)


class Neighbours:
    """Chooses the compute threads between steps: at most `budget` (the quota's and the
    mask's), fewer while neighbours hold cores of the mask. `threads()` is cheap to call
    every step: it reads /proc at most every INTERVAL_S. Pure bookkeeping over /proc's
    text (`proc`, `clock`: for tests)."""

    def __init__(self, budget: int, cores: Optional[set] = None, proc: Path = Path("/proc"), clock=None):
        import time
        self.budget = self.current = budget
        self.cores = set(cores) if cores is not None else set(os.sched_getaffinity(0))
        self.proc = proc
        self.clock = clock or time.monotonic
        self._last = self._read()
        self._at = self.clock()
        self._pending: Optional[int] = None
        self._agreed = 0

    def _read(self) -> Optional[tuple]:
        try:
            busy, total = _busy_ticks((self.proc / "stat").read_text(), self.cores)
            return busy, total, _own_ticks((self.proc / "self/stat").read_text())
        except (OSError, ValueError, IndexError):
            return None

    def free_cores(self, before: tuple, after: tuple) -> Optional[float]:
        """The cores of the mask the neighbours left free between two readings."""
        busy, total, own = (a - b for a, b in zip(after, before))
        if total <= 0:
            return None
        taken = max(0.0, busy - own) / total * len(self.cores)   # ticks of all cores: a share of them
        return len(self.cores) - taken

    def threads(self) -> int:
        """The thread count for the next step."""
        now = self.clock()
        if now - self._at < INTERVAL_S or self.budget <= 1:
            return self.current
        reading = self._read()
        free = None if reading is None or self._last is None else self.free_cores(self._last, reading)
        self._last, self._at = reading, now
        if free is None:
            return self.current
        want = max(1, min(self.budget, math.floor(free + (1 - FREE_SHARE))))
        if want == self.current:
            self._pending, self._agreed = None, 0
        elif want == self._pending:
            self._agreed += 1
            if self._agreed >= AGREE:
                self.current, self._pending, self._agreed = want, None, 0
        else:
            self._pending, self._agreed = want, 1
        return self.current
