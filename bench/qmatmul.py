"""The matmuls on quantized weights side by side, in one process: the reference's
(each build this CPU runs: kernels/ref_ops.cpp `linear` on a `qpack`ed weight) and the
fast plan's int8 ones (kernels/cpu_ops.cpp `qlinear_avx2`, and `qlinear_vnni` where
the build has AVX-512 VNNI), on a 1.17B Llama's projection shapes (TinyLlama-1.1B's:
hidden 2048, MLP 5632, 4 KV heads of 64) in Q4_0 and Q8_0, at 1 and 8 rows.

    python bench/qmatmul.py [--rows 1 8] [--types Q4_0 Q8_0] [--repeats 20]

Per type and row count: the time of one decoder layer's four projections (qkv, o,
gate/up, down) per kernel (the best of 5 means over --repeats), and each kernel's
speed against the reference's avx2 build. Under the AVX2 emulation
(GATEENG_CPU_ISA=avx2 ...) the reference's avx2 build and cpu_ops built for AVX2 run,
so the avx512_bf16 and VNNI columns are absent.
Prints the command, the commit and the machine first.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header  # noqa: E402

from gateeng.model.gguf_weights import SERVED_QUANTIZED  # noqa: E402
from gateeng.plans import cpu_ops, reference_ops  # noqa: E402

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1")   # the types the gguf package quantizes (random weights)
HIDDEN, MLP, KV = 2048, 5632, 4 * 64
SHAPES = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * MLP, HIDDEN), "down": (HIDDEN, MLP)}


def packed_layer(kind: str, ref) -> list:
    """(packed weight, n, k) for each of a layer's projections, random weights in `kind`."""
    from gguf import GGMLQuantizationType, quants
    rng = np.random.default_rng(0)
    out = []
    for n, k in SHAPES.values():
        w = rng.standard_normal((n, k)).astype(np.float32)
        raw = quants.quantize(w, GGMLQuantizationType[kind]).view(np.uint8).reshape(n, -1)
        out.append((ref.qpack(torch.from_numpy(raw), SERVED_QUANTIZED[kind]), n, k))
    return out


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(repeats):
            fn()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0"], choices=sorted(QUANTIZABLE))
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    print(header())
    kernels = cpu_ops.load()
    isas = [reference_ops.requested()] if reference_ops.requested() else reference_ops.runnable()
    refs = {isa: reference_ops.load(isa) for isa in isas if isa != "scalar"}
    matmuls = {f"reference ({isa})": ref.linear for isa, ref in refs.items()}
    for name in ("avx2", "vnni"):
        if getattr(kernels, "q" + name, False):
            matmuls[f"int8 {name} (fast plan)"] = getattr(kernels, "qlinear_" + name)
    base = "reference (avx2)"
    print(f"\n| type | rows | {' | '.join(matmuls)} |\n| --- | --- |" + " --- |" * len(matmuls))
    for kind in args.types:
        layer = packed_layer(kind, next(iter(refs.values())))   # every build reads the one layout
        for m in args.rows:
            x = {k: torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
                 for k in {k for _, _, k in layer}}
            ms = {name: best_ms(lambda: [fn(x[k], p, n, False) for p, n, k in layer], args.repeats)
                  for name, fn in matmuls.items()}
            cells = [f"{ms[name]:.2f} ms" + (f" ({ms[base] / ms[name]:.2f}x)" if base in ms else "") for name in matmuls]
            print(f"| {kind} | {m} | {' | '.join(cells)} |", flush=True)
    print(f"\nms per decoder layer's four projections (best of 5 means over {args.repeats}); "
          f"in brackets: speed against {base}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
