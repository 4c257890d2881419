"""The matmuls' names: in kernel_plan (the Reproducibility record) and in words.
Torch-free, so the CLI can name them in its help without loading torch."""
from __future__ import annotations

# The row-invariant matmuls on the one packed copy of the weights (plans.cpu_linear),
# by their kernel_plan names, preferred first, in words: VDPBF16PS in fast math
# (kernels/cpu_ops.cpp `linear_dpbf16`), else the reference's own AVX2 matmul
# (kernels/ref_ops.cpp `linear`, its avx2 build).
CPU_DPBF16, REF_AVX2 = "cpu_dpbf16", "ref_avx2"
# A model with quantized weights (served as stored) has one matmul: the reference's own
# (kernels/ref_ops.cpp `linear`, any build), on quantized and bf16 weights alike.
REF_LINEAR = "ref_linear"
ROWWISE_MATMULS = {CPU_DPBF16: "VDPBF16PS", REF_AVX2: "AVX2 FMA (the reference's matmul)",
                   REF_LINEAR: "the reference's matmul (quantized weights as stored)"}
# The fast plan's own matmul on quantized weights (kernels/cpu_ops.cpp `qlinear_vnni`
# and, for the K-quants, `qlinear_k_vnni` where the CPU has AVX-512 VNNI, else
# `qlinear_avx2` and `qlinear_k_avx2`, the same bits): inputs
# quantized to int8 per block of 32, integer dot products; row-invariant, not the
# reference's bits.
CPU_QVNNI, CPU_QAVX2 = "cpu_qvnni", "cpu_qavx2"
QUANTIZED_MATMULS = {CPU_QVNNI: "int8 VNNI dot products on the weights as stored (inputs quantized per block of 32)",
                     CPU_QAVX2: "int8 AVX2 dot products on the weights as stored (inputs quantized per block of 32)",
                     REF_LINEAR: ROWWISE_MATMULS[REF_LINEAR]}
# The other matmuls' kernel_plan names: oneDNN's packed copy, torch.mm on the plain weight.
ONEDNN_PACKED, TORCH_MM = "onednn_packed", "torch_mm"

# The reference's name in kernel_plan: the version of kernels/SPEC.md its bits follow.
# Bump it whenever the spec changes a single bit of any result.
REFERENCE = "gateeng-ref-1"
# The builds of the reference kernels (kernels/ref_ops.cpp), preferred first; every
# one gives the spec's bits. GATEENG_CPU_ISA forces one.
AVX512_BF16, AVX2, SCALAR = "avx512_bf16", "avx2", "scalar"
REFERENCE_ISAS = (AVX512_BF16, AVX2, SCALAR)
ISA_ENV = "GATEENG_CPU_ISA"
