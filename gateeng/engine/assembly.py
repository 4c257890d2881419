"""The served parts, assembled in one place: EngineCore's start-up and a weight swap
both call `assemble`, and nothing else installs plans in a runner.

From (config, loaded): the model, or this process's shard of it at tensor-parallel
sizes > 1 (engine.tp_processes, which starts the workers); both plans
(plans.factory); the KV cache, its tensors and its block accounting; the runner
with the plans installed; the start-up self-check of the invariant plan; the route
policy, its prices seeded (engine.route_prices); and the Reproducibility record of
every answer on these weights.

A weight swap hands in the new model with its plans, built aside
(engine.weights.prepare), and the parts served until then: the KV cache, the
self-check (which ran on the weights' shapes), the route policy with its prices
and the tensor-parallel group stay, since the shapes, dtype and kernels are the
same; the runner and the record are new. The control path (scheduler,
verification, outputs) is EngineCore's.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from gateeng import __version__, reproducibility
from gateeng.config import ADAPTIVE, FAST, EngineConfig, kv_blocks
from gateeng.engine import route_prices, tp_processes
from gateeng.engine.block_manager import BlockManager
from gateeng.engine.route import RoutePolicy
from gateeng.model.llama import KVCache, LlamaModel
from gateeng.model.loader import DTYPES, LoadedModel
from gateeng.plans import factory
from gateeng.plans.runner import ModelRunner
from gateeng.plans.selfcheck import SelfCheckResult, run_selfcheck


@dataclass(frozen=True)
class Served:
    """One weight version's served parts (`assemble`)."""
    loaded: LoadedModel                   # as loaded (its model the shard where the engine owned it)
    model: LlamaModel                     # what the runner runs: this process's shard at tensor-parallel sizes > 1
    plans: factory.Plans
    kv: KVCache
    blocks: BlockManager                  # the KV cache's blocks, as the scheduler accounts them
    runner: ModelRunner                   # the model, the KV cache and both plans
    route: RoutePolicy                    # priced at start-up where the route is chosen per step
    selfcheck: SelfCheckResult
    reproducibility: reproducibility.Reproducibility   # every answer's record on these weights
    tp_group: Optional[tp_processes.Group] = None      # the workers, at tensor-parallel sizes > 1


def assemble(cfg: EngineConfig, loaded: LoadedModel, max_model_len: int, owned: bool = False,
             model: Optional[LlamaModel] = None, plans: Optional[factory.Plans] = None,
             before: Optional[Served] = None, ranks=None) -> Served:
    """The served parts of `loaded` under `cfg` (see the module doc). At start-up
    (`before` None) the model's plans are built here, and `owned` says the engine
    loaded the model for itself alone, so whatever no plan needs of it is let go
    (plain weights once packed, the whole model once sharded). Otherwise `model`
    and `plans` replace those of `before`, the parts served until now: a weight
    swap's, built aside, or another fast plan. `ranks`: tensor-parallel ranks that read
    their own shards (tp_processes.start_ranks), `loaded` then holding no weights."""
    if before is None:
        loaded, model, plans, tp_group = _model_and_plans(cfg, loaded, owned, ranks)
        shape = model.cfg   # the shard's heads and columns at sizes > 1
        blocks = kv_blocks(cfg)
        kv = KVCache(shape, blocks, cfg.block_size, DTYPES[cfg.dtype], cfg.device)
        block_manager = BlockManager(blocks, cfg.block_size, cfg.enable_prefix_caching)
        route = RoutePolicy(cfg.verified_route, group_rows=plans.invariant.group_rows,
                            replay_delay=cfg.max_verify_delay)
    else:
        kv, block_manager, route, tp_group = before.kv, before.blocks, before.route, before.tp_group
    runner = ModelRunner(model, kv, plans.fast, plans.invariant, plans.sample, plans.logprobs)
    if before is None:
        selfcheck = run_selfcheck(plans.invariant, shape.hidden_size, shape.num_heads, shape.num_kv_heads,
                                  shape.head_dim, DTYPES[cfg.dtype], cfg.block_size, device=cfg.device,
                                  weights=plans.invariant.selfcheck_weights(model))
        if cfg.plan == FAST and cfg.verified_route == ADAPTIVE and selfcheck.passed:
            facts = route_prices.cost_facts(cfg, plans.builds, plans.invariant, loaded.layout or loaded.fingerprint)
            route_prices.seed(cfg, route, runner, block_manager, max_model_len, facts)
    else:
        selfcheck = before.selfcheck
    record = answer_record(cfg, loaded.fingerprint, plans.invariant, selfcheck)
    return Served(loaded, model, plans, kv, block_manager, runner, route, selfcheck, record, tp_group)


def _model_and_plans(cfg: EngineConfig, loaded: LoadedModel, owned: bool, ranks=None) -> tuple:
    """(loaded, the model the runner runs, its plans, the tensor-parallel group or None)."""
    if ranks is not None:   # every rank, this one too, reads its own shard
        shard, plans, group = tp_processes.start_ranks(cfg, ranks, cfg.tensor_parallel_timeout)
        return dataclasses.replace(loaded, model=shard), shard, plans, group
    if cfg.tensor_parallel_size <= 1:
        plans = factory.build(cfg, loaded.model, loaded.config, DTYPES[cfg.dtype], owned=owned)
        return loaded, loaded.model, plans, None
    # The model becomes this process's shard (rank 0).
    shard, plans, group = tp_processes.start(cfg, loaded.model, cfg.tensor_parallel_timeout, owned=owned)
    if owned:   # the whole model is not needed past sharding: let it go
        loaded = dataclasses.replace(loaded, model=shard)
    return loaded, shard, plans, group


def answer_record(cfg: EngineConfig, fingerprint: str, invariant_plan,
                  selfcheck: SelfCheckResult) -> reproducibility.Reproducibility:
    """The Reproducibility record of every answer on the weights `fingerprint` names."""
    return reproducibility.build(
        engine_version=__version__, model_fingerprint=fingerprint, dtype=cfg.dtype,
        device=cfg.device, plan=cfg.plan, reference=invariant_plan.describe(cfg.dtype),
        self_check_passed=selfcheck.passed, self_check=selfcheck.describe(),
        tensor_parallel_size=cfg.tensor_parallel_size)
