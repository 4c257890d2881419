"""Mixed traffic: what OFF requests keep and what VERIFIED requests cost.

One process, one loaded model, the same prompts in every mode (greedy, bf16).
First the two plans' decode step on the same running requests, then:
  all OFF; 10 / 50 / 100% VERIFIED (adaptive route); plan=invariant (the
  server-wide batch-invariant mode); and, at 10% VERIFIED, the VERIFIED latency
  increment (VERIFIED TPOT over OFF TPOT in the same run, and a VERIFIED
  request's TPOT minus the TPOT it had in the all-OFF run) for the margin gate,
  window-only verification (tau = 0, W = 64) and always-verify (W = 1), on the
  adaptive and on the speculative route.
A mode is one batch submitted at once, on a fresh engine. TPOT is measured per
request from the times its streamed tokens came out (a VERIFIED_ONLY stream shows
a token once it is verified, so verification delays count).

Timing. By default every mode of a round runs in lockstep: each mode's engine is
stepped by hand, one step each in turn, and each engine's clock counts only its
own steps (engine time: scheduling, both plans' passes, verification, streaming;
the start-up heap frozen, as `gateeng serve` runs).
The host's noise comes and goes over seconds, far longer than a step, so it falls
on every mode alike: a ratio between modes then moves by a few percent from round
to round, where run one after another it moved by up to 30%. With --wall, every
mode instead runs alone through the threaded API (submit, the engine thread,
streams), one after another, timed by the wall clock.
Each round's ratios are taken against that round's own all-OFF and
plan=invariant runs; a second table compares each mode's fastest run, a third
the median of the per-round ratios. Each mode also reports its engine steps and
forward passes per plan: the work it adds, which the host's noise does not move.

Usage: python bench/mixed.py [--model DIR] [--prompts 20] [--tokens 96] [--rounds 3] [--wall] [--torch-ops]
       [--fast-logit-noise SIGMA] [--quick]
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import TORCH_OPS, header, prompt_set  # noqa: E402

from gateeng.config import ADAPTIVE, SPECULATIVE, EngineConfig  # noqa: E402
from gateeng.engine.engine import Engine  # noqa: E402
from gateeng.engine.core import EngineCore, Observer  # noqa: E402
from gateeng.model.loader import load  # noqa: E402
from gateeng.outputs import Chunk, Completion  # noqa: E402
from gateeng.request import DeterminismParams, Mode, SamplingParams  # noqa: E402


class PassCounter(Observer):
    """Engine steps and forward passes per plan: the work a mode adds, free of the
    host's noise."""

    def __init__(self):
        self.steps = 0
        self.passes = {"fast": 0, "invariant": 0}

    def on_step(self, record) -> None:
        self.steps += 1
        for kind in record.plan_seconds:
            self.passes[kind] += 1

    def describe(self) -> str:
        return f"{self.steps} / {self.passes['fast']} + {self.passes['invariant']}"


def run(engine, prompts, params, dets):
    """Through the threaded API, timed by the wall clock: (wall seconds, per
    request: (mode, tokens, e2e s, tpot s), completions, steps and passes)."""
    counter = PassCounter()
    engine.set_observer(counter)
    times = [[] for _ in prompts]
    done = [None] * len(prompts)
    t0 = time.perf_counter()
    handles = engine.submit_many(prompts, params, dets, chat=True)

    def collect(i, h):
        for ev in h:
            if isinstance(ev, Chunk) and ev.token_ids:
                times[i].extend([time.perf_counter()] * len(ev.token_ids))
            elif isinstance(ev, Completion):
                done[i] = (ev, time.perf_counter())

    threads = [threading.Thread(target=collect, args=(i, h)) for i, h in enumerate(handles)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    return wall, request_rows(times, done, t0), [c for c, _ in done], counter.describe()


def request_rows(times, done, t0):
    """Per request: (mode, tokens, end - t0, tpot) from its token times and (completion, end)."""
    rows = []
    for ts, (c, end) in zip(times, done):
        tpot = (ts[-1] - ts[0]) / (len(ts) - 1) if len(ts) > 1 else float("nan")
        rows.append((c.mode, c.completion_tokens, end - t0, tpot))
    return rows


class Lane:
    """One mode's engine, stepped by hand in turn with the other modes' (lockstep).
    Its clock advances only while its own step runs, and a token's time is the
    clock after the step that streamed it. The requests go straight to the
    EngineCore, with sinks that record events, since the engine thread must not
    run: it would step the engine too."""

    def __init__(self, engine, prompts, params, dets):
        engine = engine.core   # a shut-down Engine's: its thread no longer steps it
        self.engine, self.clock = engine, 0.0
        self.counter = PassCounter()
        engine.set_observer(self.counter)
        self.times = [[] for _ in prompts]
        self.done = [None] * len(prompts)
        self._events = []
        for i, (prompt, det) in enumerate(zip(prompts, dets)):
            engine.add_request(engine.new_request(prompt, params, det, chat=True), sink=partial(self._event, i))

    def _event(self, i, ev):
        self._events.append((i, ev))

    def busy(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        t0 = time.perf_counter()
        self.engine.step()
        self.clock += time.perf_counter() - t0
        for i, ev in self._events:
            if isinstance(ev, Chunk) and ev.token_ids:
                self.times[i].extend([self.clock] * len(ev.token_ids))
            elif isinstance(ev, Completion):
                self.done[i] = (ev, self.clock)
        self._events.clear()

    def result(self):
        """The same tuple as run(), on this lane's clock."""
        return self.clock, request_rows(self.times, self.done, 0.0), [c for c, _ in self.done], \
            self.counter.describe()


def lockstep(lanes) -> None:
    """Step every lane once in turn until all are done."""
    live = list(lanes)
    while live:
        for lane in live:
            lane.step()
        live = [lane for lane in live if lane.busy()]


def plan_steps_ms(loaded, batch: int, tokens: int, reps: int = 5, **config) -> tuple:
    """(fast, invariant) ms of one decode step over the same `batch` running
    requests, after `tokens` decode steps (the runner alone, both plans in turn)."""
    from gateeng.step import PlanKind, ScheduledSeq, StepPlan
    e = EngineCore(EngineConfig(**config), loaded=loaded)
    for p in prompt_set(batch, mixed=True):
        e.add_request(e.new_request(p, SamplingParams(max_tokens=tokens + 256, ignore_eos=True), chat=True))
    while not e.prefilled():
        e.step()   # every prompt prefilled (in budgeted chunks) before the decode steps count
    for _ in range(tokens):
        e.step()
    running = e.scheduler.running
    assert len(running) == batch and all(r.num_computed == len(r.tokens) - 1 for r in running)
    for r in running:
        e.scheduler.reserve(r, len(r.tokens))   # the slot of the token each decode writes
    out = []
    for kind in (PlanKind.FAST, PlanKind.INVARIANT):
        step = StepPlan([ScheduledSeq.plan(r, len(r.tokens) - 1, len(r.tokens), kind) for r in running])
        e.runner.run(step)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            e.runner.run(step)
            best = min(best, time.perf_counter() - t0)
        out.append(best * 1e3)
    return tuple(out)


WARM_UP = "Say hello."   # not among the measured prompts


def tput(rows, idx):
    """Tokens per second of these requests: their tokens over their summed times."""
    return sum(rows[i][1] for i in idx) / sum(rows[i][2] for i in idx)


def rate(rows, idx, wall):
    """Tokens per second a class produced over the run."""
    return sum(rows[i][1] for i in idx) / wall


def tpot(rows, idx):
    return statistics.median(rows[i][3] for i in idx)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face directory or GGUF (default: the embedded model)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--quick", action="store_true", help="8 prompts x 16 tokens (a smoke run)")
    ap.add_argument("--fractions", type=float, nargs="+", default=[0.1, 0.5, 1.0], help="VERIFIED fractions")
    ap.add_argument("--max-verify-delay", type=int, default=None, help="engine setting (default: its default)")
    ap.add_argument("--invariant-rows", type=int, default=0, help="engine setting (0: chosen for the CPU)")
    ap.add_argument("--rounds", type=int, default=3, help="repeat every mode; figures per round")
    ap.add_argument("--no-latency", action="store_true", help="skip the latency-increment table")
    ap.add_argument("--torch-ops", action="store_true",
                    help="both plans on torch ops and plain weights (--no-cpu-kernels --no-packed-weights): the "
                         "invariant plan then pads to row groups and costs more than the fast plan, and the fast "
                         "plan's tokens differ from the reference now and then, as on a machine whose fast kernels "
                         "are not row-invariant")
    ap.add_argument("--fast-logit-noise", type=float, default=0.0,
                    help="engine setting: Gaussian noise of this standard deviation on the fast plan's logits, "
                         "so that its tokens differ from the reference where margins are small")
    ap.add_argument("--wall", action="store_true",
                    help="run each mode alone through the threaded API, timed by the wall clock, instead of "
                         "all modes of a round in lockstep on engine time")
    args = ap.parse_args()
    if args.quick:
        args.prompts, args.tokens, args.rounds = 8, 16, 1
    n = args.prompts
    ops = dict(TORCH_OPS) if args.torch_ops else {}
    ops["fast_logit_noise"] = args.fast_logit_noise
    loaded = load(args.model, "bfloat16")
    prompts = prompt_set(n, mixed=True)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    print(header(), flush=True)

    def engine(**kw):
        if args.max_verify_delay is not None:
            kw.setdefault("max_verify_delay", args.max_verify_delay)
        kw.setdefault("invariant_rows", args.invariant_rows)
        kw.update(ops)
        kw.setdefault("num_kv_blocks", 512)   # a lockstep round holds every mode's engine at once
        e = Engine(EngineConfig(**kw), loaded=loaded)
        # Warm-up on both plans: a plan's first passes pay one-time kernel set-up. The
        # prompt is none of the measured ones, so every mode starts from the same
        # prefix cache.
        e.generate([WARM_UP] * 2, SamplingParams(max_tokens=4), [None, DeterminismParams(Mode.VERIFIED)], chat=True)
        if not args.wall:
            e.shutdown()   # lockstep steps the engine by hand: its thread must not run
        return e

    def mix(frac, det=DeterminismParams(Mode.VERIFIED)):
        k = round(n * frac)
        step = n / k if k else 0
        ver = {int(i * step) for i in range(k)}
        return [det if i in ver else None for i in range(n)], sorted(ver)

    print("Decode step per plan on the same running requests (best of 5; context after "
          f"{args.tokens // 2} decode steps):\n")
    print("| running requests | fast plan | invariant plan | invariant / fast per token |")
    print("| --- | --- | --- | --- |")
    for batch in (1, 16, 20, 32):
        fast_ms, inv_ms = plan_steps_ms(loaded, batch, args.tokens // 2, invariant_rows=args.invariant_rows, **ops)
        print(f"| {batch} | {fast_ms:.1f} ms | {inv_ms:.1f} ms | {inv_ms / fast_ms:.2f}x |", flush=True)
    print()
    base = engine()
    # The process's first full batch runs slower: not timed.
    if args.wall:
        run(base, prompts, params, [None] * n)
    else:
        lockstep([Lane(base, prompts, params, [None] * n)])
    print(f"invariant plan: {base.invariant_plan.describe()}; tau={base.margin_threshold}, "
          f"W={base.max_window}, max_verify_delay={base.config.max_verify_delay}; {n} chat prompts x "
          f"{args.tokens} tokens, greedy; {args.rounds} rounds; "
          f"{'wall clock, one mode at a time' if args.wall else 'engine time, every mode of a round in lockstep'}\n",
          flush=True)
    base.shutdown()
    gates = (("margin gate", None, None), ("window-only", 0.0, 64), ("always-verify", None, 1))
    routes = (ADAPTIVE, SPECULATIVE)
    runs = {}       # mode name -> per round: (wall, rows, completions)
    latency = {}    # (route, gate name) -> per round: (increment s, OFF TPOT ratio, replayed, rollbacks)
    same = True
    fractions = {f"{frac:.0%} VERIFIED": frac for frac in args.fractions}
    # Two groups of modes, each with its own all-OFF run: in lockstep, a group's
    # engines take turns, and the fewer they are, the shorter the noise each mode
    # may meet alone.
    groups = [[("all OFF", {}, [None] * n), ("plan=invariant", {"plan": "invariant"}, [None] * n)]
              + [(name, {}, mix(frac)[0]) for name, frac in fractions.items()]]
    if not args.no_latency:
        groups.append([("latency: all OFF", {}, [None] * n)]
                      + [((route, name), {"verified_route": route},
                          mix(0.1, DeterminismParams(Mode.VERIFIED, margin_threshold=tau, max_window=w))[0])
                         for route in routes for name, tau, w in gates])
    for k in range(args.rounds):
        results = {}
        for group in groups:
            if args.wall:
                for key, kw, dets in group:
                    e = engine(**kw)
                    results[key] = run(e, prompts, params, dets)
                    e.shutdown()
            else:
                lanes = {key: Lane(engine(**kw), prompts, params, dets) for key, kw, dets in group}
                # As `gateeng serve` does once its engine is up: the objects alive now are
                # exempt from collection (a full collection over them stalled one step of
                # one lane for 160 ms). Unfrozen after the round, so its engines can go.
                gc.collect()
                gc.freeze()
                lockstep(lanes.values())
                gc.unfreeze()
                results.update((key, lane.result()) for key, lane in lanes.items())
                del lanes
        print(f"round {k + 1} of {args.rounds} done", file=sys.stderr, flush=True)
        for name, _, _ in groups[0]:
            runs.setdefault(name, []).append(results[name])
        ref = runs["plan=invariant"][-1][2]
        for name, frac in fractions.items():
            comps = runs[name][-1][2]
            same &= all(comps[i].token_ids == ref[i].token_ids for i in mix(frac)[1])
        if args.no_latency:
            continue
        rows_off = results["latency: all OFF"][1]
        ver = mix(0.1)[1]
        off = [i for i in range(n) if i not in ver]
        for route in routes:
            for name, _, _ in gates:
                _, rows, comps, work = results[(route, name)]
                same &= all(comps[i].token_ids == ref[i].token_ids for i in ver)
                latency.setdefault((route, name), []).append((
                    statistics.median(rows[i][3] - rows_off[i][3] for i in ver), tpot(rows, off) / tpot(rows_off, off),
                    sum(comps[i].stats.replayed_tokens for i in ver), sum(comps[i].stats.mismatches for i in ver),
                    tpot(rows, ver) - tpot(rows, off), work))

    def cells(name, r, wall_off, rows_off, rows_inv):
        """One mode's table cells for one of its runs, against the given baselines."""
        wall, rows, comps, work = r
        if name == "all OFF":
            return (f"{wall:.1f} s", "1.00x", f"{rate(rows, range(n), wall):.0f}", "100%",
                    f"{tpot(rows, range(n)) * 1e3:.0f} ms", "-", "-", "-", "-", work)
        if name == "plan=invariant":
            return (f"{wall:.1f} s", f"{wall / wall_off:.2f}x", "-", "-", "-", f"{rate(rows, range(n), wall):.0f}",
                    f"{tpot(rows, range(n)) * 1e3:.0f} ms", "1.00x", "-", work)
        dets, ver = mix(fractions[name])
        off = [i for i in range(n) if i not in ver]
        spec = sum(comps[i].stats.decode_steps for i in ver)
        direct = sum(comps[i].stats.direct_steps for i in ver)
        return (f"{wall:.1f} s", f"{wall / wall_off:.2f}x", f"{rate(rows, off, wall):.0f}" if off else "-",
                f"{tput(rows, off) / tput(rows_off, off):.1%}" if off else "-",
                f"{tpot(rows, off) * 1e3:.0f} ms" if off else "-", f"{rate(rows, ver, wall):.0f}",
                f"{tpot(rows, ver) * 1e3:.0f} ms", f"{tput(rows, ver) / tput(rows_inv, ver):.2f}x", f"{spec} / {direct}",
                work)

    columns = ("| mode | time | vs all-OFF | OFF tok/s | OFF throughput kept | OFF TPOT | VERIFIED tok/s | "
              "VERIFIED TPOT | VERIFIED vs plan=invariant | VERIFIED decode steps speculative / direct | "
              "engine steps / passes fast + invariant |\n"
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    order = ["all OFF"] + list(fractions) + ["plan=invariant"]
    print("Each round against its own all-OFF and plan=invariant runs (figures per round, separated by ;):\n")
    print(columns)
    for name in order:
        per_round = [cells(name, runs[name][k], runs["all OFF"][k][0], runs["all OFF"][k][1],
                           runs["plan=invariant"][k][1]) for k in range(args.rounds)]
        print(f"| {name} | " + " | ".join("; ".join(c[j] for c in per_round) for j in range(10)) + " |")
    # Neighbours on a shared host only ever add time, so each mode's fastest run is
    # the closest to its own cost; the ratios between those runs are the steadiest.
    best = {name: min(rs, key=lambda r: r[0]) for name, rs in runs.items()}
    print(f"\nThe fastest run of each mode over the {args.rounds} rounds, against the fastest all-OFF and "
          "plan=invariant runs:\n")
    print(columns)
    for name in order:
        c = cells(name, best[name], best["all OFF"][0], best["all OFF"][1], best["plan=invariant"][1])
        print(f"| {name} | " + " | ".join(c) + " |")
    print(f"\nThe median over the {args.rounds} rounds of each round's ratios (against that round's all-OFF and "
          "plan=invariant runs):\n")
    print("| mode | vs all-OFF | OFF throughput kept | VERIFIED vs plan=invariant |\n| --- | --- | --- | --- |")
    for name in order[1:]:
        ratios = []
        for k in range(args.rounds):
            wall, rows, _, _ = runs[name][k]
            wall_off, rows_off = runs["all OFF"][k][0], runs["all OFF"][k][1]
            ver = mix(fractions[name])[1] if name in fractions else list(range(n))
            off = [i for i in range(n) if i not in ver] if name in fractions else []
            ratios.append((wall / wall_off, tput(rows, off) / tput(rows_off, off) if off else None,
                           tput(rows, ver) / tput(runs["plan=invariant"][k][1], ver)))
        kept = [r[1] for r in ratios if r[1] is not None]
        print(f"| {name} | {statistics.median(r[0] for r in ratios):.2f}x | "
              f"{f'{statistics.median(kept):.1%}' if kept else '-'} | "
              f"{statistics.median(r[2] for r in ratios):.2f}x |")
    print(f"\nVERIFIED outputs equal to the plan=invariant reference in every run: {'yes' if same else 'NO'}\n")
    if args.no_latency:
        return
    print("VERIFIED latency increment at 10% VERIFIED, two ways: (a) the median VERIFIED TPOT minus the "
          "median OFF TPOT of the same run (what verification adds to a request sharing the batch; the "
          "steadiest on a noisy host, since both come from one run), and (b) the median over the VERIFIED "
          "requests of their TPOT minus their TPOT in an all-OFF run of the same round (that also counts "
          "how much the whole batch slowed down). The adaptive route (the default) may decode VERIFIED requests "
          "directly on the invariant plan, where the gate has nothing to decide; the speculative route "
          "always speculates, so the gate alone decides what is replayed. Every speculated token is replayed "
          "once, whatever the gate, so the gates differ in how many invariant passes those replays take "
          "(the last column) and in what a late catch rolls back.\n")
    print("| route | verification | tau | W | (a) over OFF, same run | (a) vs always-verify | (b) over all-OFF run | "
          "(b) vs always-verify | OFF TPOT vs all-OFF | replayed tokens | rollbacks | "
          "engine steps / passes fast + invariant |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def ratios(res, always, j):
        return "; ".join(f"{r[j] / a[j]:.2f}x" if a[j] > 0 else "-" for r, a in zip(res, always))

    for route in routes:
        always = latency[(route, "always-verify")]
        for name, tau, w in gates:
            res = latency[(route, name)]
            print(f"| {route} | {name} | {base.margin_threshold if tau is None else tau:g} | "
                  f"{base.max_window if w is None else w} | "
                  + "; ".join(f"{r[4] * 1e3:+.1f} ms" for r in res) + f" | {ratios(res, always, 4)} | "
                  + "; ".join(f"{r[0] * 1e3:+.1f} ms" for r in res) + f" | {ratios(res, always, 0)} | "
                  + "; ".join(f"{r[1]:.2f}x" for r in res) + " | " + "; ".join(str(r[2]) for r in res) + " | "
                  + "; ".join(str(r[3]) for r in res) + " | " + "; ".join(r[5] for r in res) + " |")

if __name__ == "__main__":
    main()
