"""A Ray cluster of several nodes on this machine (ray.cluster_utils.Cluster), every
node, and every driver started beside it, on 127.0.0.1 only: the fleet benches' stand-in
for several machines."""
from __future__ import annotations

import os

# Ray keeps its nodes and drivers on 127.0.0.1 with this set before it loads; processes
# started from here (a `gateeng fleet` front) inherit it.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"


def local_cluster(nodes: int, cpus: int = 1, object_store_mb: int = 600):
    """`nodes` Ray nodes of `cpus` CPUs each on 127.0.0.1; the caller shuts it down
    (Cluster.shutdown). Its `address` is what `gateeng fleet --ray-address` takes."""
    from ray.cluster_utils import Cluster
    node = dict(num_cpus=cpus, node_ip_address="127.0.0.1", object_store_memory=object_store_mb * 2 ** 20)
    cluster = Cluster(initialize_head=True, head_node_args=dict(node, include_dashboard=False))
    for _ in range(nodes - 1):
        cluster.add_node(**node)
    cluster.wait_for_nodes()
    return cluster
