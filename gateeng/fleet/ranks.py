"""A replica's tensor-parallel ranks 1..N-1 as Ray actors on other nodes.

The replica (EngineReplica, rank 0) and its ranks sit on the bundles of one placement
group (cluster.place: one bundle per rank, on as many nodes as the cluster allows).
Each rank reads only its own shard of the model by byte ranges (model.shard_read), as
rank 0 does, and joins rank 0's torch.distributed group (gloo on CPU) at rank 0's
node address: the rendezvous store's values are signed with the engine's secret and
every pair of ranks proves it before any row is sent (engine.tp_processes), so the
group adds no unauthenticated port. The secret travels in the actor call that starts
the rank (Ray's own channel), never on a command line or in an environment.

A weight update reaches a rank as a checkpoint in Ray's object store: the rank writes
its own copy on its node (`receive_checkpoint`) and reads its shard of it by byte
ranges when rank 0 announces the update (engine.tp_weights).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from gateeng.config import EngineConfig
from gateeng.engine import tp_processes
from gateeng.logs import log


def peak_rss() -> int:
    """This process's peak resident memory in bytes (/proc's VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def write_checkpoint(files: dict) -> str:
    """A private directory holding the checkpoint `files` ({file name: bytes}): in
    memory where /dev/shm exists. The caller removes it (shutil.rmtree)."""
    shm = Path("/dev/shm")
    where = tempfile.mkdtemp(prefix="gateeng-weights-", dir=str(shm) if shm.is_dir() else None)
    try:
        for name, data in files.items():
            Path(where, name).write_bytes(data)
    except BaseException:
        shutil.rmtree(where, ignore_errors=True)
        raise
    return where


def node_address() -> str:
    import ray
    return ray.util.get_node_ip_address()


class RankActor:
    """One rank, run in the actor's thread until rank 0 stops the group (`run`)."""

    def run(self, rank: int, host: str, port: int, secret: str, timeout: float, cfg: EngineConfig) -> None:
        tp_processes.run_rank(rank, host, port, secret, timeout, cfg, cfg.num_threads or 1,
                              tp_processes.interface_of(node_address()))

    def peak_rss(self) -> int:
        return peak_rss()

    def receive_checkpoint(self, files: dict) -> str:
        """The directory on this rank's node that holds `files` (Ray hands the bytes
        over from its object store) until remove_checkpoint."""
        return write_checkpoint(files)

    def remove_checkpoint(self, where: str) -> None:
        shutil.rmtree(where, ignore_errors=True)


class _Started:
    """A started rank, as tp_processes.Group watches it (LocalRanks' doc)."""

    def __init__(self, rank: int, actor, done):
        self.name, self.actor, self.done = f"rank-{rank}", actor, done
        self.failed = False

    @property
    def exitcode(self):
        import ray
        ready, _ = ray.wait([self.done], timeout=0)
        if not ready:
            return None
        try:
            ray.get(self.done)
            return 0
        except Exception as exc:   # the actor died, or run raised: the log says why
            if not self.failed:
                self.failed = True
                log(f"tensor-parallel {self.name} ended: {exc}")
            return 1

    def join(self, timeout: float = None) -> None:
        import ray
        ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        import ray
        ray.kill(self.actor, no_restart=True)


class RayRanks:
    """Ranks 1..N-1 of one replica on bundles `bundles` of placement group `group`, each
    of `cpus` CPUs; built by the front, used in the replica's process (rank 0's), whose
    node address the group's store and gloo listen on."""

    def __init__(self, cfg: EngineConfig, group, bundles: list, cpus: int):
        self.cfg, self.group, self.bundles, self.cpus = cfg, group, bundles, cpus

    @property
    def host(self) -> str:
        return node_address()

    @property
    def interface(self) -> str:
        return tp_processes.interface_of(self.host)

    def start(self, rank: int, port: int, secret: str, timeout: float) -> _Started:
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        actor = ray.remote(RankActor).options(
            num_cpus=self.cpus, max_restarts=0, max_concurrency=3,   # run, and two calls beside it
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.group,
                                                                 placement_group_bundle_index=self.bundles[rank - 1]),
        ).remote()
        return _Started(rank, actor, actor.run.remote(rank, self.host, port, secret, timeout, self.cfg))

    @staticmethod
    def wait_any(workers: list) -> _Started:
        import ray
        ready, _ = ray.wait([w.done for w in workers], num_returns=1)
        return next(w for w in workers if w.done == ready[0])
