"""The matmuls' names: in kernel_plan (the Reproducibility record), in the C++
module (kernels/cpu_ops.cpp) and in words. Torch-free, so the CLI can name them
in its help without loading torch."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RowwiseMatmul:
    """A row-invariant matmul of kernels/cpu_ops.cpp. `symbol` names it in the C++
    module: the flag `<symbol>` (built for this CPU) and the functions
    `pack_<symbol>` and `linear_<symbol>`."""
    symbol: str
    instructions: str


# The row-invariant matmuls by their kernel_plan names, preferred first: the one
# table that names them in kernel_plan, in the C++ module and in words.
ROWWISE_MATMULS = {"cpu_dpbf16": RowwiseMatmul("dpbf16", "VDPBF16PS"),
                   "cpu_fma": RowwiseMatmul("fma8", "AVX2 FMA")}
# The other matmuls' kernel_plan names: oneDNN's packed copy, torch.mm on the plain weight.
ONEDNN_PACKED, TORCH_MM = "onednn_packed", "torch_mm"

# The reference's name in kernel_plan: the version of kernels/SPEC.md its bits follow.
# Bump it whenever the spec changes a single bit of any result.
REFERENCE = "gateeng-ref-1"
# The builds of the reference kernels (kernels/ref_ops.cpp), preferred first; every
# one gives the spec's bits. GATEENG_CPU_ISA forces one.
REFERENCE_ISAS = ("avx512_bf16", "avx2", "scalar")
ISA_ENV = "GATEENG_CPU_ISA"
