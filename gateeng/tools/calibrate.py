"""`gateeng calibrate`: choose the margin threshold tau from measured flips.

The reference decode (invariant plan, greedy) gives each prompt's canonical
tokens. The fast plan then decodes the same positions teacher-forced on the
reference, under several batch compositions: the situation the gate is in, since
every token before a VERIFIED request's first flip is canonical. Like a VERIFIED
request, the prompt is prefilled on the invariant plan. At every decode step it
records the fast margin and whether the fast argmax differs from the reference
(a flip).

For a threshold tau, a step triggers when its margin < tau (a tie always does).
A flip is caught at its own step when it triggers; a missed flip is still caught
later by the window or finish trigger (VERIFIED output stays exact), but costs a
longer rollback. The miss rate is missed flips per decode step, with a one-sided
Clopper-Pearson upper bound; the recommendation is the smallest tau whose bound
meets the target.

A mixture of experts' fast steps also carry the router margin (the k-th minus the
(k+1)-th router score, smallest over the routing layers). A second table adds the
router-margin gate, a step triggering on either, for each router bound, beside the
largest tau in the table at which the margin gate alone still misses a flip (0 where
it misses none): the router gate is worth its triggers only if it catches, at a
smaller tau, what the margin gate misses there, for fewer triggers in all than the
tau that catches them alone. The recommended bound is the smallest whose miss-rate
bound meets the target (the server's --router-margin-threshold, with that tau).
"""
from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from gateeng.config import BLOCK_SIZE, EngineConfig
from gateeng.engine import gate

# What a run measures by default: decode steps per prompt, the fast path's batch
# compositions, and the bound a recommended tau must meet (missed flips per step, at
# this confidence).
TOKENS = 64
BATCH_SIZES = (1, 8, 32)
TARGET_MISS = 1e-3
CONFIDENCE = 0.95
TAUS = (0.0, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
# Router bounds for a mixture of experts (router scores are probabilities for softmax
# routing, logits for Mixtral's).
ROUTER_BOUNDS = (0.0, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3)


@dataclass
class TauRow:
    tau: float
    trigger_rate: float    # share of decode steps that trigger
    catch_rate: float      # share of flips caught at their own step
    misses: int            # flips with margin >= tau
    miss_rate: float       # misses per decode step
    miss_upper: float      # one-sided Clopper-Pearson upper bound on miss_rate


@dataclass
class Report:
    steps: int
    flips: int
    flips_by_batch: dict
    steps_by_batch: dict
    confidence: float
    target_miss: float
    recommended_tau: Optional[float]
    rows: list
    machine: dict                         # the reference engine's Reproducibility record
    margins: list = field(repr=False)     # per step, for the plot
    flipped: list = field(repr=False)
    fast_plan: str = ""                   # the fast plan's matmul, as the engine logs it
    # The fast plan changes kernel above this many rows and no batch here had more, so
    # such steps were not measured (None: none left out).
    untested_above: Optional[int] = None
    # A mixture of experts: per step, the smallest router margin; the router table (TauRow's
    # tau is the router bound) at router_tau, the largest tau that alone misses a flip;
    # and the bound it recommends.
    router_margins: list = field(default_factory=list, repr=False)
    router_rows: list = field(default_factory=list)
    router_tau: Optional[float] = None
    recommended_router: Optional[float] = None

    @property
    def flip_rate(self) -> float:
        return self.flips / max(self.steps, 1)


# ---- statistics ----------------------------------------------------------------
def _binom_cdf(k: int, n: int, p: float) -> float:
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 0.0 if k < n else 1.0
    lp, lq = math.log(p), math.log1p(-p)
    base = math.lgamma(n + 1)
    return min(1.0, sum(math.exp(base - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)
                        for i in range(k + 1)))


def clopper_pearson_upper(k: int, n: int, confidence: float = 0.95) -> float:
    """Smallest p with P(X <= k | n, p) <= 1 - confidence (one-sided exact bound)."""
    if n <= 0:
        return 1.0
    if k >= n:
        return 1.0
    lo, hi, alpha = k / n, 1.0, 1.0 - confidence
    for _ in range(80):   # bisection: the CDF falls monotonically in p
        mid = (lo + hi) / 2
        if _binom_cdf(k, n, mid) > alpha:
            lo = mid
        else:
            hi = mid
    return hi


def tau_table(margins: Sequence[float], flipped: Sequence[bool], taus=TAUS,
              confidence: float = 0.95, routers: Sequence[float] = (), tau: float = 0.0) -> list:
    """A TauRow per threshold in `taus`. With `routers` (each step's router margin),
    `taus` are router bounds and a step triggers on its margin below `tau` or its
    router margin within the bound."""
    n = len(margins)
    flips = sum(flipped)
    rows = []
    for bound in taus:
        if routers:
            trig = [gate.margin_triggers(m, tau) or gate.margin_triggers(r, bound) for m, r in zip(margins, routers)]
        else:
            trig = [gate.margin_triggers(m, bound) for m in margins]
        caught = sum(1 for t, f in zip(trig, flipped) if t and f)
        misses = flips - caught
        rows.append(TauRow(bound, sum(trig) / max(n, 1), caught / flips if flips else 1.0, misses,
                           misses / max(n, 1), clopper_pearson_upper(misses, n, confidence)))
    return rows


def recommend(rows: list, target_miss: float) -> Optional[float]:
    for row in rows:
        if row.miss_upper <= target_miss:
            return row.tau
    return None


# ---- measurement ---------------------------------------------------------------
def _reference(loaded, prompts: list, n_tokens: int, dtype: str, progress, tensor_parallel_size: int,
               kv_blocks: int, block_size: int):
    """(reference token ids per prompt, and the engine that made them: its invariant
    plan, the fast plan as it serves it (packed weights, C++ kernels), its model
    (a shard at tensor-parallel sizes > 1) and its KV cache of at least `kv_blocks`
    blocks of `block_size` positions, free again once the reference decode is done)."""
    from gateeng.config import INVARIANT, kv_blocks as default_blocks
    from gateeng.engine.core import EngineCore
    from gateeng.request import SamplingParams
    cfg = EngineConfig(plan=INVARIANT, dtype=dtype, tensor_parallel_size=tensor_parallel_size, block_size=block_size)
    cfg.num_kv_blocks = max(kv_blocks, default_blocks(cfg))
    engine = EngineCore(cfg, loaded=loaded)
    params = SamplingParams(max_tokens=n_tokens, ignore_eos=True)
    handles = [engine.add_request(engine.new_request(p, params)) for p in prompts]
    while engine.has_work():
        done = sum(h.done.is_set() for h in handles)
        engine.step()
        progress.update(sum(h.done.is_set() for h in handles) - done)
    return [h.result().token_ids for h in handles], engine


def _teacher_forced(engine, prompts: list, refs: list):
    """(margin, router margin, flipped) for every fast decode step of one batch of prompts."""
    n = min(len(r) for r in refs)
    out = []
    for t, (tokens, margins, routers) in enumerate(engine.teacher_forced(prompts, [r[:n - 1] for r in refs]),
                                                   start=1):
        out.extend((float(m), float(rm), int(k) != r[t]) for k, m, rm, r in zip(tokens, margins, routers, refs))
    return out


def calibrate(loaded, prompts: list, n_tokens: int = TOKENS, batch_sizes=BATCH_SIZES, dtype: str = EngineConfig.dtype,
              target_miss: float = TARGET_MISS, confidence: float = CONFIDENCE, block_size: int = BLOCK_SIZE,
              show_progress: bool = True, fast=None, tensor_parallel_size: int = 1) -> Report:
    """Measure flips of the fast plan against the reference; `prompts` are token-id lists.
    `fast` replaces the fast plan (tests use a noisy one to make flips). Both plans
    run through the engine's runner (EngineCore.teacher_forced), at
    `tensor_parallel_size` ranks, on a KV cache of `block_size` positions per block."""
    from tqdm import tqdm

    from gateeng.plans import packing

    groups = {b: [list(range(i, min(i + b, len(prompts)))) for i in range(0, len(prompts), b)]
              for b in batch_sizes}
    total = len(prompts) + sum(len(g) for g in groups.values())
    with tqdm(total=total, desc="calibrate", unit="batch", file=sys.stderr, disable=not show_progress) as bar:
        bar.set_postfix_str("reference decode")
        most = max(sum(-(-(len(prompts[i]) + n_tokens) // block_size) for i in g)
                   for gs in groups.values() for g in gs)
        refs, engine = _reference(loaded, prompts, n_tokens, dtype, bar, tensor_parallel_size, most, block_size)
        served = engine.fast_plan
        machine, fast_matmul = asdict(engine.reproducibility), engine.fast_matmul
        switch = packing.of(engine.model).fast_rowwise_max_rows
        fast = fast or served
        engine.replace_fast_plan(fast)
        margins, routers, flipped, flips_by, steps_by = [], [], [], {}, {}
        moe = engine.model.cfg.moe is not None
        for b, gs in groups.items():
            bar.set_postfix_str(f"fast decode, batch {b}")
            for g in gs:
                samples = _teacher_forced(engine, [prompts[i] for i in g], [refs[i] for i in g])
                margins += [m for m, _, _ in samples]
                routers += [r for _, r, _ in samples]
                flipped += [f for _, _, f in samples]
                flips_by[b] = flips_by.get(b, 0) + sum(f for _, _, f in samples)
                steps_by[b] = steps_by.get(b, 0) + len(samples)
                bar.update(1)
        engine.close()
    rows = tau_table(margins, flipped, confidence=confidence)
    if fast is not served:
        fast_matmul, switch = "replaced by the caller", None
    largest = max(len(g) for gs in groups.values() for g in gs)
    untested = switch if switch is not None and largest <= switch else None
    report = Report(len(margins), sum(flipped), flips_by, steps_by, confidence, target_miss,
                    recommend(rows, target_miss), rows, machine, margins, flipped, fast_matmul, untested)
    if moe:
        report.router_margins = routers
        report.router_tau = max((r.tau for r in rows if r.misses), default=0.0)
        report.router_rows = tau_table(margins, flipped, ROUTER_BOUNDS, confidence, routers, report.router_tau)
        report.recommended_router = recommend(report.router_rows, target_miss)
    return report


# ---- output --------------------------------------------------------------------
def markdown(report: Report) -> str:
    lines = [f"decode steps {report.steps}, flips {report.flips} ({100 * report.flip_rate:.2f}% of steps); "
             f"flips by batch size: " + ", ".join(f"{b}: {report.flips_by_batch[b]}/{report.steps_by_batch[b]}"
                                                  for b in report.flips_by_batch),
             f"fast plan: {report.fast_plan}"]
    if report.untested_above is not None:
        lines.append(f"note: the fast plan runs another kernel on steps of more than {report.untested_above} rows, "
                     "which no batch here reached; a step with more rows (a large batch, or decodes sharing a step "
                     "with prefill chunks) may flip where these did not: calibrate such batches (--batch-sizes, "
                     "with as many --prompts) before relying on a small tau there")
    lines += ["",
              f"| tau | trigger rate | flips caught at their step | missed flips | miss rate | "
              f"miss rate {100 * report.confidence:.0f}% upper bound |",
              "| --- | --- | --- | --- | --- | --- |"]
    for r in report.rows:
        lines.append(f"| {r.tau:g} | {100 * r.trigger_rate:.1f}% | {100 * r.catch_rate:.1f}% | {r.misses} | "
                     f"{r.miss_rate:.2e} | {r.miss_upper:.2e} |")
    rec = report.recommended_tau
    lines += ["", f"recommended tau: {rec:g} (smallest tau with the miss-rate bound <= {report.target_miss:g})"
              if rec is not None else
              f"no tau in the table meets --target-miss {report.target_miss:g}: measure more steps "
              "(more prompts or --tokens) or accept a higher target"]
    if report.router_rows:
        lines += ["", f"a mixture of experts: the router-margin gate beside tau = {report.router_tau:g}", "",
                  "| router bound | trigger rate | flips caught at their step | missed flips | miss rate | "
                  f"miss rate {100 * report.confidence:.0f}% upper bound |",
                  "| --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r.tau:g} | {100 * r.trigger_rate:.1f}% | {100 * r.catch_rate:.1f}% | {r.misses} | "
                  f"{r.miss_rate:.2e} | {r.miss_upper:.2e} |" for r in report.router_rows]
        bound = report.recommended_router
        lines += ["", f"recommended router bound: {bound:g} (serve with --margin-threshold {report.router_tau:g} "
                  f"--router-margin-threshold {bound:g})"
                  if bound is not None else
                  f"no router bound in the table meets --target-miss {report.target_miss:g} at this tau"]
        if bound is not None and rec is not None:
            both = next(r for r in report.router_rows if r.tau == bound).trigger_rate
            alone = next(r for r in report.rows if r.tau == rec).trigger_rate
            lines.append(f"triggers: {100 * both:.1f}% of steps with the router gate, {100 * alone:.1f}% with tau "
                         f"{rec:g} alone: " + ("the router gate costs fewer replays" if both < alone else
                                               "the margin gate alone costs fewer replays; keep the router bound 0"))
    return "\n".join(lines)


def write(report: Report, out_dir: Path, meta: dict) -> tuple[Path, Path]:
    """calibration.json and calibration.png in out_dir."""
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {**meta, "steps": report.steps, "flips": report.flips, "flip_rate": report.flip_rate,
            "flips_by_batch": report.flips_by_batch, "steps_by_batch": report.steps_by_batch,
            "confidence": report.confidence, "target_miss": report.target_miss,
            "recommended_tau": report.recommended_tau, "table": [asdict(r) for r in report.rows],
            "fast_plan": report.fast_plan, "untested_above_rows": report.untested_above,
            "router_tau": report.router_tau, "recommended_router_bound": report.recommended_router,
            "router_table": [asdict(r) for r in report.router_rows],
            "reproducibility": report.machine}
    js = out_dir / "calibration.json"
    js.write_text(json.dumps(data, indent=2))
    png = out_dir / "calibration.png"
    _plot(report, png)
    return js, png


def _plot(report: Report, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    floor = 1e-4   # a log axis cannot show 0: ties are drawn at the floor
    ms = [max(m, floor) if m == m else floor for m in report.margins]
    bins = [10 ** (i / 8) for i in range(-32, 17)]
    a.hist(ms, bins=bins, color="#7aa6c2", label="all decode steps")
    fm = [m for m, f in zip(ms, report.flipped) if f]
    a.hist(fm, bins=bins, color="#d1495b", label=f"flips ({len(fm)})")
    for m in fm:
        a.axvline(m, color="#d1495b", alpha=0.25, lw=0.8)
    if report.recommended_tau:
        a.axvline(report.recommended_tau, color="k", ls="--", label=f"tau = {report.recommended_tau:g}")
    a.set_xscale("log")
    a.set_yscale("log")
    a.set_xlabel("fast-path margin (top-1 minus top-2 logit)")
    a.set_ylabel("decode steps")
    a.set_title("Margin distribution, flips marked")
    a.legend()
    taus = [r.tau for r in report.rows if r.tau > 0]
    b.plot(taus, [100 * r.trigger_rate for r in report.rows if r.tau > 0], "o-", label="trigger rate")
    b.plot(taus, [100 * r.catch_rate for r in report.rows if r.tau > 0], "s-", label="flips caught at their step")
    if report.recommended_tau:
        b.axvline(report.recommended_tau, color="k", ls="--")
    b.set_xscale("log")
    b.set_xlabel("tau")
    b.set_ylabel("%")
    b.set_ylim(0, 105)
    b.set_title("Trigger rate and catch rate against tau")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
