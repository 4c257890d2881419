"""Several machines: replicas of the engine as Ray actors behind one front.

    cluster.py   Ray: connect or start one, place the replicas (one placement-group
                 bundle of --threads CPUs per replica and rank, spread across nodes)
    replica.py   EngineReplica, the Ray actor: one Engine, its metrics, weights staged
                 and swapped on command
    ranks.py     a replica's tensor-parallel ranks 1..N-1 as Ray actors on its other
                 bundles, each reading its own shard
    router.py    where a request goes: least loaded, with prefix affinity (pure)
    fleet.py     Fleet: what the serving gateway calls an engine, over the replicas;
                 failover, the weight push and its version barrier
    metrics.py   the fleet's /metrics: the front's series and every replica's, each
                 replica's carrying a `replica` label
    serve.py     `gateeng fleet`: the existing server (gRPC, HTTP, /metrics) over a Fleet
"""
