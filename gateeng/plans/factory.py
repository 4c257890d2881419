"""The one place that chooses, names and builds the kernel plans for a device.

CPU: the fast plan on the C++ kernels (cpu_ops) when they build, the model's
weights packed for it (packing, cpu_linear), torch ops otherwise. The invariant plan of a
bf16 model is the reference (ReferencePlan, gateeng-ref-1: the same bits on every
machine), and both plans sample on its arithmetic; where no build of the
reference can serve, the engine says so and refuses VERIFIED (`unavailable`). A
float32 model's invariant plan is InvariantPlan, whose bits are this machine's
(its kernel_plan names the kernels, the CPU kind is in the record).
CUDA: flashinfer for the fast plan where it is installed, the Triton kernels for
the invariant plan. Nothing else decides which matmul a plan runs or what it is
called in the Reproducibility record.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from gateeng.config import EngineConfig
from gateeng.logs import log
from gateeng.plans import cpp_build, cpu_ops, kernel_names, packing, reference_ops, sampler
from gateeng.plans.generic import FastPlan, InvariantPlan, default_invariant_rows
from gateeng.plans.reference import ReferencePlan


@dataclass
class Plans:
    fast: FastPlan
    invariant: InvariantPlan
    sample: Callable             # the sampler for the device (sampler.sample, Sampler.sample or gpu_sample)
    logprobs: Callable           # its logprobs (sampler.logprobs or Sampler.logprobs)
    fast_matmul: str             # what the fast plan multiplies with, in words (logs, calibrate)
    release_threads: Callable    # lets the calling thread's OpenMP pool go (cpu_ops.cpp)
    unavailable: str = ""        # why VERIFIED cannot be served here ('' when it can)
    # The kernel builds the plans run, by name and digest (source, compiler, flags,
    # torch): with the CPU, the model and the settings, what a pass's cost depends on.
    builds: str = ""


def build(cfg: EngineConfig, model, model_config, dtype, owned: bool = False) -> Plans:
    """Both plans for `model` on cfg.device. On CPU this packs the model's weights
    (plans.packing: pack_shared for the reference, pack_fast where cfg.pack_fast_weights
    says so). `owned`: the caller loaded the model for this engine alone, so plain
    weights that no plan multiplies are freed (packing.release_plain_weights)."""
    if model.cfg.moe is not None and (cfg.device != "cpu" or model.dtype != torch.bfloat16):
        # The Triton reference routes and combines (TritonReferencePlan), held to the CPU
        # build in the interpreter; a MoE's CUDA serving path has not run on a GPU.
        raise ValueError(f"a mixture of experts is served in bfloat16 on CPU only (asked: {cfg.dtype} on "
                         f"{cfg.device}): float32 has no reference for it, and its CUDA serving path is not "
                         "yet checked on a GPU (bench/gpu_check.py moe)")
    if cfg.device != "cpu":
        return _cuda_plans(cfg, model, model_config, dtype)
    kernels = cpu_ops.load() if cfg.cpu_kernels else None
    ops, unavailable = _reference_ops(model)
    if model.cfg.moe is not None and ops is None:
        raise ValueError(f"a mixture of experts is served only where the reference kernels can: {unavailable}")
    # A model loaded for this engine alone gives up each plain weight once packed: the
    # weights are never in memory twice, even for a moment (packing.pack_shared).
    fast_kernels = kernels if cfg.pack_fast_weights else None
    packing.pack_shared(model, ops, release=owned and cfg.pack_fast_weights, kernels=fast_kernels)
    if cfg.pack_fast_weights:
        packing.pack_fast(model, kernels, ops)
    stored = packing.of(model)
    rows = cfg.invariant_rows or default_invariant_rows(",".join(cpp_build.cpu_flags().split()))
    inv_packed, matmul = stored.invariant_packed, stored.invariant_matmul
    if not cfg.pack_fast_weights or (matmul in kernel_names.ROWWISE_MATMULS and kernels is None):
        inv_packed, matmul = {}, kernel_names.TORCH_MM   # the row-invariant matmul is one of the kernels
    packed = cfg.pack_fast_weights
    fast = FastPlan(cfg.fast_logit_noise, stored.packed if packed else {}, kernels,
                    stored.dense_head if packed else None)
    fast_matmul = _fast_matmul(stored, cfg)
    reference = ReferencePlan(model, ops, cfg.block_size, fast_kernels) if ops is not None else None
    invariant = reference or InvariantPlan(rows, cfg.attention_split, inv_packed, kernels, cfg.block_size, matmul)
    freed = packing.release_plain_weights(model) if owned and packed and reference is not None else 0
    log(f"fast plan: {fast_matmul}, {'C++ kernels' if kernels is not None else 'torch ops'} "
        f"for norms, RoPE, SiLU and attention; invariant plan {invariant.describe(cfg.dtype)}"
        + (f" ({reference.ops.isa} build)" if reference is not None else "")
        + (f"; one packed copy of the weights serves both ({freed / 2 ** 20:.0f} MiB of plain weights freed)"
           if freed else ""))
    release = kernels.release_idle_threads if kernels is not None else (lambda: None)
    builds = ", ".join([f"cpu_ops {kernels.digest}" if kernels is not None else "torch ops"]
                       + ([f"{kernel_names.REFERENCE} {reference.ops.isa} {reference.ops.digest}"]
                          if reference is not None else []))
    if reference is not None:
        chosen = sampler.Sampler(reference.ops)
        return Plans(fast, invariant, chosen.sample, chosen.logprobs, fast_matmul, release, builds=builds)
    return Plans(fast, invariant, sampler.sample, sampler.logprobs, fast_matmul, release, unavailable, builds)


def _reference_ops(model) -> tuple:
    """(the CPU reference kernels, '') for a bf16 model they apply to, else (None, why
    VERIFIED is refused: '' for another dtype, whose VERIFIED is this machine's)."""
    if model.dtype != torch.bfloat16:
        return None, ""
    if not ReferencePlan.applies(model):
        return None, f"{kernel_names.REFERENCE} is not defined for this model (a matmul with an odd K)"
    try:
        return reference_ops.load(), ""
    except reference_ops.ReferenceUnavailable as exc:
        why = f"no build of the reference {kernel_names.REFERENCE} can serve here: {exc}"
        log(f"{why}; VERIFIED requests will be refused")
        return None, why


def _fast_matmul(stored: packing.PackedWeights, cfg: EngineConfig) -> str:
    if not stored.packed or not cfg.pack_fast_weights:
        return "plain weights"
    if stored.fast_quantized_matmul is not None:
        return f"{kernel_names.QUANTIZED_MATMULS[stored.fast_quantized_matmul]}, on the one packed copy"
    kernel = kernel_names.ROWWISE_MATMULS.get(stored.invariant_matmul)
    if kernel is None:
        return "oneDNN packed weights"
    if stored.fast_rowwise_max_rows is None:
        return f"{kernel} on the shared packed weights at every row count"
    return (f"{kernel} on the shared packed weights up to {stored.fast_rowwise_max_rows} rows, a second copy of "
            "the weights above (oneDNN's, or the plain ones)")


def _cuda_plans(cfg: EngineConfig, model, mc, dtype) -> Plans:
    """flashinfer + Triton kernels, imported only here, only on CUDA. A bf16 model's
    invariant plan is the reference in Triton, sampled on the CPU reference kernels."""
    from gateeng.plans.gpu import FlashInferFastPlan, TritonInvariantPlan, TritonReferencePlan, gpu_sample, host_sampler
    fast: Optional[FastPlan]
    try:
        fast = FlashInferFastPlan(mc.num_heads, mc.num_kv_heads, mc.head_dim, dtype, cfg.device,
                                  cfg.fast_logit_noise)
    except ImportError:
        log("flashinfer is not installed (pip install 'gateeng[cuda]'): fast path uses torch attention")
        fast = FastPlan(cfg.fast_logit_noise)
    ops, unavailable = _reference_ops(model)
    matmul = "torch matmuls (cuBLAS)"
    if ops is not None:
        sample, logprobs = host_sampler(ops)
        invariant = TritonReferencePlan(cfg.block_size, model)
        return Plans(fast, invariant, sample, logprobs, matmul, lambda: None,
                     builds=f"{type(fast).__name__}, {type(invariant).__name__}, {ops.isa} {ops.digest}")
    invariant = TritonInvariantPlan(cfg.attention_split)
    return Plans(fast, invariant, gpu_sample, sampler.logprobs, matmul, lambda: None, unavailable,
                 f"{type(fast).__name__}, {type(invariant).__name__}")
