"""A small GRPO run, end to end: a real `gateeng serve` samples seeded VERIFIED
rollouts over its OpenAI HTTP front, the trainer (gateeng.train.Policy) recomputes
every rollout token's logprob, takes one real AdamW step, saves the weights and
pushes them into the running server with `gateeng update-weights`, every step.

    python bench/rl.py                    # 10 steps on the embedded model
    python bench/rl.py --steps 3          # a short run
    python bench/rl.py --model DIR        # a Hugging Face directory (bench/models.py --shape moe-tiny)
    python bench/rl.py --fleet 2          # rollouts from `gateeng fleet` over 2 replicas

With --fleet N the rollouts come from `gateeng fleet` with N replicas of one thread
each, on a Ray cluster of N one-CPU nodes started here (ray.cluster_utils.Cluster,
every node on 127.0.0.1), and each step's weights are pushed to every replica through
the fleet's update-weights (read once, shipped through Ray's object store, switched at
its version barrier). Each rollout's reproducibility record names the replica that
answered and the weight_version it ran on: the run reports each replica's share of the
rollouts, and every rollout of step s must have run on weight_version s.

The task: "What is A + B?" for A and B in 2..--largest, reward 1 when the last
number in the answer is A + B. Each step draws --prompts questions and samples --group
answers to each (seeds derived from the step, the question and the sample), the
group's rewards normalized into advantages (GRPO), and one clipped policy-gradient
step on them (no KL term, one update per batch: on-policy).

Per step it reports the mean reward and, for each of three pairings of rollout and
trainer, the largest |logp_trainer - logp_rollout| over every sampled token and the
range of the ratio exp(logp_trainer - logp_rollout):
  gateeng        VERIFIED rollouts, gateeng's trainer (must be exactly 0 and 1)
  off            the same questions sampled OFF (fast path), gateeng's trainer
  transformers   the VERIFIED rollouts, recomputed by transformers in bf16 (the usual trainer)
The weight push time per step is the server's own (the fleet's: read, ship, prepare
on every replica, swap). Writes rl.json and rl.png into --out (default: the run's own temporary directory,
outside the tree; `--out bench` refreshes the figure bench/RESULTS.md shows); prints a
markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import command, commit, machine  # noqa: E402
from ray_cluster import local_cluster  # noqa: E402  (before Ray loads: every node on 127.0.0.1)
from servers import free_port  # noqa: E402

from gateeng.train import Policy  # noqa: E402

TEMPERATURE = 1.0


def question(rng: random.Random, largest: int) -> tuple:
    a, b = rng.randint(2, largest), rng.randint(2, largest)
    return f"What is {a} + {b}? Answer with the number only.", a + b


def reward(text: str, answer: int) -> float:
    """1 when the answer's last number is the sum (the model often restates the
    question first: "3 + 4 = 7")."""
    numbers = re.findall(r"-?\d+", text)
    return 1.0 if numbers and int(numbers[-1]) == answer else 0.0


class Server:
    """`gateeng serve` with its HTTP front and an admin token, on loopback; with `fleet`
    replicas, `gateeng fleet` on a local Ray cluster of that many one-CPU nodes."""

    def __init__(self, workdir: Path, model: Optional[str], fleet: int = 0):
        self.grpc, self.http = free_port(), free_port()
        self.token = workdir / "admin-token"
        self.token.write_text(os.urandom(16).hex())
        self.token.chmod(0o600)
        self.log = open(workdir / "server.log", "w")
        # --dequantize: the embedded GGUF as the bf16 model the policy computes and update-weights replaces
        which = ["--model", model] if model else ["--dequantize"]
        self.cluster = local_cluster(fleet) if fleet else None
        how = ["fleet", "--replicas", str(fleet), "--threads", "1", "--ray-address", self.cluster.address] \
            if fleet else ["serve"]
        self.proc = subprocess.Popen([sys.executable, "-m", "gateeng.tools.cli", *how, *which, "--port", str(self.grpc),
                                      "--http-port", str(self.http), "--metrics-port", "-1",
                                      "--admin-token-file", str(self.token)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        import openai
        self.api = openai.OpenAI(base_url=f"http://127.0.0.1:{self.http}/v1", api_key="unused", max_retries=0)
        deadline = time.time() + 900
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/health", timeout=5):
                    pass       # 200 once the model is loaded and checked
                self.model = self.api.models.list().data[0].id
                return
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    self.stop()
                    raise RuntimeError(f"the server did not start (see {self.log.name})")
                time.sleep(1)

    def sample(self, text: str, seed: int, mode: str, max_tokens: int) -> dict:
        res = self.api.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": text}],
            max_tokens=max_tokens, temperature=TEMPERATURE, seed=seed, logprobs=True,
            extra_body={"determinism": {"mode": mode}})
        replay, record = res.model_extra["replay"], res.model_extra["reproducibility"]
        return {"text": res.choices[0].message.content, "prompt": replay["prompt_token_ids"],
                "tokens": replay["token_ids"], "logprobs": [c.logprob for c in res.choices[0].logprobs.content],
                "fingerprint": res.system_fingerprint, "replica": record.get("replica") or "",
                "weight_version": record["weight_version"], "answer": res}

    def update(self, directory: Path) -> tuple:
        """(the command's wall time, the server's own time for the update)."""
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "gateeng.tools.cli", "update-weights", "--server",
                              f"127.0.0.1:{self.grpc}", str(directory), "--admin-token-file", str(self.token)],
                             check=True, capture_output=True, text=True).stdout
        return time.perf_counter() - t0, float(re.search(r", ([0-9.]+) s, ", out).group(1))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(60)
        self.log.close()
        if self.cluster is not None:
            self.cluster.shutdown()


def compare(trainer: list, rollouts: list) -> dict:
    """Largest |logp_trainer - logp_rollout| and the ratio's range, over every token."""
    diffs = [float(t) - r for lp, roll in zip(trainer, rollouts) for t, r in zip(lp.tolist(), roll["logprobs"])]
    ratios = [math.exp(d) for d in diffs]
    return {"max_abs_diff": max(abs(d) for d in diffs), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "tokens_differing": sum(d != 0 for d in diffs), "tokens": len(diffs)}


def transformers_logprobs(hf, policy: Policy, rollouts: list) -> list:
    """The usual trainer: transformers in bf16 on the policy's bf16 weights."""
    with torch.no_grad():
        hf.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in policy.model.hf_state_dict().items()},
                           strict=False)
        out = []
        for r in rollouts:
            ids = torch.tensor([r["prompt"] + r["tokens"]])
            logits = hf(ids).logits[0].float() / TEMPERATURE
            lp = torch.log_softmax(logits, -1)[len(r["prompt"]) - 1:-1]
            out.append(lp.gather(1, torch.tensor(r["tokens"])[:, None])[:, 0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: the embedded model)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--prompts", type=int, default=2, help="questions per step")
    ap.add_argument("--group", type=int, default=8, help="samples per question (GRPO's group)")
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--largest", type=int, default=20, help="the largest operand")
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fleet", type=int, default=0, metavar="N",
                    help="sample from `gateeng fleet` with N replicas on a local N-node Ray cluster "
                         "(default 0: one `gateeng serve`)")
    ap.add_argument("--out", type=Path, default=None,
                    help="where rl.json and rl.png go (default: the run's temporary directory)")
    args = ap.parse_args()
    if args.fleet < 0:
        ap.error(f"--fleet must be 0 (one server) or a number of replicas, got {args.fleet}")
    from transformers import AutoModelForCausalLM
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="gateeng-rl-"))
    out = args.out or work
    out.mkdir(parents=True, exist_ok=True)
    where = f"a fleet of {args.fleet} replicas" if args.fleet else "one server"
    print(f"rl: {args.steps} steps, {args.prompts} x {args.group} samples from {where}; {machine()}", file=sys.stderr,
          flush=True)
    policy = Policy.load(args.model)
    hf = AutoModelForCausalLM.from_pretrained(policy.hf_dir, dtype=torch.bfloat16).eval()
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr)
    server = Server(work, args.model, args.fleet)
    steps = []
    try:
        pool = ThreadPoolExecutor(args.prompts * args.group)
        for step in range(args.steps):
            qs = [question(rng, args.largest) for _ in range(args.prompts)]
            seeds = [[(args.seed * 1000 + step) * 1000 + q * 100 + i for i in range(args.group)]
                     for q in range(args.prompts)]
            t0 = time.perf_counter()
            jobs = {mode: [pool.submit(server.sample, text, seed, mode, args.max_tokens)
                           for (text, _), group in zip(qs, seeds) for seed in group] for mode in ("verified", "off")}
            rolls = {mode: [j.result() for j in js] for mode, js in jobs.items()}
            rollout_s = time.perf_counter() - t0
            verified = rolls["verified"]
            rewards = [reward(r["text"], qs[i // args.group][1]) for i, r in enumerate(verified)]
            adv = []
            for q in range(args.prompts):
                g = rewards[q * args.group:(q + 1) * args.group]
                mean, std = sum(g) / len(g), (sum((x - sum(g) / len(g)) ** 2 for x in g) / len(g)) ** 0.5
                adv += [(x - mean) / (std + 1e-6) for x in g]
            # The usual trainer, on the weights the rollouts were sampled with (before the step).
            t0 = time.perf_counter()
            tf = compare(transformers_logprobs(hf, policy, verified), verified)
            transformers_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            opt.zero_grad()
            # The rollouts as the server answered them: ids, sampling and weights checked from their records.
            lps = policy.logprobs_from([r["answer"] for r in verified])
            ours = compare(lps, verified)
            with torch.no_grad():   # OFF answers logprobs_from refuses: their ids and sampling passed by hand
                off = compare(policy.logprobs([r["prompt"] + r["tokens"] for r in rolls["off"]],
                                              [len(r["prompt"]) for r in rolls["off"]], temperature=TEMPERATURE),
                              rolls["off"])
            loss = 0
            for lp, r, a in zip(lps, verified, adv):
                ratio = torch.exp(lp - torch.tensor(r["logprobs"]))
                loss = loss - torch.min(ratio * a, ratio.clamp(1 - args.clip, 1 + args.clip) * a).mean()
            (loss / len(verified)).backward()
            opt.step()
            train_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            policy.save(work / f"step{step}")
            save_s = time.perf_counter() - t0
            update_s, server_update_s = server.update(work / f"step{step}")
            fingerprints = {r["fingerprint"] for r in verified}
            every = verified + rolls["off"]
            shares = {name: sum(r["replica"] == name for r in every) for name in sorted({r["replica"] for r in every})}
            steps.append({"step": step, "reward": sum(rewards) / len(rewards), "gateeng": ours, "off": off,
                          "transformers": tf, "rollout_s": rollout_s, "train_s": train_s,
                          "transformers_s": transformers_s, "save_s": save_s, "update_s": update_s,
                          "server_update_s": server_update_s,
                          "fingerprints": sorted(fingerprints), "replicas": shares,
                          "weight_versions": sorted({r["weight_version"] for r in every})})
            print(f"  step {step}: reward {steps[-1]['reward']:.2f}  gateeng max|d| {ours['max_abs_diff']:.3g} "
                  f"ratio [{ours['ratio_min']:.6f}, {ours['ratio_max']:.6f}]  off max|d| {off['max_abs_diff']:.3g}  "
                  f"transformers max|d| {tf['max_abs_diff']:.3g}  rollout {rollout_s:.1f} s, train {train_s:.1f} s, "
                  f"save {save_s:.1f} s, update {update_s:.1f} s (server {server_update_s:.2f} s)"
                  + (f", rollouts by replica {shares}" if args.fleet else ""), file=sys.stderr, flush=True)
    finally:
        server.stop()
    report(args, steps, out)
    exact = all(st["gateeng"]["tokens_differing"] == 0 for st in steps)
    # Each step's rollouts ran on the previous step's pushed weights: one new fingerprint
    # a step, and step s's rollouts all on weight_version s.
    pushed = all(len(st["fingerprints"]) == 1 and st["weight_versions"] == [st["step"]] for st in steps) and \
        len({st["fingerprints"][0] for st in steps}) == len(steps)
    return 0 if exact and pushed else 1


def report(args, steps: list, out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    at = commit()
    result = {"machine": machine(), "commit": at, "command": command(),
              "args": vars(args), "steps": steps}
    (out / "rl.json").write_text(json.dumps(result, indent=1, default=str))
    xs = [st["step"] for st in steps]
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.5))
    axes[0].plot(xs, [st["reward"] for st in steps], marker="o")
    axes[0].set(title="mean reward", xlabel="step", ylim=(-0.05, 1.05))
    for key, label in (("gateeng", "gateeng trainer, VERIFIED rollouts"), ("off", "gateeng trainer, OFF rollouts"),
                       ("transformers", "transformers bf16 trainer, VERIFIED rollouts")):
        axes[1].plot(xs, [st[key]["max_abs_diff"] for st in steps], marker="o", label=label)
        axes[2].plot(xs, [st[key]["ratio_max"] for st in steps], marker="^", label=f"{label}: max")
        axes[2].plot(xs, [st[key]["ratio_min"] for st in steps], marker="v", linestyle="--", label=f"{label}: min")
    axes[1].set(title="max |logp_trainer - logp_rollout|", xlabel="step", yscale="symlog")
    axes[1].set_yscale("symlog", linthresh=1e-6)
    axes[2].set(title="ratio exp(logp_trainer - logp_rollout)", xlabel="step")
    axes[1].legend(fontsize=7)
    axes[2].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(f"bench/rl.py at {at}: {machine()}", fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "rl.png", dpi=110)
    fleet = " | rollouts by replica" if args.fleet else ""
    print("| step | reward | gateeng max abs diff | gateeng ratio | OFF max abs diff | OFF ratio "
          f"| transformers max abs diff | transformers ratio | update s (command / server){fleet} |")
    print("| --- " * (10 if args.fleet else 9) + "|")
    for st in steps:
        g, o, t = st["gateeng"], st["off"], st["transformers"]
        shares = " | " + ", ".join(f"{k} {v}" for k, v in st["replicas"].items()) if args.fleet else ""
        print(f"| {st['step']} | {st['reward']:.2f} | {g['max_abs_diff']:.3g} | {g['ratio_min']:.4f}-{g['ratio_max']:.4f} "
              f"| {o['max_abs_diff']:.3g} | {o['ratio_min']:.4f}-{o['ratio_max']:.4f} | {t['max_abs_diff']:.3g} "
              f"| {t['ratio_min']:.4f}-{t['ratio_max']:.4f} | {st['update_s']:.2f} / {st['server_update_s']:.2f}{shares} |")
    total = sum(st["gateeng"]["tokens"] for st in steps)
    differing = sum(st["gateeng"]["tokens_differing"] for st in steps)
    print(f"\ngateeng trainer vs VERIFIED rollouts: {differing} of {total} tokens differ over the run")
    if args.fleet:
        shares: dict = {}
        for st in steps:
            for name, n in st["replicas"].items():
                shares[name] = shares.get(name, 0) + n
        pushes = [st["server_update_s"] for st in steps]
        print(f"rollouts by replica over the run: {shares}; weight push to every replica (the fleet's own time) "
              f"{min(pushes):.2f}-{max(pushes):.2f} s a step")
    print(f"wrote {out / 'rl.json'} and {out / 'rl.png'}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
