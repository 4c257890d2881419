"""The engine's compute threads follow what the process may use: its affinity mask and
its cgroup's CPU quota (v1 or v2, the tightest along its ancestors), rounded down, at
least one; --threads wins. Read from written files, and from a real cgroup made here."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gateeng import cpus

TESTS = Path(__file__).resolve().parent
V1_MOUNT = "30 25 0:26 / {root} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"
V2_MOUNT = "31 25 0:27 / {root} rw,nosuid - cgroup2 cgroup2 rw\n"


def fake(tmp_path, cgroup: str, mounts: str, files: dict) -> Path:
    """A /proc with self/cgroup and self/mountinfo, and cgroup files under tmp_path/fs."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self/cgroup").write_text(cgroup)
    (proc / "self/mountinfo").write_text(mounts.format(root=tmp_path / "fs"))
    for name, text in files.items():
        path = tmp_path / "fs" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return proc


@pytest.mark.parametrize("cgroup, mounts, files, affinity, threads, quota", [
    # cgroup v1: 1.5 CPUs of 2 cores -> 1 thread
    ("4:cpu,cpuacct:/pod/app\n", V1_MOUNT, {"pod/app/cpu.cfs_quota_us": "150000\n",
                                            "pod/app/cpu.cfs_period_us": "100000\n"}, 2, 1, 1.5),
    # no quota (-1): the affinity mask
    ("4:cpu,cpuacct:/pod/app\n", V1_MOUNT, {"pod/app/cpu.cfs_quota_us": "-1\n",
                                            "pod/app/cpu.cfs_period_us": "100000\n"}, 3, 3, None),
    # a parent's quota is tighter than the process's own
    ("4:cpu,cpuacct:/pod/app\n", V1_MOUNT, {"pod/cpu.cfs_quota_us": "200000\n", "pod/cpu.cfs_period_us": "100000\n",
                                            "pod/app/cpu.cfs_quota_us": "800000\n",
                                            "pod/app/cpu.cfs_period_us": "100000\n"}, 64, 2, 2.0),
    # cgroup v2: cpu.max 2.5 CPUs of 4 cores -> 2 threads
    ("0::/job\n", V2_MOUNT, {"job/cpu.max": "250000 100000\n"}, 4, 2, 2.5),
    # v2 without a limit
    ("0::/job\n", V2_MOUNT, {"job/cpu.max": "max 100000\n"}, 4, 4, None),
    # a quota below one CPU still runs one thread
    ("0::/job\n", V2_MOUNT, {"job/cpu.max": "50000 100000\n"}, 4, 1, 0.5),
    # a quota above the affinity mask changes nothing
    ("0::/job\n", V2_MOUNT, {"job/cpu.max": "800000 100000\n"}, 4, 4, 8.0),
    # nothing readable: the affinity mask
    ("0::/job\n", V2_MOUNT, {}, 2, 2, None),
])
def test_the_budget_is_the_tighter_of_mask_and_quota(tmp_path, cgroup, mounts, files, affinity, threads, quota):
    b = cpus.budget(fake(tmp_path, cgroup, mounts, files), affinity=affinity)
    assert (b.threads, b.affinity, b.quota) == (threads, affinity, quota)
    line = b.describe()
    assert line.startswith(f"{threads} thread")
    if quota is not None and quota < affinity:
        assert f"a CPU quota of {quota:g} CPUs" in line and ("cfs_quota_us" in line or "cpu.max" in line)
    else:
        assert f"{affinity} cores in the affinity mask" in line


def cgroup_v1_cpu() -> Path:
    """A fresh cgroup v1 CPU group, or a skip saying why none can be made here."""
    root = Path("/sys/fs/cgroup/cpu")
    if not (root / "cpu.cfs_quota_us").exists():
        pytest.skip("no cgroup v1 CPU controller mounted at /sys/fs/cgroup/cpu")
    group = root / f"gateeng-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a cgroup here ({e}); the quota test needs root and a writable cgroup fs")
    return group


ENGINE_THREADS = """
import sys, torch
sys.path.insert(0, {tests!r})
from gateeng.config import EngineConfig
from gateeng.engine.core import EngineCore
from tiny import tiny_loaded
threads = {threads!r}
EngineCore(EngineConfig(dtype="float32", num_kv_blocks=16, max_model_len=64, block_size=4, num_threads=threads),
           loaded=tiny_loaded("float32"))
print(torch.get_num_threads())
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to show a quota below them")
def test_an_engine_in_a_one_cpu_cgroup_runs_one_thread():
    group = cgroup_v1_cpu()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")        # one CPU
        outs = {}
        for threads in (None, 2):                                  # the default, and --threads
            code = ENGINE_THREADS.format(tests=str(TESTS), threads=threads)
            res = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"',
                                  sys.executable, code], capture_output=True, text=True, timeout=300)
            assert res.returncode == 0, res.stderr[-3000:]
            outs[threads] = (int(res.stdout.split()[-1]), res.stderr)
        threads, log = outs[None]
        assert threads == 1
        assert "compute threads: 1 thread: a CPU quota of 1 CPUs (cgroup v1 cpu.cfs_quota_us 100000" in log
        assert outs[2][0] == 2 and "2 compute threads (--threads)" in outs[2][1]
    finally:
        group.rmdir()


class FakeHost:
    """A /proc whose stat and self/stat a test advances: per core, the ticks its
    neighbours and this process used over the last interval."""

    def __init__(self, tmp_path, cores: int):
        self.proc = tmp_path / "host"
        (self.proc / "self").mkdir(parents=True)
        self.now, self.cores = 0.0, cores
        self.busy, self.idle, self.own = [0] * cores, [0] * cores, 0
        self.write()

    def write(self):
        lines = ["cpu  0 0 0 0 0 0 0 0 0 0"]
        lines += [f"cpu{c} {self.busy[c]} 0 0 {self.idle[c]} 0 0 0 0 0 0" for c in range(self.cores)]
        (self.proc / "stat").write_text("\n".join(lines) + "\nintr 0\n")
        fields = ["S"] + ["0"] * 10 + [str(self.own), "0"] + ["0"] * 30   # utime is field 14
        (self.proc / "self/stat").write_text(f"123 (gate eng) {' '.join(fields)}\n")

    def run(self, seconds: float, neighbours: float, own: float):
        """`seconds` pass; neighbours use `neighbours` cores, this process `own` cores."""
        ticks = int(100 * seconds)
        total = neighbours + own
        for c in range(self.cores):                    # the cores fill in order
            used = int(ticks * min(1.0, max(0.0, total - c)))
            self.busy[c] += used
            self.idle[c] += ticks - used
        self.own += int(ticks * own)
        self.now += seconds
        self.write()


def test_threads_follow_the_cores_neighbours_leave_free(tmp_path):
    host = FakeHost(tmp_path, 2)
    n = cpus.Neighbours(2, cores={0, 1}, proc=host.proc, clock=lambda: host.now)
    counts = []
    for neighbours, own in [(0, 2)] * 3 + [(1, 1)] * 4 + [(0.4, 1)] * 3 + [(0, 2)] * 4 + [(1, 1), (0, 2)] * 3:
        host.run(cpus.INTERVAL_S, neighbours, own)
        counts.append(n.threads())
    assert counts[:3] == [2, 2, 2]                     # quiet: the whole budget
    assert counts[3:7] == [2, 1, 1, 1]                 # a busy neighbour: one thread, after two readings agree
    assert counts[7:10] == [1, 1, 1]                   # a neighbour at 0.4 of a core still holds one
    assert counts[10:14] == [1, 2, 2, 2]               # free again: back to two
    assert counts[14:] == [2] * 6                      # a neighbour on every other reading changes nothing


def test_threads_are_read_at_most_every_interval_and_never_above_the_budget(tmp_path):
    host = FakeHost(tmp_path, 4)
    n = cpus.Neighbours(2, cores={0, 1, 2, 3}, proc=host.proc, clock=lambda: host.now)
    host.run(cpus.INTERVAL_S / 4, 3, 1)
    assert n.threads() == 2                            # too soon to judge
    for _ in range(3):
        host.run(cpus.INTERVAL_S, 3, 1)                # three of four cores taken
        n.threads()
    assert n.threads() == 1
    for _ in range(3):
        host.run(cpus.INTERVAL_S, 0, 1)                # four cores free, a budget of two
        n.threads()
    assert n.threads() == 2
    unreadable = cpus.Neighbours(2, cores={0}, proc=tmp_path / "nowhere", clock=lambda: host.now)
    host.run(cpus.INTERVAL_S, 0, 1)
    assert unreadable.threads() == 2                   # nothing to read: the budget
