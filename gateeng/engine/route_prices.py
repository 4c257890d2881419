"""The route policy's start-up prices for one served model: decode passes of both
plans timed through its runner on its KV cache, or read back where this machine,
build, model and settings timed them before.

pricing.py says why traffic alone is not enough and how a set of timings is
judged; route_costs.py where they are kept and under which key (`cost_facts`).
Both import no torch; what the key reads of this process (torch's threads and
version, the CPU) is read here. The assembly (engine.assembly) calls `seed` once
per start, after the self-check passed.
"""
from __future__ import annotations

import os

import torch

from gateeng import __version__, reproducibility
from gateeng.config import EngineConfig
from gateeng.engine import pricing
from gateeng.plans import host_load


def seed(cfg: EngineConfig, route, runner, blocks, max_model_len: int, facts: dict) -> None:
    """Seed `route`'s cost models with decode-pass costs of both plans, timed on
    `runner` over throwaway sequences in `blocks` (left as they were), or those kept
    under `facts` (cost_facts)."""
    context = min(pricing.CONTEXT, max_model_len)
    limit = min(cfg.max_num_seqs, pricing.rows_that_fit(blocks, context))
    rows = sorted({min(r, limit) for r in pricing.PRICE_ROWS})
    cpu = cfg.device == "cpu"   # a GPU's passes leave the CPU idle: its share says nothing
    pricing.seed(route, pricing.decode_pass_timer(runner, blocks, context), rows, context, facts,
                 torch.get_num_threads() if cpu else 0, host_load.cpu_share if cpu else (lambda: None),
                 measure_again=cfg.recalibrate_route)


def cost_facts(cfg: EngineConfig, builds: str, invariant_plan, layout: str) -> dict:
    """What a decode pass's cost depends on besides the rows and keys priced: the
    route-cost cache's key (route_costs.py). Of the model, its `layout` (its config
    and how each weight is stored, model.fingerprint), not the weights' values: a
    new checkpoint of the same model, each step of a training run, costs what the
    one before did (as a weight update keeps the route's prices). The fast plan's
    start-up choice of matmul by row count (plans.packing.pack_fast's probe) is left
    out: it is timed too, and a key that moved with it would time the passes again
    on a busy host, whose probe is the one that errs; traffic refines the fast
    plan's costs."""
    device, isa = reproducibility.device_identity(cfg.device)
    return {
        "device": f"{cfg.device}: {device}", "isa": isa, "threads": torch.get_num_threads(),
        "isa_caps": {name: os.environ.get(name, "") for name in reproducibility.ISA_CAPS},
        "torch": torch.__version__, "gateeng": __version__, "builds": builds,
        "invariant_plan": invariant_plan.describe(cfg.dtype), "packed_weights": cfg.pack_fast_weights,
        "model_layout": layout, "dtype": cfg.dtype, "group_rows": invariant_plan.group_rows,
        "block_size": cfg.block_size, "max_num_seqs": cfg.max_num_seqs,
        "tensor_parallel_size": cfg.tensor_parallel_size, "fast_logit_noise": cfg.fast_logit_noise,
    }
