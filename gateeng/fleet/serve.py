"""`gateeng fleet`: the server `gateeng serve` runs (serving.server: gRPC with health,
the OpenAI-compatible HTTP front, /metrics), over a Fleet of Ray replicas instead of
one Engine. The fronts, their bounds and their refusals are the same code."""
from __future__ import annotations

import asyncio
from typing import Optional

from gateeng.config import EngineConfig, ServerConfig
from gateeng.fleet.fleet import Fleet
from gateeng.fleet.metrics import FleetRegistry
from gateeng.serving.metrics import Metrics
from gateeng.serving.server import Server


def fleet_server(config: EngineConfig, settings: ServerConfig, replicas: int, ray_address: Optional[str] = None,
                 max_restarts: int = 4, admin_token: Optional[str] = None, api_key: Optional[str] = None) -> Server:
    """A Server whose engine is a Fleet of `replicas` (built when it runs)."""
    if replicas < 1:
        raise ValueError(f"--replicas must be at least 1, got {replicas}")
    registry = FleetRegistry()
    cpus = config.num_threads or 1   # each rank's bundle (cluster.place)
    name = settings.served_model_name

    def build() -> Fleet:
        fleet = Fleet(config, replicas, cpus, name, max_restarts, ray_address)
        registry.fleet = fleet
        return fleet
    return Server(config, settings, admin_token=admin_token, api_key=api_key, engine_factory=build,
                  metrics=Metrics(registry))


def run(server: Server) -> int:
    return asyncio.run(server.run())
