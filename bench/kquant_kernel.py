"""The fast plan's K-quant matmul (kernels/cpu_ops.cpp `qlinear_k_avx2`, or
`qlinear_k_vnni` where the CPU has AVX-512 VNNI) against the
memory it reads: on a 1.17B Llama's shapes (TinyLlama-1.1B's: hidden 2048, MLP 5632,
4 KV heads of 64, vocab 32000), per type, the time of one call and the bytes it reads
per second, beside a plain streaming read of as many bytes (torch.sum over float32,
the ceiling), the fast plan's Q4_0 kernel on the same shape, and, given --llama-lib,
llama.cpp's own dot products (ggml_vec_dot_q4_K_q8_K and its kin, one call per row,
the rows split over as many OpenMP threads) on the same weights as stored.

    python bench/kquant_kernel.py [--rows 1] [--types Q4_K Q6_K] [--rounds 12] [--threads N]
        [--llama-lib $LLAMA/build/bin]

Each shape's weight is held in enough copies (random bytes as stored, with finite
binary16 scales; qpack'ed for gateeng) that a pass over them all is several times the
last-level cache, and every timed call reads the next copy: the bytes come from memory,
as in a decode step. The contenders take turns, one pass each per round, and each
keeps its best pass of --rounds (neighbours on a shared host only ever add time).
GB/s counts the bytes each reads (gateeng's packed records are 2.8% larger than
Q4_K's stored blocks, as large as Q6_K's). Prints the command, the commit and the
machine (CPU model and ISA flags) first.
"""
from __future__ import annotations

import argparse
import ctypes
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import header  # noqa: E402

from gateeng.model.gguf_weights import SERVED_QUANTIZED  # noqa: E402
from gateeng.plans import cpu_ops, reference_ops  # noqa: E402

HIDDEN, MLP, KV, VOCAB = 2048, 5632, 4 * 64, 32000
SHAPES = {"qkv": (HIDDEN + 2 * KV, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * MLP, HIDDEN),
          "down": (HIDDEN, MLP), "lm_head": (VOCAB, HIDDEN)}
# Stored bytes per block, its values, where its binary16 scales sit and how many.
STORED = {"Q4_0": (18, 32, 0, 1), "Q4_K": (144, 256, 0, 2), "Q5_K": (176, 256, 0, 2), "Q6_K": (210, 256, 208, 1)}
SPAN = 128 << 20   # the bytes each contender's copies hold together: 4x a 32 MiB L3

# llama.cpp's row dot products over a matrix as stored, the rows split in contiguous
# chunks over OpenMP threads (ggml-cpu.c splits a mat-vec's rows between its threads).
GGML_MATVEC = r"""
#include <stdint.h>
#include <stddef.h>
typedef void (*dot_t)(int, float*, size_t, const void*, size_t, const void*, size_t, int);
void ggml_vec_dot_q4_0_q8_0(int, float*, size_t, const void*, size_t, const void*, size_t, int);
void ggml_vec_dot_q4_K_q8_K(int, float*, size_t, const void*, size_t, const void*, size_t, int);
void ggml_vec_dot_q5_K_q8_K(int, float*, size_t, const void*, size_t, const void*, size_t, int);
void ggml_vec_dot_q6_K_q8_K(int, float*, size_t, const void*, size_t, const void*, size_t, int);
void quantize_row_q8_0(const float*, void*, int64_t);
void quantize_row_q8_K(const float*, void*, int64_t);
static uint8_t y[1 << 16];   /* the input, quantized once per call as ggml does */
void matvec(int ggml, const uint8_t* w, int rows, int k, const float* x, float* out, int threads) {
  const int qk = ggml == 2 ? 32 : 256;
  const size_t row_bytes = (size_t)k / qk * (ggml == 2 ? 18 : ggml == 12 ? 144 : ggml == 13 ? 176 : 210);
  const dot_t dot = ggml == 2 ? ggml_vec_dot_q4_0_q8_0 : ggml == 12 ? ggml_vec_dot_q4_K_q8_K
                  : ggml == 13 ? ggml_vec_dot_q5_K_q8_K : ggml_vec_dot_q6_K_q8_K;
  if (qk == 32) quantize_row_q8_0(x, y, k); else quantize_row_q8_K(x, y, k);
  #pragma omp parallel for num_threads(threads) schedule(static)
  for (int r = 0; r < rows; ++r) dot(k, out + r, 0, w + r * row_bytes, 0, y, 0, 1);
}
"""


def ggml_matvec(lib_dir: Path):
    """llama.cpp's matvec (GGML_MATVEC) compiled against its libggml-cpu in lib_dir."""
    out = Path(tempfile.mkdtemp()) / "ggml_matvec.so"
    src = out.with_suffix(".c")
    src.write_text(GGML_MATVEC)
    subprocess.run(["cc", "-O2", "-fopenmp", "-shared", "-fPIC", "-o", str(out), str(src), f"-L{lib_dir}",
                    "-lggml-cpu", "-lggml-base", f"-Wl,-rpath,{lib_dir}"], check=True)
    fn = ctypes.CDLL(str(out)).matvec
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int]
    return fn


def random_stored(kind: str, n: int, k: int, seed: int) -> np.ndarray:
    """GGUF rows of random bytes with small finite binary16 scales (the kernels' speed
    does not depend on the values)."""
    size, block, at, halves = STORED[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // block, size), dtype=np.uint8)
    scales = (rng.standard_normal((n, k // block, halves)) * 0.01).astype(np.float16)
    raw[..., at:at + 2 * halves] = scales.view(np.uint8)
    return np.ascontiguousarray(raw.reshape(n, -1))


def copies(one: torch.Tensor) -> list:
    return [one] + [one.clone() for _ in range(max(1, SPAN // one.numel()) - 1)]


def fast_kernel(kernels, kind: str):
    """The fast plan's int8 kernel for `kind`: AVX-512 VNNI where built, else AVX2."""
    vnni = getattr(kernels, "qvnni", False)
    if kind == "Q4_0":
        return kernels.qlinear_vnni if vnni else kernels.qlinear_avx2
    return kernels.qlinear_k_vnni if vnni else kernels.qlinear_k_avx2


def contenders(kind: str, n: int, k: int, m: int, ref, kernels, ggml) -> dict:
    """name: (bytes one call reads, the calls of one pass over the copies)."""
    raw = torch.from_numpy(random_stored(kind, n, k, seed=n + k))
    packed = copies(ref.qpack(raw, SERVED_QUANTIZED[kind]))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    fn = fast_kernel(kernels, kind)
    out = {f"gateeng {kind}": (packed[0].numel(), lambda: [fn(x, p, n, False, 0) for p in packed])}
    if ggml is not None and m == 1:
        stored = copies(raw)
        xf, y, threads = x.float().contiguous(), torch.empty(n), torch.get_num_threads()
        out[f"llama.cpp {kind}"] = (raw.numel(), lambda: [ggml(SERVED_QUANTIZED[kind], s.data_ptr(), n, k,
                                                                xf.data_ptr(), y.data_ptr(), threads) for s in stored])
    probe = [torch.ones(packed[0].numel() // 4) for _ in packed]
    out[f"stream {kind}"] = (packed[0].numel(), lambda: [b.sum() for b in probe])
    return out


def best_rates(runs: dict, rounds: int) -> dict:
    """name: the best bytes/s of one call over `rounds` turns of a pass each."""
    best = {name: float("inf") for name in runs}
    for name, (_, one_pass) in runs.items():
        one_pass()   # warm: pages faulted in, code built
    for _ in range(rounds):
        for name, (_, one_pass) in runs.items():
            t0 = time.perf_counter()
            done = one_pass()
            best[name] = min(best[name], (time.perf_counter() - t0) / len(done))
    return {name: (runs[name][0] / s, s) for name, s in best.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1])
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K"], choices=["Q4_K", "Q5_K", "Q6_K"])
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, help="torch's threads (and llama.cpp's): default torch's")
    ap.add_argument("--llama-lib", type=Path, help="llama.cpp's build/bin (libggml-cpu.so): its dot products too")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(header())
    kernels = cpu_ops.load()
    if kernels is None or not hasattr(kernels, "qlinear_k_avx2"):
        sys.exit("this build of the CPU kernels has no qlinear_k_avx2 (an AVX2 CPU is needed)")
    ref = reference_ops.load(reference_ops.requested() or reference_ops.runnable()[0])
    ggml = ggml_matvec(args.llama_lib) if args.llama_lib else None
    print(f"\ngateeng's kernels: {fast_kernel(kernels, 'Q4_0').__name__}, {fast_kernel(kernels, 'Q4_K').__name__}")
    print("\nPer call: ms, the GB/s of the bytes it reads, and in brackets that as a share of the streaming "
          "read of as many bytes (torch.sum over float32) in the same rounds.\n")
    cols = ["Q4_0"] + args.types
    heads = [f"gateeng {t}" for t in cols] + ([f"llama.cpp {t}" for t in cols] if ggml else [])
    print("| shape | n x k | rows | " + " | ".join(heads) + " |")
    print("| --- | --- | --- |" + " --- |" * len(heads))
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for m in args.rows:
            cells = {}
            for kind in cols:
                rates = best_rates(contenders(kind, n, k, m, ref, kernels, ggml), args.rounds)
                stream = rates.pop(f"stream {kind}")[0]
                for name, (rate, s) in rates.items():
                    cells[name] = f"{s * 1e3:.3f} ms, {rate / 1e9:.1f} GB/s ({100 * rate / stream:.0f}%)"
            print(f"| {shape} | {n} x {k} | {m} | " + " | ".join(cells.get(h, "-") for h in heads) + " |", flush=True)
    print(f"\n{torch.get_num_threads()} threads; the best pass of {args.rounds} rounds over "
          f"{SPAN >> 20} MiB of copies per contender.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
