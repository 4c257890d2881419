"""Ray: the cluster the fleet runs on, and where its replicas go.

`connect` joins a running cluster (`ray start --head` on one machine, `ray start
--address` on the others, or KubeRay's) or, with no address, starts a local one.
`place` reserves one placement group of a bundle of `cpus` CPUs per replica and
tensor-parallel rank, STRICT_SPREAD (each bundle on its own node) where the cluster
has the nodes, else SPREAD (Ray puts the bundles on different nodes where it can),
and starts one EngineReplica per replica, which starts its ranks on its other
bundles (fleet.ranks). Ray restarts a replica that dies, up to
`max_restarts` times; the front re-runs its requests elsewhere (fleet.py).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

from gateeng.config import EngineConfig
from gateeng.fleet.ranks import RayRanks
from gateeng.fleet.replica import EngineReplica


def connect(address: Optional[str]) -> bool:
    """Join the Ray cluster at `address`, or start a local one; True if started here."""
    import ray
    if ray.is_initialized():
        return False
    if address:
        ray.init(address=address, include_dashboard=False, log_to_driver=True)
        return False
    # One machine: Ray's own servers on loopback only, like the fronts' defaults.
    ray.init(include_dashboard=False, _node_ip_address="127.0.0.1")
    return True


def strategy(bundles: int) -> str:
    """STRICT_SPREAD (every bundle on its own node) where the cluster has a node alive
    for each bundle, else SPREAD (on different nodes where it can)."""
    import ray
    return "STRICT_SPREAD" if sum(1 for n in ray.nodes() if n.get("Alive")) >= bundles else "SPREAD"


def place(config: EngineConfig, replicas: int, cpus: int, served_model_name: Optional[str], max_restarts: int,
          timeout_s: float = 600.0) -> tuple:
    """Start `replicas` EngineReplica actors on one placement group of `replicas` times
    --tensor-parallel-size bundles (strategy()): replica i on bundle i * T, its ranks
    1..T-1 (fleet.ranks) on the T-1 bundles after it; returns (the group, {name:
    handle}). Raises TimeoutError when the cluster cannot hold the bundles within
    `timeout_s` (it names what was asked)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    tp = config.tensor_parallel_size
    how = strategy(replicas * tp)
    group = placement_group([{"CPU": cpus}] * (replicas * tp), strategy=how, name="")
    if not group.wait(timeout_seconds=timeout_s):
        ray.util.remove_placement_group(group)
        raise TimeoutError(f"the Ray cluster cannot place {replicas} replicas of {tp} ranks of {cpus} CPUs each "
                           f"({how}) within {timeout_s:.0f} s (ray.cluster_resources(): "
                           f"{ray.cluster_resources()}); add nodes or lower --replicas, --tensor-parallel-size "
                           f"or --threads")
    # Every rank computes on exactly its bundle's CPUs, whatever the node's size.
    config = dataclasses.replace(config, num_threads=cpus)
    actor = ray.remote(EngineReplica).options
    handles = {}
    for i in range(replicas):
        name = f"replica-{i}"
        ranks = RayRanks(config, group, [i * tp + r for r in range(1, tp)], cpus) if tp > 1 else None
        handles[name] = actor(
            num_cpus=cpus, max_restarts=max_restarts, max_task_retries=0, max_concurrency=1000,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i * tp),
        ).remote(config, name, served_model_name, ranks)
    return group, handles
