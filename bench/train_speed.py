"""What the trainer's exact logprobs cost: gateeng.train.Policy's forward + backward
beside transformers' bf16 forward + backward (the usual trainer) on the same
sequences of the embedded model, alternating, in one run.

    python bench/train_speed.py                  # 8 sequences x 128 tokens, 3 rounds
    python bench/train_speed.py --seqs 16 --len 256

Both compute every completion token's logprob (the last half of each sequence) at
temperature 1 and backpropagate their sum into every weight. transformers runs the
sequences as one batch (they have equal lengths: no padding); gateeng packs them into
one forward. Reports seconds per 1000 positions, each mode's median over the rounds,
and the ratio gateeng / transformers.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import command, commit, machine, report_path  # noqa: E402

from gateeng.train import Policy  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(report_path("train_speed.json")), help="the JSON report")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM
    policy = Policy.load()
    hf = AutoModelForCausalLM.from_pretrained(policy.hf_dir, dtype=torch.bfloat16)
    with torch.no_grad():   # both on the same bf16 weights
        hf.load_state_dict({k: v.detach().to(torch.bfloat16) for k, v in policy.model.hf_state_dict().items()},
                           strict=False)
    gen = torch.Generator().manual_seed(0)
    vocab = policy.config.vocab_size
    seqs = torch.randint(0, vocab, (args.seqs, args.len), generator=gen)
    prompt = args.len // 2

    def gateeng_step():
        policy.zero_grad()
        lps = policy.logprobs(seqs.tolist(), [prompt] * args.seqs)
        sum(lp.sum() for lp in lps).backward()

    def transformers_step():
        hf.zero_grad()
        logits = hf(seqs).logits[:, prompt - 1:-1].float()
        lp = torch.log_softmax(logits, -1).gather(2, seqs[:, prompt:, None])
        lp.sum().backward()

    modes = {"gateeng": gateeng_step, "transformers": transformers_step}
    for fn in modes.values():   # warm-up: kernel builds, allocator
        fn()
    times = {name: [] for name in modes}
    positions = args.seqs * args.len
    for r in range(args.rounds):
        order = list(modes) if r % 2 == 0 else list(reversed(modes))
        for name in order:
            t0 = time.perf_counter()
            modes[name]()
            times[name].append(time.perf_counter() - t0)
    per_k = {name: statistics.median(t) / positions * 1000 for name, t in times.items()}
    ratio = per_k["gateeng"] / per_k["transformers"]
    result = {"machine": machine(), "commit": commit(), "command": command(),
              "seqs": args.seqs, "len": args.len, "rounds": args.rounds, "seconds": times,
              "seconds_per_1000_positions": per_k, "ratio": ratio, "reference_build": policy.isa}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}", file=sys.stderr)
    print(f"{machine()}; reference build {policy.isa}; {args.seqs} x {args.len} tokens, {args.rounds} rounds")
    print("| trainer | forward + backward, s per 1000 positions (median) | ratio |")
    print("| --- | --- | --- |")
    print(f"| transformers bf16 | {per_k['transformers']:.2f} | 1.00 |")
    print(f"| gateeng Policy (reference forward) | {per_k['gateeng']:.2f} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
