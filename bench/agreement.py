"""One reference on every build: the same VERIFIED bits from each build of the
reference this CPU runs, and from VERIFIED requests under mixed load.

Each run is a fresh process (the build is chosen at start-up by GATEENG_CPU_ISA;
torch's own ISA by ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA where a run limits it):
the embedded SmolLM2 in bf16, --prompts chat prompts x --tokens greedy tokens with
logprobs, on an engine with plan=invariant; and once with the default build and
route, the prompts VERIFIED among as many OFF requests, all in one batch. The table
counts the prompts whose token ids or logprob bits differ from the first run's, and
gives a digest of each run's answers (token ids and logprob bits): equal digests on
two machines mean equal answers there.

The model: the embedded GGUF as served by default (its Q4_1 weights as stored), or
--model PATH; --dequantize serves it dequantized to bf16.

Usage: python bench/agreement.py [--prompts 16] [--tokens 64] [--model PATH] [--dequantize]
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import header, prompt_set  # noqa: E402


def run_one(prompts: int, tokens: int, mixed: bool, model, dequantize: bool) -> None:
    """In the child: print one JSON line (kernel_plan, build, per prompt: tokens and logprob bits)."""
    from gateeng.config import EngineConfig
    from gateeng.engine.engine import Engine
    from gateeng.request import DeterminismParams, Mode, SamplingParams
    texts = prompt_set(prompts, mixed=True)
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, logprobs=0)
    if mixed:
        engine = Engine(EngineConfig(model=model, dequantize=dequantize, num_kv_blocks=1024))
        off = prompt_set(2 * prompts, mixed=False)[prompts:]
        handles = engine.submit_many(
            texts + off, params, [DeterminismParams(Mode.VERIFIED)] * prompts + [DeterminismParams()] * prompts,
            chat=True)
        results = [h.result() for h in handles][:prompts]
    else:
        engine = Engine(EngineConfig(model=model, dequantize=dequantize, plan="invariant", num_kv_blocks=1024))
        results = engine.generate(texts, params, chat=True)
    out = {"kernel_plan": engine.core.reproducibility.kernel_plan,
           "answers": [[list(c.token_ids), [struct.unpack("<I", struct.pack("<f", lp.logprob))[0]
                                            for lp in c.logprobs]] for c in results]}
    engine.shutdown()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default=None, help="HF directory or .gguf file (default: the embedded GGUF)")
    ap.add_argument("--dequantize", action="store_true", help="serve a GGUF dequantized to bf16")
    ap.add_argument("--child", choices=["invariant", "mixed"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return run_one(args.prompts, args.tokens, args.child == "mixed", args.model, args.dequantize)
    from gateeng.plans import reference_ops
    print(header())
    torch_avx2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    runs = [(f"{isa} build, plan=invariant", {"GATEENG_CPU_ISA": isa}, "invariant")
            for isa in reference_ops.runnable()]
    if "avx2" in reference_ops.runnable():
        runs.append(("avx2 build, torch limited to AVX2, plan=invariant", dict(torch_avx2, GATEENG_CPU_ISA="avx2"),
                     "invariant"))
    runs.append(("default build, VERIFIED among as many OFF requests", {}, "mixed"))
    rows, first = [], None
    for name, env, child in runs:
        print(f"running: {name}", file=sys.stderr, flush=True)
        model = (["--model", args.model] if args.model else []) + (["--dequantize"] if args.dequantize else [])
        done = subprocess.run([sys.executable, __file__, "--child", child, "--prompts", str(args.prompts),
                               "--tokens", str(args.tokens)] + model, env=dict(os.environ, **env), cwd=ROOT,
                              capture_output=True, text=True, check=True)
        got = json.loads(done.stdout.strip().splitlines()[-1])
        first = first or got
        tokens = sum(a[0] != b[0] for a, b in zip(got["answers"], first["answers"]))
        bits = sum(a != b for a, b in zip(got["answers"], first["answers"]))
        digest = hashlib.sha256(json.dumps(got["answers"]).encode()).hexdigest()[:16]
        rows.append((name, got["kernel_plan"], tokens, bits, digest))
    what = Path(args.model).name if args.model else "the embedded SmolLM2-135M GGUF"
    served = "dequantized to bf16" if args.dequantize else "as served by default (a GGUF's quantized weights as stored)"
    print(f"\n{args.prompts} chat prompts x {args.tokens} greedy tokens, {what}, {served}\n")
    print("| run | kernel_plan | prompts whose tokens differ from the first run | ... whose tokens or logprob bits "
          "differ | answers digest |")
    print("| --- | --- | --- | --- | --- |")
    for name, plan, tokens, bits, digest in rows:
        print(f"| {name} | `{plan}` | {tokens} of {args.prompts} | {bits} of {args.prompts} | `{digest}` |")


if __name__ == "__main__":
    main()
