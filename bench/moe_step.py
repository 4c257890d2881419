"""A mixture of experts' decode step on the fast plan, three ways side by side in one
process on one engine (the rounds alternate, so a shared host's noise falls on all):

- `torch routing`: each routing layer's router logits, softmax, top-k and sort in torch
  (FastPlan.router_logits, route), then its experts in one C++ call (cpu_ops'
  moe_experts), layer by layer from Python;
- `C++ routing`: each routing layer in one C++ call (cpu_ops' moe_layer: routing and
  experts), layer by layer from Python;
- `one call`: every decoder layer of the step in one C++ call (cpu_ops' decode_layers,
  what the fast plan runs).

With --plan invariant, the invariant plan's decode pass (what VERIFIED rows run on)
instead, over the same running requests, beside the fast plan's (each pass the
runner's whole forward and token choice for those rows, repeated in place):

- `fast plan`: the fast plan's pass (one call, as the engine runs it);
- `invariant, per op`: each routing layer as router_logits, route, then per active
  expert linear, silu_mul, linear, then combine, called from Python;
- `invariant, one call`: each routing layer in one C++ call (ref_ops' moe_layer, what
  the reference plan runs);
- `invariant, dense logits`: the same, its greedy rows choosing from every logit
  rather than from the few the int8 logits leave (ReferencePlan.greedy_choice).

Prints ms per step (best and median of the rounds) and the tokens/s ratios.
Usage: python bench/moe_step.py MODEL.gguf [--streams 1] [--rounds 8] [--steps 15] [--plan fast|invariant]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import header, prompt_set, steady_decode  # noqa: E402

from gateeng.config import EngineConfig  # noqa: E402
from gateeng.engine.core import EngineCore  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.plans import packing  # noqa: E402
from gateeng.plans.reference import ReferencePlan  # noqa: E402
from gateeng.request import SamplingParams  # noqa: E402
from gateeng.step import PlanKind, ScheduledSeq, StepPlan  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a mixture of experts' GGUF with quantized experts")
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--plan", choices=("fast", "invariant"), default="fast",
                    help="the fast plan's step three ways, or the invariant plan's pass three ways beside it")
    args = ap.parse_args()
    loaded = load(args.model, "bfloat16")
    engine = EngineCore(EngineConfig(dtype="bfloat16"), loaded=loaded)
    if args.plan == "invariant":
        return invariant_passes(engine, args)
    plan, model = engine.fast_plan, loaded.model
    stored = packing.of(model)
    if stored.fused_layers is None or stored.fused_layers.routing is None:
        sys.exit("this model's decode steps do not run in one call here (quantized experts and int8 kernels needed)")
    one_call, moe_layer = stored.fused_layers, plan.moe_layer

    def torch_routing(model, x, layer):
        chosen, weights, margins = plan.route(plan.router_logits(x, layer.router), model.cfg.moe)
        experts = stored.expert_layers[id(layer.experts[0][0])]
        return plan.kernels.moe_experts(x, chosen, weights.float(), *experts,
                                        bool(getattr(plan.kernels, "qvnni", False))), margins
    modes = {"torch routing": (torch_routing, None), "C++ routing": (moe_layer, None), "one call": (moe_layer, one_call)}
    tokens = args.steps * (args.rounds + 1) * len(modes) + 64
    for p in prompt_set(args.streams, False):
        engine.add_request(engine.new_request(p, SamplingParams(max_tokens=tokens, ignore_eos=True), chat=True))
    steady_decode(engine)
    ms = {name: [] for name in modes}
    for _ in range(args.rounds):
        for name, (layer_fn, fused) in modes.items():
            plan.moe_layer, stored.fused_layers = layer_fn, fused
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.step()
            ms[name].append((time.perf_counter() - t0) / args.steps * 1000)
    plan.moe_layer, stored.fused_layers = moe_layer, one_call
    table(args, ms, "torch routing")


def invariant_passes(engine, args) -> None:
    """--plan invariant: the invariant plan's decode pass over the running requests, per
    op and in one call, beside the fast plan's, alternating."""
    plan = engine.invariant_plan
    if not isinstance(plan, ReferencePlan):
        sys.exit(f"the invariant plan here ({plan.describe()}) has no one-call routing layer")
    for p in prompt_set(args.streams, False):
        engine.add_request(engine.new_request(p, SamplingParams(max_tokens=512, ignore_eos=True), chat=True))
    steady_decode(engine)
    running = engine.scheduler.running
    for r in running:
        engine.scheduler.reserve(r, len(r.tokens))   # the slot of the token each decode writes

    def step(kind):
        return StepPlan([ScheduledSeq.plan(r, len(r.tokens) - 1, len(r.tokens), kind) for r in running])
    per_op = lambda *a: None   # noqa: E731  (LlamaModel._moe then runs the layer op by op)
    sparse = plan.sparse_greedy
    modes = {"fast plan": (step(PlanKind.FAST), None, sparse),
             "invariant, per op": (step(PlanKind.INVARIANT), per_op, sparse),
             "invariant, one call": (step(PlanKind.INVARIANT), None, sparse),
             "invariant, dense logits": (step(PlanKind.INVARIANT), None, False)}
    ms = {name: [] for name in modes}
    for r in range(args.rounds + 1):   # the first round warms up
        for name, (s, moe_layer, greedy_choice) in modes.items():
            if moe_layer is not None:
                plan.moe_layer = moe_layer
            plan.sparse_greedy = greedy_choice
            t0 = time.perf_counter()
            for _ in range(args.steps):
                engine.runner.run(s)
            if r:
                ms[name].append((time.perf_counter() - t0) / args.steps * 1000)
            vars(plan).pop("moe_layer", None)
    plan.sparse_greedy = sparse
    table(args, ms, "fast plan")
    print(f"\ninvariant plan: {plan.describe()}")


def table(args, ms: dict, base_name: str) -> None:
    print(f"{header()}\n")
    print(f"| decode step, {args.streams} stream(s) | ms, best | ms, median | tokens/s vs {base_name}, best "
          "| median |")
    print("| --- | --- | --- | --- | --- |")
    base = ms[base_name]
    for name, v in ms.items():
        print(f"| {name} | {min(v):.1f} | {statistics.median(v):.1f} | {min(base) / min(v):.2f}x "
              f"| {statistics.median(base) / statistics.median(v):.2f}x |")


if __name__ == "__main__":
    main()
