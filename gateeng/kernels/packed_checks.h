// The argument checks of a matmul on a packed weight, shared by the reference
// (ref_ops.cpp, which owns the layouts: `pack` for bf16 weights, `qpack` for a GGUF's
// quantized ones) and the fast plan (cpu_ops.cpp, which reads the same layouts).
// A header of the kernels' folder: cpp_build's digest hashes it with each source.
#pragma once

#include <torch/extension.h>

namespace gateeng {

constexpr int64_t QK = 32;   // values per GGUF block

// x is bf16 [M, K]; packed is pack() of an [n, K] weight: [ceil(n / 16), K / 2, 16, 2] bf16.
inline void check_packed(const torch::Tensor& x, const torch::Tensor& packed, int64_t n) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.device().is_cpu(), "x must be bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 4 && packed.size(2) == 16 &&
                  packed.size(3) == 2 && packed.is_contiguous(), "packed must come from the reference's pack");
  TORCH_CHECK(packed.size(1) * 2 == x.size(1) && (n + 15) / 16 == packed.size(0),
              "packed weight does not match x or n");
}

// x is bf16 [M, K]; packed is qpack() of an [n, K] quantized weight: [ceil(n / 16), K / block, record] bytes,
// `block` values per GGUF block (QK; a K-quant's super-block: 256).
inline void check_qpacked(const torch::Tensor& x, const torch::Tensor& packed, int64_t n, int64_t block = QK) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2 && x.device().is_cpu(), "x must be bf16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.is_contiguous(),
              "packed must come from the reference's qpack");
  TORCH_CHECK(packed.size(1) * block == x.size(1) && (n + 15) / 16 == packed.size(0),
              "packed weight does not match x or n");
}

}  // namespace gateeng
