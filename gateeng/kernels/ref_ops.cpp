// The reference kernels: gateeng-ref-1, the arithmetic kernels/SPEC.md writes down.
//
// Every function here computes the spec's exact sequence of IEEE-754 binary32
// operations, so every build of this file gives the same bits: the portable
// scalar build (any C++ compiler), the AVX2 FMA build and the AVX-512 BF16 build
// (gateeng/plans/reference_ops.py builds them). Rules that keep it so:
//   - built with -ffp-contract=off and without fast math: no operation is fused,
//     reordered or approximated by the compiler; a fused multiply-add appears only
//     where the spec has one (std::fma or an FMA/VDPBF16PS intrinsic), and only on
//     products of two bf16 values, which are exact in binary32;
//   - every reduction follows the spec's order (`fold`, `dot`, `sum`): no
//     reduction is left to the compiler or split across threads. Threads split
//     rows and output columns only;
//   - denormals are flushed, as VDPBF16PS does: each kernel runs under `Flush`
//     (inputs read as zero, results flushed to zero of their sign);
//   - exp and log are the spec's own polynomials, never libm;
//   - the one other way to a result: a quantized block's chain of FMAs that provably
//     rounds nothing is its exact value, summed in integers (ExactBlocks). Whether
//     it applies depends on the row's own x, never on the batch.
// A row's output depends on that row's inputs only: row-invariant at any row count.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "expert_groups.h"
#include "packed_checks.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#if defined(GATEENG_REF_AVX512BF16)
#if !(defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__))
#error "the avx512_bf16 build needs -mavx512f -mavx512bf16 -mavx512bw -mavx512vl"
#endif
#define GATEENG_REF_ISA "avx512_bf16"
#elif defined(GATEENG_REF_AVX2)
#if !(defined(__AVX2__) && defined(__FMA__))
#error "the avx2 build needs -mavx2 -mfma"
#endif
#define GATEENG_REF_ISA "avx2"
#else
#define GATEENG_REF_ISA "scalar"
#endif

namespace {

using gateeng::QK;
using gateeng::check_packed;
using gateeng::check_qpacked;

using u16 = uint16_t;
using u32 = uint32_t;

constexpr float kInf = std::numeric_limits<float>::infinity();

// Denormals flushed for this scope, on this thread: the spec's binary32 model
// (SPEC.md, "numbers"). The control register is per thread, so every parallel
// region's body takes its own.
class Flush {
 public:
#if defined(__x86_64__) || defined(__i386__)
  Flush() : saved_(_mm_getcsr()) {
    _mm_setcsr(saved_ | 0x8040u);   // FTZ (bit 15): results; DAZ (bit 6): inputs
    asm volatile("" ::: "memory");
  }
  ~Flush() {
    asm volatile("" ::: "memory");
    _mm_setcsr(saved_);
  }

 private:
  unsigned saved_;
#elif defined(__aarch64__)
  Flush() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    asm volatile("msr fpcr, %0" ::"r"(saved_ | (uint64_t(1) << 24)) : "memory");   // FZ
  }
  ~Flush() { asm volatile("msr fpcr, %0" ::"r"(saved_) : "memory"); }

 private:
  uint64_t saved_;
#else
#error "no flush-to-zero control known for this architecture"
#endif
};

inline float from_bits(u32 u) {
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline u32 to_bits(float f) {
  u32 u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}
inline float bf(u16 b) { return from_bits(static_cast<u32>(b) << 16); }   // exact

// binary32 -> bf16, round to nearest even (SPEC.md, "bf16 rounding"); NaN stays NaN.
inline u16 to_bf(float v) {   // branch-free, so loops over it vectorize
  const u32 u = to_bits(v);
  const u32 rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<u16>((u & 0x7FFFFFFFu) > 0x7F800000u ? (u >> 16) | 0x40u : rounded);
}

// The pairwise tree (SPEC.md, "the tree"): block results arrive in order l = 0..15 and
// are combined ((0+1)+(2+3))+((4+5)+(6+7)) ... as they come: lvl[i] holds the finished
// subtree of 2^i blocks waiting for its right neighbour. After l = 15, lvl[4] is the sum.
template <typename V, typename Add>
inline void fold(int l, V t, V* lvl, Add add) {
  int i = 0;
  for (; (l >> i) & 1; ++i) t = add(lvl[i], t);
  lvl[i] = t;
}
inline float add_f(float a, float b) { return a + b; }

// The dot's blocks of K (SPEC.md, "dot"); plans/tp_shapes.py DOT_BLOCKS and
// triton_reference.py DOT_BLOCKS say the same (tests/test_one_owner.py). The tree's
// arrays (lvl[5], Blocks' 4 levels) are sized for it.
constexpr int64_t DOT_BLOCKS = 16;

// The dot product of two bf16 vectors (SPEC.md, "dot"): pairs (2p, 2p+1) in DOT_BLOCKS
// blocks of ceil(pairs / DOT_BLOCKS) consecutive pairs, each block one chain of fused
// multiply-adds (the pair's odd element first), blocks combined by the tree.
inline float dot(const u16* a, const u16* b, int64_t k) {
  const int64_t pairs = (k + 1) / 2, per = (pairs + DOT_BLOCKS - 1) / DOT_BLOCKS;
  float lvl[5];
  for (int l = 0; l < DOT_BLOCKS; ++l) {
    float acc = 0.f;
    for (int64_t p = l * per, end = std::min(pairs, (l + 1) * per); p < end; ++p) {
      if (2 * p + 1 < k) acc = std::fma(bf(a[2 * p + 1]), bf(b[2 * p + 1]), acc);
      acc = std::fma(bf(a[2 * p]), bf(b[2 * p]), acc);
    }
    fold(l, acc, lvl, add_f);
  }
  return lvl[4];
}

// The sum of n binary32 values (SPEC.md, "sum"): 16 blocks of ceil(n / 16) consecutive
// values, each a chain of additions from +0, combined by the tree.
inline float sum(const float* x, int64_t n) {
  const int64_t per = (n + 15) / 16;
  float lvl[5];
  for (int l = 0; l < 16; ++l) {
    float acc = 0.f;
    for (int64_t i = l * per, end = std::min(n, (l + 1) * per); i < end; ++i) acc = acc + x[i];
    fold(l, acc, lvl, add_f);
  }
  return lvl[4];
}

// exp (SPEC.md, "exp"): Cody-Waite reduction by ln 2, the Cephes polynomial, scaled by
// 2^k built from bits. +0 below -86 (and for -inf), +inf above 88, NaN for NaN.
// Branch-free (the out-of-range cases are selected at the end, from a clamped
// argument), so loops over it vectorize: lane by lane the same operations.
inline float spec_exp(float x) {
  const float xc = std::min(std::max(x, -86.f), 88.f);
  const float t = xc * 1.44269504088896341f;
  const float k = (t + 12582912.f) - 12582912.f;   // nearest integer, ties to even
  float r = xc - k * 0.693359375f;                 // exact product: 9 bits x 8 bits
  r = r - k * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r);
  y = y + r;
  y = y + 1.f;
  float out = y * from_bits(static_cast<u32>(static_cast<int>(k) + 127) << 23);
  out = x > 88.f ? kInf : out;
  out = x < -86.f ? 0.f : out;
  return x != x ? x : out;
}

// log (SPEC.md, "log"): x = m 2^e with m in [sqrt(1/2), sqrt(2)), the Cephes
// polynomial in m - 1. -inf for 0 (a denormal reads as 0), NaN below 0, +inf for +inf.
inline float spec_log(float x) {
  if (x != x || x < 0.f) return std::numeric_limits<float>::quiet_NaN();
  if (x == 0.f) return -kInf;
  if (x == kInf) return kInf;
  const u32 u = to_bits(x);
  int e = static_cast<int>((u >> 23) & 0xFFu) - 126;
  float m = from_bits((u & 0x807FFFFFu) | 0x3F000000u);   // [0.5, 1)
  if (m < 0.707106781186547524f) {
    e -= 1;
    m = (m + m) - 1.f;
  } else {
    m = m - 1.f;
  }
  const float z = m * m;
  float y = 7.0376836292e-2f;
  y = y * m - 1.1514610310e-1f;
  y = y * m + 1.1676998740e-1f;
  y = y * m - 1.2420140846e-1f;
  y = y * m + 1.4249322787e-1f;
  y = y * m - 1.6668057665e-1f;
  y = y * m + 2.0000714765e-1f;
  y = y * m - 2.4999993993e-1f;
  y = y * m + 3.3333331174e-1f;
  y = (y * m) * z;
  const float fe = static_cast<float>(e);
  y = y + fe * -2.12194440e-4f;
  y = y + -0.5f * z;
  float out = m + y;
  out = out + fe * 0.693359375f;
  return out;
}

// ---- the matmul -------------------------------------------------------------------
// Weights packed once (pack) as [ceil(N/16)][K/2][16] pairs: per block of 16 output
// columns and per pair p, the 16 columns' (w[2p], w[2p+1]) side by side as one u32
// (the even element in the low half). Zero columns pad the last block. Output (m, n)
// is dot(x[m], w[n]): every build computes each column's 16 block chains over the
// same pairs, in the same order, and folds them by the same tree.

// tile(rows, r, b, next) over row tiles of up to MR rows (from row r) and column
// blocks b; `next` is the following block's weights, prefetched while this one
// computes (or nullptr). Threads split column blocks; each runs over the whole K.
template <int MR, typename F>
inline void with_rows(int mr, F&& f) {
  if constexpr (MR > 1) {
    if (mr < MR) return with_rows<MR - 1>(mr, f);
  }
  f(std::integral_constant<int, MR>{});
}

template <int MR, typename Tile>
void for_each_tile(int64_t m, int64_t blocks, Tile tile) {
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t r = 0; r < m; r += MR) {
        with_rows<MR>(static_cast<int>(std::min<int64_t>(MR, m - r)), [&](auto rows) {
          tile(rows, r, b, b + 1 < end ? b + 1 : -1);
        });
      }
    }
  });
}

// Where the tile's sums go: bf16 (a projection) or binary32 (the lm_head's logits).
struct Out {
  u16* bf = nullptr;
  float* f32 = nullptr;
  int64_t n = 0;
  inline void put(int64_t row, int64_t col, float v) const {
    if (bf != nullptr) {
      bf[row * n + col] = to_bf(v);
    } else {
      f32[row * n + col] = v;
    }
  }
};

// Which blocks of K a tile sums (SPEC.md, "dot"): 2^levels blocks of `per` pairs from
// x's first pair, folded by the tree's lowest `levels` levels. A whole dot is 16
// blocks of ceil(pairs / 16); a tensor-parallel rank's slice of K is 16 / size of the
// whole K's blocks, whose subtree it returns (linear_partial).
struct Blocks {
  int64_t per;
  int levels;
};

// The portable tile: any CPU. rows x 16 columns, chains in arrays.
template <int MR>
void tile_portable(const u16* x, int64_t k, const Blocks& bl, const u32* w, const Out& out, int64_t row,
                   int64_t col) {
  const int64_t pairs = k / 2, per = bl.per;
  float lvl[5][MR][16];
  for (int l = 0; l < (1 << bl.levels); ++l) {
    float acc[MR][16];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 16; ++c) acc[i][c] = 0.f;
    for (int64_t p = l * per, end = std::min(pairs, (l + 1) * per); p < end; ++p) {
      const u32* wp = w + p * 16;
      for (int i = 0; i < MR; ++i) {
        const float xo = bf(x[i * k + 2 * p + 1]), xe = bf(x[i * k + 2 * p]);
        for (int c = 0; c < 16; ++c) {
          acc[i][c] = std::fma(xo, bf(static_cast<u16>(wp[c] >> 16)), acc[i][c]);
          acc[i][c] = std::fma(xe, bf(static_cast<u16>(wp[c] & 0xFFFFu)), acc[i][c]);
        }
      }
    }
    int j = 0;
    for (; (l >> j) & 1; ++j) {
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < 16; ++c) acc[i][c] = lvl[j][i][c] + acc[i][c];
    }
    std::memcpy(lvl[j], acc, sizeof(acc));
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < 16 && col + c < out.n; ++c) out.put(row + i, col + c, lvl[bl.levels][i][c]);
}

#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
// 8 binary32 sums rounded to bf16 (to_bf, finite values) and stored, the first `valid`.
inline void store_bf16x8(u16* out, __m256 v, int64_t valid) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i hi = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  const __m128i packed = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(hi, hi), 0x08));
  alignas(16) u16 tmp[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(tmp), packed);
  std::memcpy(out, tmp, valid * sizeof(u16));
}

inline void store8(const Out& out, int64_t row, int64_t col, __m256 v) {
  const int64_t valid = std::min<int64_t>(8, out.n - col);
  if (valid <= 0) return;
  if (out.bf != nullptr) {
    store_bf16x8(out.bf + row * out.n + col, v, valid);
  } else {
    alignas(32) float tmp[8];
    _mm256_store_ps(tmp, v);
    std::memcpy(out.f32 + row * out.n + col, tmp, valid * sizeof(float));
  }
}
#endif

#if defined(GATEENG_REF_AVX2)
// The AVX2 tile: rows x 16 columns as two 8-lane halves. A pair's two elements come
// out of the packed u32 by a mask (odd: the high half) and a shift (even), and take
// one FMA each, odd first: VDPBF16PS's two steps, under Flush's DAZ/FTZ. xo, xe: the
// rows' odd and even elements as binary32, [rows][pairs].
template <int MR>
void tile_avx2(const float* xo, const float* xe, int64_t pairs, const Blocks& bl, const u32* w, const u32* next,
               const Out& out, int64_t row, int64_t col) {
  const int64_t per = bl.per;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 lvl[5][MR][2];
  for (int l = 0; l < (1 << bl.levels); ++l) {
    __m256 acc[MR][2];
    for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t p = l * per, end = std::min(pairs, (l + 1) * per); p < end; ++p) {
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16));
      const __m256i w1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + p * 16 + 8));
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + p * 16), _MM_HINT_T1);
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(w0, hi_mask));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(w1, hi_mask));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(w0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(w1, 16));
      for (int i = 0; i < MR; ++i) {
        const __m256 xov = _mm256_broadcast_ss(xo + i * pairs + p);
        const __m256 xev = _mm256_broadcast_ss(xe + i * pairs + p);
        acc[i][0] = _mm256_fmadd_ps(xev, e0, _mm256_fmadd_ps(xov, o0, acc[i][0]));
        acc[i][1] = _mm256_fmadd_ps(xev, e1, _mm256_fmadd_ps(xov, o1, acc[i][1]));
      }
    }
    int j = 0;
    for (; (l >> j) & 1; ++j) {
      for (int i = 0; i < MR; ++i) {
        acc[i][0] = _mm256_add_ps(lvl[j][i][0], acc[i][0]);
        acc[i][1] = _mm256_add_ps(lvl[j][i][1], acc[i][1]);
      }
    }
    for (int i = 0; i < MR; ++i) lvl[j][i][0] = acc[i][0], lvl[j][i][1] = acc[i][1];
  }
  for (int i = 0; i < MR; ++i) {
    store8(out, row + i, col, lvl[bl.levels][i][0]);
    store8(out, row + i, col + 8, lvl[bl.levels][i][1]);
  }
}
#endif

#if defined(GATEENG_REF_AVX512BF16)
// The AVX-512 BF16 tile: rows x 16 columns, one VDPBF16PS per row and pair, which is
// the spec's two FMAs (odd element first, DAZ in, FTZ out, round to nearest even).
template <int MR>
void tile_dpbf16(const u16* x, int64_t k, const Blocks& bl, const u32* w, const u32* next, const Out& out,
                 int64_t row, int64_t col) {
  const int64_t pairs = k / 2, per = bl.per;
  __m512 lvl[5][MR];
  for (int l = 0; l < (1 << bl.levels); ++l) {
    __m512 acc[MR];
    for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
    for (int64_t p = l * per, end = std::min(pairs, (l + 1) * per); p < end; ++p) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(w + p * 16));
      if (next != nullptr) _mm_prefetch(reinterpret_cast<const char*>(next + p * 16), _MM_HINT_T1);
      for (int i = 0; i < MR; ++i) {
        int32_t pair;
        std::memcpy(&pair, x + i * k + 2 * p, sizeof(pair));
        acc[i] = _mm512_dpbf16_ps(acc[i], (__m512bh)_mm512_set1_epi32(pair), wv);
      }
    }
    int j = 0;
    for (; (l >> j) & 1; ++j) {
      for (int i = 0; i < MR; ++i) acc[i] = _mm512_add_ps(lvl[j][i], acc[i]);
    }
    for (int i = 0; i < MR; ++i) lvl[j][i] = acc[i];
  }
  for (int i = 0; i < MR; ++i) {
    store8(out, row + i, col, _mm512_castps512_ps256(lvl[bl.levels][i]));
    store8(out, row + i, col + 8,
           _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lvl[bl.levels][i]), 1)));
  }
}
#endif

torch::Tensor pack(torch::Tensor w) {
  TORCH_CHECK(w.scalar_type() == torch::kBFloat16 && w.dim() == 2 && w.size(1) % 2 == 0 && w.device().is_cpu(),
              "w must be a bf16 [N, K] CPU matrix with K even");
  w = w.contiguous();
  const int64_t n = w.size(0), kp = w.size(1) / 2, blocks = (n + 15) / 16;
  auto out = torch::zeros({blocks, kp, 16, 2}, w.options());
  const u32* src = reinterpret_cast<const u32*>(w.data_ptr<at::BFloat16>());
  u32* dst = reinterpret_cast<u32*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      for (int64_t c = b * 16; c < std::min(n, b * 16 + 16); ++c) {
        for (int64_t p = 0; p < kp; ++p) dst[(b * kp + p) * 16 + (c - b * 16)] = src[c * kp + p];
      }
    }
  });
  return out;
}


// The tiles over x @ w.T, each output the tree over the blocks `bl` names.
void matmul(torch::Tensor x, const torch::Tensor& packed, const Blocks& bl, const Out& out) {
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  if (m == 0 || out.n == 0) return;
  const u16* xp = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  const u32* wp = reinterpret_cast<const u32*>(packed.data_ptr<at::BFloat16>());
  const int64_t block_stride = k / 2 * 16;   // u32 per column block
#if defined(GATEENG_REF_AVX512BF16)
  for_each_tile<8>(m, blocks, [&](auto rows, int64_t r, int64_t b, int64_t nb) {
    tile_dpbf16<decltype(rows)::value>(xp + r * k, k, bl, wp + b * block_stride,
                                       nb >= 0 ? wp + nb * block_stride : nullptr, out, r, b * 16);
  });
#elif defined(GATEENG_REF_AVX2)
  const int64_t pairs = k / 2;
  std::vector<float> xo(m * pairs), xe(m * pairs);   // exact: a bf16 is a binary32
  for (int64_t i = 0; i < m * pairs; ++i) xo[i] = bf(xp[2 * i + 1]), xe[i] = bf(xp[2 * i]);
  for_each_tile<4>(m, blocks, [&](auto rows, int64_t r, int64_t b, int64_t nb) {
    tile_avx2<decltype(rows)::value>(xo.data() + r * pairs, xe.data() + r * pairs, pairs, bl, wp + b * block_stride,
                                     nb >= 0 ? wp + nb * block_stride : nullptr, out, r, b * 16);
  });
#else
  for_each_tile<4>(m, blocks, [&](auto rows, int64_t r, int64_t b, int64_t) {
    tile_portable<decltype(rows)::value>(xp + r * k, k, bl, wp + b * block_stride, out, r, b * 16);
  });
#endif
}

Out out_to(torch::Tensor& result, int64_t n) {
  Out out;
  out.n = n;
  if (result.scalar_type() == torch::kFloat) {
    out.f32 = result.data_ptr<float>();
  } else {
    out.bf = reinterpret_cast<u16*>(result.data_ptr<at::BFloat16>());
  }
  return out;
}

// ---- quantized weights ------------------------------------------------------------
// SPEC.md, "Quantized weights". A GGUF weight of type Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or
// Q6_K keeps its integers and its binary16 scales, repacked once (qpack) for 16 output
// columns at a time, like the bf16 layout: uint8 [ceil(N/16)][B][record], one record
// per GGUF block of K (32 values; a K-quant's super-block: 256) and column block.
// Within a column block the records are in the order the kernels read them (QLayout):
// step by step, the s-th block of every lane that has one, so a column block is one
// sequential stream. A record is the 16 columns' scales d (binary16), for Q4_1 their
// minimums m (Q4_K, Q5_K: dmin), a K-quant's sub-block scales (and Q4_K's, Q5_K's
// sub-block minimums) as bytes [sub-block][16], then the integers pair by pair, the 16
// columns' (even, odd) values side by side: Q8_0 as int8 [16 pairs][16][2]; the others
// as 4-bit bytes [pairs / 2][16][2] whose low nibble is pair 2j and high nibble pair
// 2j + 1; then Q5_K's fifth bits (a u32 per pair, bit 2c + e: column c, element e) or
// Q6_K's fifth and sixth bits (bytes [pairs / 4][16][2], pair 4j + i in bits 2i, 2i + 1).
// The record size names the type. Zero columns (scale 0) pad the last column block.

constexpr int64_t GGML_Q4_0 = 2, GGML_Q4_1 = 3, GGML_Q8_0 = 8, GGML_Q4_K = 12, GGML_Q5_K = 13, GGML_Q6_K = 14;
constexpr int64_t QK_K = 256;   // values per K-quant super-block
constexpr int64_t REC_Q8_0 = 32 + 512, REC_Q4_0 = 32 + 256, REC_Q4_1 = 64 + 256;
constexpr int64_t REC_Q4_K = 64 + 2 * 128 + 2048, REC_Q5_K = REC_Q4_K + 512, REC_Q6_K = 32 + 256 + 2048 + 1024;

enum class QKind { Q8, Q4, Q4K, Q5K, Q6K };

// A kind's (sub-)blocks per record and pairs per (sub-)block, at compile time (QType's
// subs() and sub / 2 at run time).
template <QKind KD>
constexpr int subs_of() { return KD == QKind::Q8 || KD == QKind::Q4 ? 1 : (KD == QKind::Q6K ? 16 : 8); }
template <QKind KD>
constexpr int sub_pairs_of() { return KD == QKind::Q6K ? 8 : 16; }

struct QType {
  int64_t ggml, raw, rec;   // GGML id, bytes per stored block, bytes per record
  QKind kind;
  bool mins;       // a minimum per (sub-)block: Q4_1 adds m * t, Q4_K and Q5_K subtract (dmin * min) * t
  int64_t values;  // values per block
  int sub;         // values per sub-block (each its own scale); the block itself where values == sub
  int bias;        // the stored integer minus bias is q
  int64_t sc_off, m_off, q_off, hi_off;   // where a record's sub-block scales, minimums, integers, high bits start
  bool q8() const { return kind == QKind::Q8; }
  bool kq() const { return values == QK_K; }
  int subs() const { return static_cast<int>(values / sub); }
};
constexpr QType QTYPES[] = {
    {GGML_Q8_0, 34, REC_Q8_0, QKind::Q8, false, QK, 32, 0, 0, 0, 32, 0},
    {GGML_Q4_0, 18, REC_Q4_0, QKind::Q4, false, QK, 32, 8, 0, 0, 32, 0},
    {GGML_Q4_1, 20, REC_Q4_1, QKind::Q4, true, QK, 32, 0, 0, 0, 64, 0},
    {GGML_Q4_K, 144, REC_Q4_K, QKind::Q4K, true, QK_K, 32, 0, 64, 192, 320, 0},
    {GGML_Q5_K, 176, REC_Q5_K, QKind::Q5K, true, QK_K, 32, 0, 64, 192, 320, 2368},
    {GGML_Q6_K, 210, REC_Q6_K, QKind::Q6K, false, QK_K, 16, 32, 32, 0, 288, 2336}};

const QType& qtype_of_ggml(int64_t ggml) {
  for (const auto& t : QTYPES)
    if (t.ggml == ggml) return t;
  TORCH_CHECK(false, "GGML type ", ggml, " is not served quantized (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K and Q6_K are)");
}
const QType& qtype_of_record(int64_t rec) {
  for (const auto& t : QTYPES)
    if (t.rec == rec) return t;
  TORCH_CHECK(false, "not a quantized packed weight (record of ", rec, " bytes)");
}

// binary16 -> binary32, exact (subnormal halves are normal binary32 numbers).
inline float half(u16 h) {
  const u32 sign = static_cast<u32>(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, f = h & 0x3FFu;
  if (e == 0x1F) return from_bits(sign | 0x7F800000u | (f << 13));
  if (e != 0) return from_bits(sign | ((e + 112) << 23) | (f << 13));
  const float v = static_cast<float>(f) * from_bits(0x33800000u);   // f * 2^-24, exact
  return sign ? -v : v;
}
inline float half_at(const uint8_t* p) {
  u16 h;
  std::memcpy(&h, p, 2);
  return half(h);
}

// The integer q of column c, pair p of the block, element e (0 even, 1 odd) of a record.
inline int qint_i(const QType& t, const uint8_t* rec, int p, int c, int e) {
  const uint8_t* q = rec + t.q_off;
  if (t.q8()) return static_cast<int8_t>(q[(p * 16 + c) * 2 + e]);
  const uint8_t b = q[((p / 2) * 16 + c) * 2 + e];
  int n = (p % 2) ? (b >> 4) : (b & 0x0F);
  if (t.kind == QKind::Q5K) {
    u32 mask;
    std::memcpy(&mask, rec + t.hi_off + 4 * p, 4);
    n |= static_cast<int>((mask >> (2 * c + e)) & 1u) << 4;
  } else if (t.kind == QKind::Q6K) {
    n |= ((rec[t.hi_off + ((p / 4) * 16 + c) * 2 + e] >> (2 * (p % 4))) & 3) << 4;
  }
  return n - t.bias;
}
inline float qint(const QType& t, const uint8_t* rec, int p, int c, int e) {
  return static_cast<float>(qint_i(t, rec, p, c, e));   // exact: |q| <= 128
}

// Column c's scale of sub-block j (SPEC.md): d, or a K-quant's d * sc, exact in binary32
// (an 11-bit significand times an integer of at most 7 bits).
inline float qscale(const QType& t, const uint8_t* rec, int j, int c) {
  const float d = half_at(rec + 2 * c);
  if (!t.kq()) return d;
  const uint8_t s = rec[t.sc_off + j * 16 + c];
  return d * static_cast<float>(t.kind == QKind::Q6K ? static_cast<int>(static_cast<int8_t>(s)) : static_cast<int>(s));
}
// Column c's minimum of sub-block j: Q4_1's m (added), or dmin * min (exact; subtracted).
inline float qmin(const QType& t, const uint8_t* rec, int j, int c) {
  const float m = half_at(rec + 32 + 2 * c);
  return t.kq() ? m * static_cast<float>(rec[t.m_off + j * 16 + c]) : m;
}

// ---- a K-quant's GGUF block (ggml's block_q4_K, block_q5_K, block_q6_K) ----
// Where its binary16 d (and dmin) sit.
inline int64_t k_d_at(const QType& t) { return t.kind == QKind::Q6K ? 208 : 0; }
// The stored integer (before the bias) of value v of the block.
inline int k_get(const QType& t, const uint8_t* b, int v) {
  if (t.kind == QKind::Q6K) {
    const int h = v / 128, w = v % 128;
    const int lo = (b[h * 64 + w % 64] >> (4 * (w / 64))) & 0x0F;
    const int hi = (b[128 + h * 32 + w % 32] >> (2 * (w / 32))) & 3;
    return lo | (hi << 4);
  }
  const int j = v / 32, l = v % 32;
  const uint8_t* qs = b + (t.kind == QKind::Q5K ? 48 : 16);
  int n = (qs[(j / 2) * 32 + l] >> (4 * (j % 2))) & 0x0F;
  if (t.kind == QKind::Q5K) n |= ((b[16 + l] >> j) & 1) << 4;
  return n;
}
// k_get's inverse: value v's integer n written into a zeroed block.
inline void k_put(const QType& t, uint8_t* b, int v, int n) {
  if (t.kind == QKind::Q6K) {
    const int h = v / 128, w = v % 128;
    b[h * 64 + w % 64] |= static_cast<uint8_t>((n & 0x0F) << (4 * (w / 64)));
    b[128 + h * 32 + w % 32] |= static_cast<uint8_t>((n >> 4) << (2 * (w / 32)));
    return;
  }
  const int j = v / 32, l = v % 32;
  uint8_t* qs = b + (t.kind == QKind::Q5K ? 48 : 16);
  qs[(j / 2) * 32 + l] |= static_cast<uint8_t>((n & 0x0F) << (4 * (j % 2)));
  if (t.kind == QKind::Q5K) b[16 + l] |= static_cast<uint8_t>(((n >> 4) & 1) << j);
}
// The sub-block scales (and Q4_K's, Q5_K's minimums): Q6_K's 16 int8; Q4_K's and
// Q5_K's 8 + 8 six-bit values in 12 bytes (ggml's get_scale_min_k4).
inline void k_scales(const QType& t, const uint8_t* b, uint8_t* sc, uint8_t* mn) {
  if (t.kind == QKind::Q6K) {
    std::memcpy(sc, b + 192, 16);
    return;
  }
  const uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}
inline void k_put_scales(const QType& t, uint8_t* b, const uint8_t* sc, const uint8_t* mn) {
  if (t.kind == QKind::Q6K) {
    std::memcpy(b + 192, sc, 16);
    return;
  }
  uint8_t* s = b + 4;
  for (int j = 0; j < 4; ++j) {
    s[j] = static_cast<uint8_t>(sc[j] | ((sc[j + 4] >> 4) << 6));
    s[j + 4] = static_cast<uint8_t>(mn[j] | ((mn[j + 4] >> 4) << 6));
    s[j + 8] = static_cast<uint8_t>((sc[j + 4] & 0x0F) | ((mn[j + 4] & 0x0F) << 4));
  }
}

// A record's integer of column c, pair p, element e set from the stored n (qpack).
inline void rec_put(const QType& t, uint8_t* rec, int p, int c, int e, int n) {
  uint8_t* q = rec + t.q_off;
  if (t.q8()) {
    q[(p * 16 + c) * 2 + e] = static_cast<uint8_t>(n);
    return;
  }
  q[((p / 2) * 16 + c) * 2 + e] |= static_cast<uint8_t>((n & 0x0F) << ((p % 2) * 4));
  if (t.kind == QKind::Q5K) {
    u32 mask;
    std::memcpy(&mask, rec + t.hi_off + 4 * p, 4);
    mask |= static_cast<u32>((n >> 4) & 1) << (2 * c + e);
    std::memcpy(rec + t.hi_off + 4 * p, &mask, 4);
  } else if (t.kind == QKind::Q6K) {
    rec[t.hi_off + ((p / 4) * 16 + c) * 2 + e] |= static_cast<uint8_t>((n >> 4) << (2 * (p % 4)));
  }
}

// One stored block of column c into its record (qpack), or back (qunpack, into a zeroed block).
void block_to_record(const QType& t, const uint8_t* b, uint8_t* rec, int c) {
  if (!t.kq()) {
    std::memcpy(rec + 2 * c, b, 2);                        // d
    if (t.mins) std::memcpy(rec + 32 + 2 * c, b + 2, 2);   // m
    const uint8_t* qs = b + (t.mins ? 4 : 2);
    for (int v = 0; v < QK; ++v)   // GGUF Q4: byte j holds value j (low nibble) and value j + 16 (high)
      rec_put(t, rec, v / 2, c, v % 2, t.q8() ? qs[v] : v < 16 ? (qs[v] & 0x0F) : (qs[v - 16] >> 4));
    return;
  }
  std::memcpy(rec + 2 * c, b + k_d_at(t), 2);
  if (t.mins) std::memcpy(rec + 32 + 2 * c, b + 2, 2);   // dmin
  uint8_t sc[16], mn[8];
  k_scales(t, b, sc, mn);
  for (int j = 0; j < t.subs(); ++j) {
    rec[t.sc_off + j * 16 + c] = sc[j];
    if (t.mins) rec[t.m_off + j * 16 + c] = mn[j];
  }
  for (int v = 0; v < QK_K; ++v) rec_put(t, rec, v / 2, c, v % 2, k_get(t, b, v));
}
void record_to_block(const QType& t, const uint8_t* rec, uint8_t* b, int c) {
  if (!t.kq()) {
    std::memcpy(b, rec + 2 * c, 2);
    if (t.mins) std::memcpy(b + 2, rec + 32 + 2 * c, 2);
    uint8_t* qs = b + (t.mins ? 4 : 2);
    for (int v = 0; v < QK; ++v) {
      const int n = qint_i(t, rec, v / 2, c, v % 2) + t.bias;
      if (t.q8()) {
        qs[v] = static_cast<uint8_t>(n);
      } else {
        qs[v % 16] |= static_cast<uint8_t>(v < 16 ? n : n << 4);
      }
    }
    return;
  }
  std::memcpy(b + k_d_at(t), rec + 2 * c, 2);
  if (t.mins) std::memcpy(b + 2, rec + 32 + 2 * c, 2);
  uint8_t sc[16], mn[8];
  for (int j = 0; j < t.subs(); ++j) {
    sc[j] = rec[t.sc_off + j * 16 + c];
    if (t.mins) mn[j] = rec[t.m_off + j * 16 + c];
  }
  k_put_scales(t, b, sc, mn);
  for (int v = 0; v < QK_K; ++v) k_put(t, b, v, qint_i(t, rec, v / 2, c, v % 2) + t.bias);
}

// The lanes (SPEC.md: lane l sums blocks l*per .. min(B, (l+1)*per) - 1) and where each
// block's record sits in a column block: step s holds block l*per + s of each lane l
// that has more than s blocks (a prefix of the lanes: only the last ones are short),
// steps one after another. `per` is the whole K's (ceil(B/16) where 0 is given): a
// tensor-parallel rank's slice of K is whole lanes of the whole K (SPEC.md, "Tensor
// parallelism"), packed with that K's per. The tiles fold 2^levels lanes: 16 for a
// whole dot, a rank's share of them for its subtree (linear_partial).
struct QLayout {
  int64_t nb, per;
  int levels;
  std::vector<int64_t> base, live;   // per step: its first record, how many lanes it holds
  QLayout(int64_t blocks, int64_t whole_per, int lv = 4)
      : nb(blocks), per(whole_per > 0 ? whole_per : (blocks + 15) / 16), levels(lv), base(per), live(per) {
    TORCH_CHECK(whole_per >= 0, "per must be at least 0 (0: the weight's own lanes)");
    TORCH_CHECK(nb <= (int64_t{1} << levels) * per, "a quantized weight of ", nb, " blocks does not fit in ",
                (1 << levels), " lanes of ", per, " blocks");
    int64_t at = 0;
    for (int64_t s = 0; s < per; ++s) {
      int64_t lanes = 0;
      while (lanes < 16 && lanes * per + s < nb) ++lanes;
      base[s] = at;
      live[s] = lanes;
      at += lanes;
    }
  }
  int64_t record(int64_t g) const { return base[g % per] + g / per; }   // block g's position
};

torch::Tensor qpack(torch::Tensor raw, int64_t ggml, int64_t per) {
  const QType& t = qtype_of_ggml(ggml);
  TORCH_CHECK(raw.scalar_type() == torch::kUInt8 && raw.dim() == 2 && raw.device().is_cpu() &&
                  raw.size(1) % t.raw == 0, "raw must be uint8 [N, blocks * ", t.raw, "] (the GGUF rows)");
  raw = raw.contiguous();
  const int64_t n = raw.size(0), nb = raw.size(1) / t.raw, cbs = (n + 15) / 16;
  const QLayout lay(nb, per);
  auto out = torch::zeros({cbs, nb, t.rec}, raw.options());
  const uint8_t* src = raw.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, cbs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t cb = begin; cb < end; ++cb)
      for (int64_t c = 0; c < 16 && cb * 16 + c < n; ++c)
        for (int64_t g = 0; g < nb; ++g)
          block_to_record(t, src + (cb * 16 + c) * raw.size(1) + g * t.raw, dst + (cb * nb + lay.record(g)) * t.rec,
                          static_cast<int>(c));
  });
  return out;
}

// qpack's inverse: the GGUF rows (uint8 [n, blocks * stored bytes]) of a packed weight
// of n rows laid out with `per` (0: its own K's), so a weight can be split again.
torch::Tensor qunpack(torch::Tensor packed, int64_t n, int64_t per) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.is_contiguous() &&
                  (n + 15) / 16 == packed.size(0), "packed must come from qpack, with n rows");
  const QType& t = qtype_of_record(packed.size(2));
  const int64_t nb = packed.size(1), row = nb * t.raw;
  const QLayout lay(nb, per);
  auto raw = torch::zeros({n, row}, packed.options());
  const uint8_t* src = packed.data_ptr<uint8_t>();
  uint8_t* dst = raw.data_ptr<uint8_t>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t g = 0; g < nb; ++g)
      record_to_block(t, src + ((r / 16) * nb + lay.record(g)) * t.rec, dst + r * row + g * t.raw,
                      static_cast<int>(r % 16));
  return raw;
}

// The GGML type id of a packed weight's records.
int64_t qtype(torch::Tensor packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3, "packed must come from qpack");
  return qtype_of_record(packed.size(2)).ggml;
}

// The values per GGUF block of a packed weight's type (32; a K-quant's super-block: 256).
int64_t qblock(torch::Tensor packed) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3, "packed must come from qpack");
  return qtype_of_record(packed.size(2)).values;
}

// x's sums t over each 32 values (SPEC.md: the minimums multiply them), [rows][K/32].
std::vector<float> block_sums(const u16* x, int64_t m, int64_t k) {
  const int64_t nb = k / QK;
  std::vector<float> t(m * nb);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t g = 0; g < nb; ++g) {
      float acc = 0.f;
      for (int64_t p = 0; p < QK / 2; ++p) {
        acc = acc + bf(x[i * k + g * QK + 2 * p + 1]);
        acc = acc + bf(x[i * k + g * QK + 2 * p]);
      }
      t[i * nb + g] = acc;
    }
  return t;
}

// The vector tiles read one column block while the next one's same records are fetched
// into L2, line by line: DRAM then streams at the bandwidth one core can draw.
inline void prefetch_records(const uint8_t* next, int64_t from, int64_t bytes) {
#if defined(__x86_64__) || defined(__i386__)
  if (next == nullptr) return;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + from + off), _MM_HINT_T1);
#endif
}

// The portable tile: MR rows x 16 columns of one column block, the spec written out.
// tx: the rows' sums of 32 values, [rows][K/32].
template <int MR>
void qtile_portable(const QType& t, const QLayout& lay, const u16* x, int64_t k, const float* tx, const uint8_t* w,
                    const Out& out, int64_t row, int64_t col) {
  const int64_t nb = lay.nb, per = lay.per, kq = k / QK;
  const int sp = t.sub / 2;   // pairs per sub-block
  float lvl[5][MR][16];
  for (int l = 0; l < (1 << lay.levels); ++l) {
    float lane[MR][16];
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 16; ++c) lane[i][c] = 0.f;
    for (int64_t g = std::min(nb, l * per); g < std::min(nb, (l + 1) * per); ++g) {
      const uint8_t* rec = w + lay.record(g) * t.rec;
      for (int i = 0; i < MR; ++i) {
        const u16* xg = x + i * k + g * t.values;
        for (int c = 0; c < 16; ++c) {
          for (int j = 0; j < t.subs(); ++j) {
            float s = 0.f;
            for (int p = j * sp; p < (j + 1) * sp; ++p) {
              s = std::fma(bf(xg[2 * p + 1]), qint(t, rec, p, c, 1), s);
              s = std::fma(bf(xg[2 * p]), qint(t, rec, p, c, 0), s);
            }
            float v = qscale(t, rec, j, c) * s;
            if (t.mins) {
              const float mt = qmin(t, rec, j, c) * tx[i * kq + (g * t.values + j * t.sub) / QK];
              v = t.kq() ? v - mt : v + mt;
            }
            lane[i][c] = lane[i][c] + v;
          }
        }
      }
    }
    int j = 0;
    for (; (l >> j) & 1; ++j) {
      for (int i = 0; i < MR; ++i)
        for (int c = 0; c < 16; ++c) lane[i][c] = lvl[j][i][c] + lane[i][c];
    }
    std::memcpy(lvl[j], lane, sizeof(lane));
  }
  for (int i = 0; i < MR; ++i)
    for (int c = 0; c < 16 && col + c < out.n; ++c) out.put(row + i, col + c, lvl[lay.levels][i][c]);
}

// f(integral_constant<QKind>) for t's kind: the vector tiles are compiled per kind.
template <typename F>
inline void with_kind(const QType& t, F&& f) {
  switch (t.kind) {
    case QKind::Q8: return f(std::integral_constant<QKind, QKind::Q8>{});
    case QKind::Q4: return f(std::integral_constant<QKind, QKind::Q4>{});
    case QKind::Q4K: return f(std::integral_constant<QKind, QKind::Q4K>{});
    case QKind::Q5K: return f(std::integral_constant<QKind, QKind::Q5K>{});
    case QKind::Q6K: return f(std::integral_constant<QKind, QKind::Q6K>{});
  }
}

#if defined(GATEENG_REF_AVX512BF16)
// The AVX-512 BF16 tile: MR rows x 16 columns, LN lanes at a time (independent chains:
// a sub-block's pairs are one chain of VDPBF16PS, the spec's order). Q4 integers become
// bf16 by a table lookup (VPERMW); Q8_0's and the K-quants' through binary32 (exact
// either way).
struct QTables {
  __m512i q4_0, q4_1;
  QTables() {
    alignas(64) u16 a[32], b[32];
    for (int n = 0; n < 32; ++n) a[n] = to_bf(static_cast<float>(n % 16 - 8)), b[n] = to_bf(static_cast<float>(n % 16));
    q4_0 = _mm512_load_si512(a);
    q4_1 = _mm512_load_si512(b);
  }
};

// A K-quant record's integers of pair p, the 16 columns' (even, odd) side by side, as bf16.
template <QKind KD>
inline __m512bh kpair_dpbf16(const QType& t, const uint8_t* rec, int p) {
  __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.q_off + (p / 2) * 32)));
  w = _mm512_and_si512(_mm512_srli_epi16(w, (p % 2) * 4), _mm512_set1_epi16(0x0F));
  if constexpr (KD == QKind::Q5K) {
    u32 mask;
    std::memcpy(&mask, rec + t.hi_off + 4 * p, 4);
    w = _mm512_or_si512(w, _mm512_maskz_set1_epi16(static_cast<__mmask32>(mask), 16));
  } else if constexpr (KD == QKind::Q6K) {
    const __m512i hi = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + t.hi_off + (p / 4) * 32)));
    w = _mm512_or_si512(w, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(hi, 2 * (p % 4)), _mm512_set1_epi16(3)), 4));
    w = _mm512_sub_epi16(w, _mm512_set1_epi16(32));
  }
  const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(w)));
  const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(w, 1)));
  return _mm512_cvtne2ps_pbh(f1, f0);
}

// The 16 columns' scales (d, or d * sc) and minimums (m, or dmin * min) of sub-block j.
template <QKind KD>
inline __m512 kscale512(const QType& t, const uint8_t* rec, int j) {
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
  if constexpr (KD == QKind::Q8 || KD == QKind::Q4) return d;
  const __m128i s = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.sc_off + j * 16));
  return _mm512_mul_ps(d, _mm512_cvtepi32_ps(KD == QKind::Q6K ? _mm512_cvtepi8_epi32(s) : _mm512_cvtepu8_epi32(s)));
}
template <QKind KD>
inline __m512 kmin512(const QType& t, const uint8_t* rec, int j) {
  const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
  if constexpr (KD == QKind::Q8 || KD == QKind::Q4) return m;
  return _mm512_mul_ps(m, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(
                              _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.m_off + j * 16)))));
}

template <int MR, int LN, QKind KD>
void qtile_dpbf16(const QType& t, const QLayout& lay, const u16* x, int64_t k, const float* tx, const uint8_t* w,
                  const uint8_t* next, const Out& out, int64_t row, int64_t col) {
  static const QTables tables;
  const __m512i table = t.mins ? tables.q4_1 : tables.q4_0;
  const __m512i nib = _mm512_set1_epi16(0x0F);
  const int64_t per = lay.per, kq = k / QK, qoff = t.q_off;
  const int sp = t.sub / 2;
  alignas(64) float lanes[16][MR][16];
  for (int l = 0; l < 16; ++l)
    for (int i = 0; i < MR; ++i) _mm512_store_ps(lanes[l][i], _mm512_setzero_ps());
  for (int64_t s = 0; s < per; ++s) {
    const int64_t live = lay.live[s];
    for (int64_t j0 = 0; j0 < live; j0 += LN) {
      const int64_t count = std::min<int64_t>(LN, live - j0);
      const uint8_t* recs = w + (lay.base[s] + j0) * t.rec;   // `count` records, one after another
      prefetch_records(next, (lay.base[s] + j0) * t.rec, count * t.rec);
      for (int sb = 0; sb < t.subs(); ++sb) {
        __m512 acc[LN][MR];
        for (int j = 0; j < LN; ++j)
          for (int i = 0; i < MR; ++i) acc[j][i] = _mm512_setzero_ps();
        if constexpr (KD == QKind::Q8) {
          for (int p = 0; p < 16; ++p) {
            for (int j = 0; j < LN; ++j) {
              if (j >= count) break;
              const int64_t g = (j0 + j) * per + s;
              const int8_t* q = reinterpret_cast<const int8_t*>(recs + j * t.rec + qoff + p * 32);
              const __m512 f0 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
              const __m512 f1 = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
              const __m512bh wv = _mm512_cvtne2ps_pbh(f1, f0);
              for (int i = 0; i < MR; ++i) {
                int32_t pair;
                std::memcpy(&pair, x + i * k + g * QK + 2 * p, sizeof(pair));
                acc[j][i] = _mm512_dpbf16_ps(acc[j][i], (__m512bh)_mm512_set1_epi32(pair), wv);
              }
            }
          }
        } else if constexpr (KD == QKind::Q4) {
          for (int pp = 0; pp < 8; ++pp) {
            for (int j = 0; j < LN; ++j) {
              if (j >= count) break;
              const int64_t g = (j0 + j) * per + s;
              const __m512i words = _mm512_cvtepu8_epi16(
                  _mm256_loadu_si256(reinterpret_cast<const __m256i*>(recs + j * t.rec + qoff + pp * 32)));
              const __m512bh w0 = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(words, nib), table);
              const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table);
              for (int i = 0; i < MR; ++i) {
                int32_t p0, p1;
                std::memcpy(&p0, x + i * k + g * QK + 4 * pp, sizeof(p0));
                std::memcpy(&p1, x + i * k + g * QK + 4 * pp + 2, sizeof(p1));
                acc[j][i] = _mm512_dpbf16_ps(acc[j][i], (__m512bh)_mm512_set1_epi32(p0), w0);
                acc[j][i] = _mm512_dpbf16_ps(acc[j][i], (__m512bh)_mm512_set1_epi32(p1), w1);
              }
            }
          }
        } else {
          for (int p = sb * sp; p < (sb + 1) * sp; ++p) {
            for (int j = 0; j < LN; ++j) {
              if (j >= count) break;
              const int64_t g = (j0 + j) * per + s;
              const __m512bh wv = kpair_dpbf16<KD>(t, recs + j * t.rec, p);
              for (int i = 0; i < MR; ++i) {
                int32_t pair;
                std::memcpy(&pair, x + i * k + g * QK_K + 2 * p, sizeof(pair));
                acc[j][i] = _mm512_dpbf16_ps(acc[j][i], (__m512bh)_mm512_set1_epi32(pair), wv);
              }
            }
          }
        }
        for (int j = 0; j < count; ++j) {
          const int64_t g = (j0 + j) * per + s;
          const uint8_t* rec = recs + j * t.rec;
          const __m512 d = kscale512<KD>(t, rec, sb);
          const __m512 m = t.mins ? kmin512<KD>(t, rec, sb) : _mm512_setzero_ps();
          for (int i = 0; i < MR; ++i) {
            __m512 v = _mm512_mul_ps(d, acc[j][i]);
            if (t.mins) {
              const __m512 mt = _mm512_mul_ps(m, _mm512_set1_ps(tx[i * kq + (g * t.values + sb * t.sub) / QK]));
              v = t.kq() ? _mm512_sub_ps(v, mt) : _mm512_add_ps(v, mt);
            }
            float* lane = lanes[j0 + j][i];
            _mm512_store_ps(lane, _mm512_add_ps(_mm512_load_ps(lane), v));
          }
        }
      }
    }
  }
  __m512 lvl[5][MR];
  for (int l = 0; l < (1 << lay.levels); ++l) {
    __m512 v[MR];
    for (int i = 0; i < MR; ++i) v[i] = _mm512_load_ps(lanes[l][i]);
    int lev = 0;
    for (; (l >> lev) & 1; ++lev) {
      for (int i = 0; i < MR; ++i) v[i] = _mm512_add_ps(lvl[lev][i], v[i]);
    }
    for (int i = 0; i < MR; ++i) lvl[lev][i] = v[i];
  }
  for (int i = 0; i < MR; ++i) {
    store8(out, row + i, col, _mm512_castps512_ps256(lvl[lay.levels][i]));
    store8(out, row + i, col + 8, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lvl[lay.levels][i]), 1)));
  }
}
#endif

#if defined(GATEENG_REF_AVX2)
// A record's integers of pairs p and p + 1 (p even: both in one byte of a 4-bit type) for
// the 8 columns of half h, even and odd elements, as binary32 (exact).
template <QKind KD, bool SCALED>
inline void qpairs_avx2(const QType& t, const uint8_t* rec, int p, int h, __m256& e0, __m256& o0, __m256& e1,
                        __m256& o1) {
  if constexpr (SCALED) {
    // Each nibble in place, as 2^23 + s n for its place s (1, 256; 16, 4096), exact,
    // minus 2^23 + s bias: s q, exact (at most 2^19 in magnitude). See scaled_nibbles.
    static_assert(KD == QKind::Q4 || KD == QKind::Q4K, "the scaled integers are 4-bit ones");
    __m256i v = _mm256_or_si256(_mm256_cvtepu16_epi32(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(rec + t.q_off + (p / 2) * 32 + h * 16))), _mm256_set1_epi32(0x4B000000));
    __asm__("" : "+x"(v));   // one OR for the four: the compiler would otherwise redo it per mask
    const float b = static_cast<float>(t.bias);
    const auto at = [&](int mask, float s) {
      return _mm256_sub_ps(_mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x4B000000 | mask))),
                           _mm256_set1_ps(8388608.f + s * b));
    };
    e0 = at(0x000F, 1.f);
    o0 = at(0x0F00, 256.f);
    e1 = at(0x00F0, 16.f);
    o1 = at(0xF000, 4096.f);
  } else if constexpr (KD == QKind::Q8) {
    for (int i = 0; i < 2; ++i) {
      const __m256i v = _mm256_cvtepi8_epi16(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.q_off + (p + i) * 32 + h * 16)));
      (i ? e1 : e0) = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 16));
      (i ? o1 : o0) = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 16));
    }
  } else {
    // Per column, its even and odd bytes side by side: pair p in the low nibbles, p + 1 in the high.
    const __m256i v = _mm256_cvtepu16_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.q_off + (p / 2) * 32 + h * 16)));
    const __m256i nib = _mm256_set1_epi32(0x0F);
    __m256i n[4] = {_mm256_and_si256(v, nib), _mm256_and_si256(_mm256_srli_epi32(v, 8), nib),
                    _mm256_and_si256(_mm256_srli_epi32(v, 4), nib), _mm256_and_si256(_mm256_srli_epi32(v, 12), nib)};
    if constexpr (KD == QKind::Q5K) {
      const __m256i one = _mm256_set1_epi32(1), at = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
      for (int i = 0; i < 2; ++i) {
        u32 mask;
        std::memcpy(&mask, rec + t.hi_off + 4 * (p + i), 4);
        const __m256i bits = _mm256_set1_epi32(static_cast<int>(mask >> (16 * h)));
        n[2 * i] = _mm256_or_si256(n[2 * i], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(bits, at), one), 4));
        n[2 * i + 1] = _mm256_or_si256(
            n[2 * i + 1], _mm256_slli_epi32(_mm256_and_si256(_mm256_srlv_epi32(bits, _mm256_add_epi32(at, one)), one), 4));
      }
    } else if constexpr (KD == QKind::Q6K) {
      const __m256i hi = _mm256_cvtepu16_epi32(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.hi_off + (p / 4) * 32 + h * 16)));
      const __m256i three = _mm256_set1_epi32(3);
      for (int i = 0; i < 2; ++i) {
        const int s2 = ((p + i) % 4) * 2;
        n[2 * i] = _mm256_or_si256(n[2 * i], _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, s2), three), 4));
        n[2 * i + 1] = _mm256_or_si256(
            n[2 * i + 1], _mm256_slli_epi32(_mm256_and_si256(_mm256_srli_epi32(hi, 8 + s2), three), 4));
      }
    }
    const __m256i bias = _mm256_set1_epi32(t.bias);
    e0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(n[0], bias));
    o0 = _mm256_cvtepi32_ps(_mm256_sub_epi32(n[1], bias));
    e1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(n[2], bias));
    o1 = _mm256_cvtepi32_ps(_mm256_sub_epi32(n[3], bias));
  }
}

// The 8 columns of half h: their scales (d, or d * sc) and minimums (m, or dmin * min) of sub-block j.
template <QKind KD>
inline __m256 qscale_avx2(const QType& t, const uint8_t* rec, int j, int h) {
  const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + h * 16)));
  if constexpr (KD == QKind::Q8 || KD == QKind::Q4) return d;
  const __m128i s = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + t.sc_off + j * 16 + h * 8));
  return _mm256_mul_ps(d, _mm256_cvtepi32_ps(KD == QKind::Q6K ? _mm256_cvtepi8_epi32(s) : _mm256_cvtepu8_epi32(s)));
}
template <QKind KD>
inline __m256 qmin_avx2(const QType& t, const uint8_t* rec, int j, int h) {
  const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32 + h * 16)));
  if constexpr (KD == QKind::Q8 || KD == QKind::Q4) return m;
  return _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(
                              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(rec + t.m_off + j * 16 + h * 8)))));
}

// A 4-bit integer sits at bit 0, 4, 8 or 12 of a column's two bytes of a pair of pairs
// (pair p's even and odd element, then pair p + 1's: places s = 1, 256, 16, 4096).
// Masked in place under the bits of 2^23 it reads as 2^23 + s n, so one subtraction
// gives s q exactly (qpairs_avx2), where shifting it down and converting took three
// operations. The x element it multiplies is then taken as x / s: exact for a normal
// x of at least 2^-114 (its quotient stays normal; a denormal x reads as a zero of its
// sign either way). Both factors are still bf16 values, and (x / s) * (s q) is x * q
// exactly, so each FMA rounds the same sum: the spec's bits, as the probe and the
// oracle tests check. Whether every x of the call is such a value (else the integers
// are converted one by one, unscaled).
inline bool scaled_nibbles(const u16* x, int64_t n) {
  bool ok = true;
  for (int64_t i = 0; i < n; ++i) {
    const int e = (x[i] >> 7) & 0xFF;   // the biased exponent; 1..12: 2^-126 <= |x| < 2^-114
    ok &= e == 0 || e > 12;
  }
  return ok;
}

// LN lanes' records of one step (recs, one after another) added into their lane sums
// (lanes[0..LN)): per sub-block, MR rows x 16 columns as two 8-lane halves, each lane's
// chains in registers. A pair's even and odd integers come out of the record as
// binary32 (exact) and take one FMA each, odd first: VDPBF16PS's two steps, under
// Flush's DAZ/FTZ. x: each lane's block's first pair in xo and xe (the rows' odd and
// even elements as binary32, `pairs` a row); tx: its sums of 32 values (`kq` a row).
template <int MR, int LN, QKind KD, bool SCALED>
inline void qlanes_avx2(const QType& t, const uint8_t* recs, const float* const* xo, const float* const* xe,
                        int64_t pairs, const float* const* tx, int64_t kq, float (*lanes)[MR][16]) {
  constexpr int SP = sub_pairs_of<KD>(), SUBS = subs_of<KD>();
  for (int sb = 0; sb < SUBS; ++sb) {
    __m256 acc[LN][MR][2];
#pragma GCC unroll 8
    for (int j = 0; j < LN; ++j)
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i) acc[j][i][0] = acc[j][i][1] = _mm256_setzero_ps();
    for (int p = sb * SP; p < (sb + 1) * SP; p += 2) {
      // Unrolled, so every chain stays in a register (a loop over them kept them in memory).
#pragma GCC unroll 8
      for (int j = 0; j < LN; ++j) {
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h) {
          __m256 e0, o0, e1, o1;
          qpairs_avx2<KD, SCALED>(t, recs + j * t.rec, p, h, e0, o0, e1, o1);
#pragma GCC unroll 8
          for (int i = 0; i < MR; ++i) {
            const float* xoi = xo[j] + i * pairs + p;
            const float* xei = xe[j] + i * pairs + p;
            __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(xoi), o0, acc[j][i][h]);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xei), e0, a);
            a = _mm256_fmadd_ps(_mm256_broadcast_ss(xoi + 1), o1, a);
            acc[j][i][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(xei + 1), e1, a);
          }
        }
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < LN; ++j) {
      const uint8_t* rec = recs + j * t.rec;
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 d = qscale_avx2<KD>(t, rec, sb, h);
        const __m256 m = t.mins ? qmin_avx2<KD>(t, rec, sb, h) : _mm256_setzero_ps();
#pragma GCC unroll 8
        for (int i = 0; i < MR; ++i) {
          __m256 v = _mm256_mul_ps(d, acc[j][i][h]);
          if (t.mins) {
            const __m256 mt = _mm256_mul_ps(m, _mm256_set1_ps(tx[j][i * kq + sb * t.sub / QK]));
            v = t.kq() ? _mm256_sub_ps(v, mt) : _mm256_add_ps(v, mt);
          }
          float* lane = lanes[j][i] + h * 8;
          _mm256_store_ps(lane, _mm256_add_ps(_mm256_load_ps(lane), v));
        }
      }
    }
  }
}

// The AVX2 tiles' lane sums (MR rows x 16 columns each) folded by the tree's lowest
// `levels` levels, and stored. On vectors: a fold through float arrays copied by
// memcpy made each 32-byte load wait on two 16-byte stores (store forwarding fails),
// about a tenth of a one-row quantized matmul's samples.
template <int MR>
inline void fold_lanes_avx2(float (*lanes)[MR][16], int levels, const Out& out, int64_t row, int64_t col) {
  __m256 lvl[5][MR][2];
  for (int l = 0; l < (1 << levels); ++l) {
    __m256 v[MR][2];
    for (int i = 0; i < MR; ++i) v[i][0] = _mm256_load_ps(lanes[l][i]), v[i][1] = _mm256_load_ps(lanes[l][i] + 8);
    int lev = 0;
    for (; (l >> lev) & 1; ++lev) {
      for (int i = 0; i < MR; ++i)
        v[i][0] = _mm256_add_ps(lvl[lev][i][0], v[i][0]), v[i][1] = _mm256_add_ps(lvl[lev][i][1], v[i][1]);
    }
    for (int i = 0; i < MR; ++i) lvl[lev][i][0] = v[i][0], lvl[lev][i][1] = v[i][1];
  }
  for (int i = 0; i < MR; ++i) {
    store8(out, row + i, col, lvl[levels][i][0]);
    store8(out, row + i, col + 8, lvl[levels][i][1]);
  }
}

// The AVX2 tile: MR rows x 16 columns of one column block, LN lanes at a time
// (qlanes_avx2), then the lanes folded by the tree. SCALED: xo and xe are scaled_nibbles'.
template <int MR, int LN, QKind KD, bool SCALED>
void qtile_avx2(const QType& t, const QLayout& lay, const float* xo, const float* xe, int64_t k, const float* tx,
                const uint8_t* w, const uint8_t* next, const Out& out, int64_t row, int64_t col) {
  const int64_t per = lay.per, pairs = k / 2, kq = k / QK;
  alignas(32) float lanes[16][MR][16];
  for (int l = 0; l < 16; ++l)
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 16; ++c) lanes[l][i][c] = 0.f;
  for (int64_t s = 0; s < per; ++s) {
    const int64_t live = lay.live[s];
    for (int64_t j0 = 0; j0 < live; j0 += LN) {
      const int64_t count = std::min<int64_t>(LN, live - j0);
      const uint8_t* recs = w + (lay.base[s] + j0) * t.rec;
      prefetch_records(next, (lay.base[s] + j0) * t.rec, count * t.rec);
      const float* xol[LN];
      const float* xel[LN];
      const float* txl[LN];
      for (int j = 0; j < count; ++j) {
        const int64_t g = (j0 + j) * per + s;   // the lane's block
        xol[j] = xo + g * t.values / 2;
        xel[j] = xe + g * t.values / 2;
        txl[j] = tx + g * t.values / QK;
      }
      with_rows<LN>(static_cast<int>(count), [&](auto lanes_now) {
        qlanes_avx2<MR, decltype(lanes_now)::value, KD, SCALED>(t, recs, xol, xel, pairs, txl, kq, lanes + j0);
      });
    }
  }
  fold_lanes_avx2<MR>(lanes, lay.levels, out, row, col);
}

// ---- a block's chain as an exact integer sum (AVX2) ----
// A (sub-)block's chain (SPEC.md, "Block sums", "Sub-block sums") rounds nothing when
// every partial sum is a binary32 number. If x's values in it are all integer multiples
// m * 2^u of one unit 2^u and sum |m| * max |q| < 2^24, every partial sum is a multiple
// of 2^u below 2^24 units, so each FMA's exact result is representable (with 2^u >=
// 2^-126 never flushed, with 2^u <= 2^104 never overflowing). The chain then equals the
// exact sum 2^u * sum q * m, in any order, and its +0 start keeps a zero sum +0 (round
// to nearest never makes -0 from +0 and a product). That sum is computed in int32 by
// VPMADDWD, two products an instruction where the FMAs took one, each a chain's step
// no longer waits on: the same bits. Where x fails the bound, the FMA chain itself.
// Which applies depends on x and the type's max |q| alone, so it is decided once per row
// and (sub-)block of x, for every column (ExactBlocks).

// The largest |q| of a type served by exact blocks: Q4_0's n - 8, Q4_1's and Q4_K's n,
// Q6_K's n - 32.
inline int64_t exact_qmax(const QType& t) { return t.kind == QKind::Q6K ? 32 : (t.bias == 8 ? 8 : 15); }

// Per row and block of x of a (sub-)block's size S (32; Q6_K's 16): its class (0: the
// FMA chain; 1: every m fits int16; 2: m = hi * 2^14 + lo, lo in [0, 2^14), both
// int16), its unit 2^u and sum m, and per pair its (m_even, m_odd) as two int16 in an
// int32 (lo's; hi's for class 2).
struct ExactBlocks {
  int64_t size = 0, nb = 0, pairs = 0, qmax = 0;
  std::vector<uint8_t> kind;    // [rows][nb]
  std::vector<float> unit;      // [rows][nb]
  std::vector<int32_t> msum;    // [rows][nb]
  std::vector<int32_t> lo, hi;  // [rows][pairs]
  // Rows `from` .. m - 1 classified; the others' blocks all take the chain (kind 0).
  ExactBlocks(const u16* x, int64_t m, int64_t k, int64_t size, int64_t qmax, int64_t from = 0)
      : size(size), nb(k / size), pairs(k / 2), qmax(qmax), kind(m * nb), unit(m * nb), msum(m * nb),
        lo(m * pairs), hi(m * pairs) {
    TORCH_CHECK(size == 16 || size == 32, "exact blocks of 16 or 32 values");
    for (int64_t i = from; i < m; ++i)
      for (int64_t g = 0; g < nb; ++g) classify(x + i * k + g * size, i * nb + g, i * pairs + g * (size / 2));
  }
  void classify(const u16* v, int64_t at, int64_t pat) {
    // The unit: the lowest set bit over the block's values (bf16 v = M * 2^(e - 134),
    // M = 128 + its 7 stored bits; e = 0 reads as zero, e = 255 is inf or NaN).
    const int n = static_cast<int>(size);
    int lowest = INT32_MAX;
    for (int i = 0; i < n; ++i) {
      const int e = (v[i] >> 7) & 0xFF;
      if (e == 255) return;   // the FMA chain
      if (e == 0) continue;
      lowest = std::min(lowest, e - 134 + __builtin_ctz(0x80 | (v[i] & 0x7F)));
    }
    if (lowest == INT32_MAX) lowest = 0;   // every value reads as zero: the sum is +0
    if (lowest < -126 || lowest > 104) return;
    int32_t mv[QK];
    int64_t total = 0;
    for (int i = 0; i < n; ++i) {
      const int e = (v[i] >> 7) & 0xFF;
      const int sh = e - 134 - lowest;   // at least -ctz(M): M >> -sh is exact
      if (e != 0 && sh > 16) return;     // M * 2^sh >= 2^24: past the bound
      const int32_t mag = e == 0 ? 0 : (sh >= 0 ? (0x80 | (v[i] & 0x7F)) << sh : (0x80 | (v[i] & 0x7F)) >> -sh);
      mv[i] = (v[i] & 0x8000) ? -mag : mag;
      total += mag;
    }
    if (total * qmax >= (int64_t{1} << 24)) return;
    int32_t big = 0, sum = 0;
    for (int i = 0; i < n; ++i) big = std::max(big, std::abs(mv[i])), sum += mv[i];
    const bool one = big < (1 << 15);
    for (int p = 0; p < n / 2; ++p) {
      const int32_t e0 = mv[2 * p], o0 = mv[2 * p + 1];
      if (one) {
        lo[pat + p] = static_cast<int32_t>((static_cast<u32>(static_cast<u16>(o0)) << 16) | static_cast<u16>(e0));
      } else {
        lo[pat + p] = static_cast<int32_t>((static_cast<u32>(o0 & 0x3FFF) << 16) | static_cast<u32>(e0 & 0x3FFF));
        hi[pat + p] = static_cast<int32_t>((static_cast<u32>(static_cast<u16>(o0 >> 14)) << 16) |
                                           static_cast<u16>(e0 >> 14));
      }
    }
    kind[at] = one ? 1 : 2;
    unit[at] = from_bits(static_cast<u32>(lowest + 127) << 23);
    msum[at] = sum;
  }
};

// A record's stored integers n (q plus the bias) of pairs 2pp and 2pp + 1 for the 8
// columns of half h, as words, per column (even, odd): the 4-bit types' nibbles, with
// Q6_K's two high bits.
template <QKind KD>
inline void nwords_avx2(const QType& t, const uint8_t* rec, int pp, int h, __m256i& n0, __m256i& n1) {
  const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + t.q_off + pp * 32 + h * 16)));
  n0 = _mm256_and_si256(v, _mm256_set1_epi16(0x0F));
  n1 = _mm256_srli_epi16(v, 4);
  if constexpr (KD == QKind::Q6K) {   // pair p's bits 2(p mod 4), 2(p mod 4) + 1 of byte p / 4
    const __m256i hv = _mm256_srli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128(
                                             reinterpret_cast<const __m128i*>(rec + t.hi_off + (pp / 2) * 32 + h * 16))),
                                         4 * (pp % 2));
    const __m256i top = _mm256_set1_epi16(0x30);
    n0 = _mm256_or_si256(n0, _mm256_and_si256(_mm256_slli_epi16(hv, 4), top));
    n1 = _mm256_or_si256(n1, _mm256_and_si256(_mm256_slli_epi16(hv, 2), top));
  }
}

// The integer sums n * m of one (sub-)block, pairs 2pp0 .. 2pp0 + 2 NPP - 1 of a
// record, for its 16 columns as two 8-lane halves (acc[i][h]) and MR rows, each row's
// m from its ExactBlocks pairs (lo; with TWO also hi, added as hi * 2^14); each row's
// m broadcast once for both halves. Integer adds: exact in any order.
template <int MR, bool TWO, QKind KD, int NPP>
inline void exact_sums_avx2(const QType& t, const uint8_t* rec, int pp0, const int32_t* const* lo,
                            const int32_t* const* hi, __m256i (*acc)[2]) {
  __m256i hacc[MR][2];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = hacc[i][0] = hacc[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 8
  for (int pp = 0; pp < NPP; ++pp) {
    __m256i n0[2], n1[2];
    nwords_avx2<KD>(t, rec, pp0 + pp, 0, n0[0], n1[0]);
    nwords_avx2<KD>(t, rec, pp0 + pp, 1, n0[1], n1[1]);
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) {
      const __m256i e = _mm256_set1_epi32(lo[i][2 * pp]), o = _mm256_set1_epi32(lo[i][2 * pp + 1]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h)
        acc[i][h] = _mm256_add_epi32(acc[i][h], _mm256_add_epi32(_mm256_madd_epi16(n0[h], e), _mm256_madd_epi16(n1[h], o)));
      if constexpr (TWO) {
        const __m256i he = _mm256_set1_epi32(hi[i][2 * pp]), ho = _mm256_set1_epi32(hi[i][2 * pp + 1]);
#pragma GCC unroll 2
        for (int h = 0; h < 2; ++h)
          hacc[i][h] = _mm256_add_epi32(hacc[i][h],
                                        _mm256_add_epi32(_mm256_madd_epi16(n0[h], he), _mm256_madd_epi16(n1[h], ho)));
      }
    }
  }
  if constexpr (TWO) {
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i)
      for (int h = 0; h < 2; ++h) acc[i][h] = _mm256_add_epi32(_mm256_slli_epi32(hacc[i][h], 14), acc[i][h]);
  }
}

// A (sub-)block's FMA chain for one row: its record, its first pair there, the row's odd
// and even elements from that pair, and where its sums for the 16 columns go.
struct ChainJob {
  const uint8_t* rec;
  int p0;
  const float *xo, *xe;
  float* out;
};

// N chains side by side (each FMA waits on its chain's last: N of them hide that
// latency), each over SP pairs as qlanes_avx2 steps them, per column half.
template <QKind KD, int SP, int N>
inline void chains_avx2(const QType& t, const ChainJob* job) {
  __m256 s[N][2];
#pragma GCC unroll 4
  for (int k = 0; k < N; ++k) s[k][0] = s[k][1] = _mm256_setzero_ps();
  for (int p = 0; p < SP; p += 2) {
#pragma GCC unroll 4
    for (int k = 0; k < N; ++k) {
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        __m256 e0, o0, e1, o1;
        qpairs_avx2<KD, false>(t, job[k].rec, job[k].p0 + p, h, e0, o0, e1, o1);
        __m256 a = _mm256_fmadd_ps(_mm256_broadcast_ss(job[k].xo + p), o0, s[k][h]);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(job[k].xe + p), e0, a);
        a = _mm256_fmadd_ps(_mm256_broadcast_ss(job[k].xo + p + 1), o1, a);
        s[k][h] = _mm256_fmadd_ps(_mm256_broadcast_ss(job[k].xe + p + 1), e1, a);
      }
    }
  }
#pragma GCC unroll 4
  for (int k = 0; k < N; ++k) _mm256_store_ps(job[k].out, s[k][0]), _mm256_store_ps(job[k].out + 8, s[k][1]);
}

template <QKind KD, int SP>
inline void run_chains_avx2(const QType& t, const ChainJob* job, int n) {
  for (; n >= 4; n -= 4, job += 4) chains_avx2<KD, SP, 4>(t, job);
  if (n == 3) chains_avx2<KD, SP, 3>(t, job);
  if (n == 2) chains_avx2<KD, SP, 2>(t, job);
  if (n == 1) chains_avx2<KD, SP, 1>(t, job);
}

// One record of a type whose integers are 4-bit (Q4_0, Q4_1, Q4_K) or 6-bit (Q6_K), for
// MR rows x 16 columns, into the rows' lane sums (lane[i]): per (sub-)block, each row
// whose x is exact there (ExactBlocks) by integer sums over the record's integers, each
// other row's sums its FMA chain's (chained[sub-block][row], run before); then c = D * s
// (Q4_1: plus m * t; Q4_K: less M * t) added to the lane, sub-block by sub-block:
// qlanes_avx2's steps. MINS: t.mins (Q4_1, Q4_K). g: the record's block of K; tx: the
// tile's rows, whole.
template <int MR, QKind KD, bool MINS>
inline void qrecord_exact_avx2(const QType& t, const uint8_t* rec, const ExactBlocks& ex, int64_t row, int64_t g,
                               const float* tx, const float* const (*chained)[MR], float* const* lane) {
  static_assert(KD == QKind::Q4 || KD == QKind::Q4K || KD == QKind::Q6K, "the types served by exact blocks");
  constexpr int SUBS = subs_of<KD>(), SP = sub_pairs_of<KD>();
  const int64_t pairs = ex.pairs, kq = pairs / (QK / 2);
  // The record two ahead (at least 4 KiB), a slice per sub-block: a column block's
  // records, and the thread's column blocks, lie one after another, and one burst for a
  // whole K-quant record would overrun the core's outstanding misses.
  const int64_t slice = (t.rec / SUBS + 63) / 64 * 64;
  for (int sb = 0; sb < SUBS; ++sb) {
    for (int64_t off = sb * slice; off < std::min<int64_t>((sb + 1) * slice, t.rec); off += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rec + std::max<int64_t>(2 * t.rec, 4096) + off), _MM_HINT_T0);
    const int64_t gx = g * SUBS + sb;        // x's block of the sub-block's size (ExactBlocks)
    const int64_t p0 = gx * SP;              // its first pair in a row
    const int64_t tq = p0 / (QK / 2);        // its 32 values' sum t (Q4_1, Q4_K)
    int kinds = 0;
    const int32_t* lo[MR];
    const int32_t* hi[MR];
    for (int i = 0; i < MR; ++i) {
      kinds |= 1 << ex.kind[(row + i) * ex.nb + gx];
      lo[i] = ex.lo.data() + (row + i) * pairs + p0;
      hi[i] = ex.hi.data() + (row + i) * pairs + p0;
    }
    __m256i acc[MR][2];
    if (kinds & 4) {
      exact_sums_avx2<MR, true, KD, SP / 2>(t, rec, sb * SP / 2, lo, hi, acc);
    } else if (kinds & 2) {
      exact_sums_avx2<MR, false, KD, SP / 2>(t, rec, sb * SP / 2, lo, hi, acc);
    }
    const __m256 d[2] = {qscale_avx2<KD>(t, rec, sb, 0), qscale_avx2<KD>(t, rec, sb, 1)};
    __m256 mn[2];
    if constexpr (MINS) mn[0] = qmin_avx2<KD>(t, rec, sb, 0), mn[1] = qmin_avx2<KD>(t, rec, sb, 1);
    for (int i = 0; i < MR; ++i) {
      const int64_t at = (row + i) * ex.nb + gx;
      const bool exact = ex.kind[at] != 0;
      // The exact sum (q * m summed as n * m less bias * sum m, times the unit), or the chain's.
      const __m256i bias = _mm256_set1_epi32(t.bias * ex.msum[at]);
      const __m256 unit = _mm256_set1_ps(ex.unit[at]);
      __m256 xt;
      if constexpr (MINS) xt = _mm256_set1_ps(tx[i * kq + tq]);
#pragma GCC unroll 2
      for (int h = 0; h < 2; ++h) {
        const __m256 s = exact ? _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(acc[i][h], bias)), unit)
                               : _mm256_load_ps(chained[sb][i] + h * 8);
        __m256 v = _mm256_mul_ps(d[h], s);
        if constexpr (MINS) {
          const __m256 mt = _mm256_mul_ps(mn[h], xt);
          v = KD == QKind::Q4K ? _mm256_sub_ps(v, mt) : _mm256_add_ps(v, mt);
        }
        float* l = lane[i] + h * 8;
        _mm256_store_ps(l, _mm256_add_ps(_mm256_load_ps(l), v));
      }
    }
  }
}

// The AVX2 tile by exact blocks: qtile_avx2's lanes and tree, each record through
// qrecord_exact_avx2. xo, xe, tx: the tile's rows; ex: every row of the call.
template <int MR, QKind KD>
void qtile_exact_avx2(const QType& t, const QLayout& lay, const float* xo, const float* xe, const float* tx,
                      const ExactBlocks& ex, const uint8_t* w, const Out& out, int64_t row, int64_t col) {
  const int64_t per = lay.per;
  alignas(32) float lanes[16][MR][16];
  for (int l = 0; l < 16; ++l)
    for (int i = 0; i < MR; ++i)
      for (int c = 0; c < 16; ++c) lanes[l][i][c] = 0.f;
  constexpr int SUBS = subs_of<KD>(), SP = sub_pairs_of<KD>();
  // The chains of a group of records (a step's, one per lane, for a one-block record;
  // else one record's sub-blocks) run first, side by side, their sums kept for the
  // records' own order of steps. At most 16 (sub-)blocks a group.
  alignas(32) float sums[16 * MR][16];
  const float* chained[16][MR];
  ChainJob jobs[16 * MR];
  for (int64_t s = 0; s < per; ++s) {
    const int64_t live = lay.live[s];
    const int64_t group = SUBS == 1 ? live : 1;
    for (int64_t j0 = 0; j0 < live; j0 += group) {
      int n = 0;
      for (int64_t j = j0; j < j0 + group; ++j)
        for (int sb = 0; sb < SUBS; ++sb)
          for (int i = 0; i < MR; ++i) {
            const int64_t p0 = ((j * per + s) * SUBS + sb) * SP;   // the (sub-)block's first pair in a row
            if (ex.kind[(row + i) * ex.nb + p0 / SP] != 0) continue;
            jobs[n] = {w + (lay.base[s] + j) * t.rec, sb * SP, xo + i * ex.pairs + p0, xe + i * ex.pairs + p0, sums[n]};
            chained[(j - j0) * SUBS + sb][i] = sums[n++];
          }
      run_chains_avx2<KD, SP>(t, jobs, n);
      for (int64_t j = j0; j < j0 + group; ++j) {
        float* lane[MR];
        for (int i = 0; i < MR; ++i) lane[i] = lanes[j][i];
        if (t.mins) {
          qrecord_exact_avx2<MR, KD, true>(t, w + (lay.base[s] + j) * t.rec, ex, row, j * per + s, tx,
                                           chained + (j - j0) * SUBS, lane);
        } else {
          qrecord_exact_avx2<MR, KD, false>(t, w + (lay.base[s] + j) * t.rec, ex, row, j * per + s, tx,
                                            chained + (j - j0) * SUBS, lane);
        }
      }
    }
  }
  fold_lanes_avx2<MR>(lanes, lay.levels, out, row, col);
}
#endif

// x @ w.T on a quantized packed weight (qpack, with `per`): bf16 out (rounded), or
// binary32 out; the sums of 2^levels lanes (4: the whole dot; fewer: a tensor-parallel
// rank's subtree). `portable`: the spec written out, in every build (the probe
// compares the two).
torch::Tensor qlinear_lanes(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, bool portable, int64_t per,
                            int levels) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3, "packed must come from the reference's qpack");
  const QType& t = qtype_of_record(packed.size(2));
  check_qpacked(x, packed, n, t.values);
  x = x.contiguous();
  const QLayout lay(packed.size(1), per, levels);
  const int64_t m = x.size(0), k = x.size(1), cbs = packed.size(0), stride = packed.size(1) * t.rec;
  auto result = torch::empty({m, n}, x.options().dtype(f32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0 || n == 0) return result;
  const Out out = out_to(result, n);
  const u16* xp = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  std::vector<float> tx;
  if (t.mins) {
    Flush flush;
    tx = block_sums(xp, m, k);
  }
  const int64_t kq = k / QK;
  if (portable) {
    for_each_tile<4>(m, cbs, [&](auto rows, int64_t r, int64_t b, int64_t) {
      qtile_portable<decltype(rows)::value>(t, lay, xp + r * k, k, tx.data() + r * kq, wp + b * stride, out, r, b * 16);
    });
    return result;
  }
#if defined(GATEENG_REF_AVX512BF16)
  with_kind(t, [&](auto kind) {
    for_each_tile<8>(m, cbs, [&](auto rows, int64_t r, int64_t b, int64_t nb) {
      constexpr int MR = decltype(rows)::value;
      qtile_dpbf16<MR, std::max(1, 8 / MR), decltype(kind)::value>(
          t, lay, xp + r * k, k, tx.data() + r * kq, wp + b * stride, nb >= 0 ? wp + nb * stride : nullptr, out, r,
          b * 16);
    });
  });
#elif defined(GATEENG_REF_AVX2)
  const int64_t pairs = k / 2;
  std::vector<float> xo(m * pairs), xe(m * pairs);   // exact: a bf16 is a binary32
  for (int64_t i = 0; i < m * pairs; ++i) xo[i] = bf(xp[2 * i + 1]), xe[i] = bf(xp[2 * i]);
  // Two ways to the same bits. A tile of one row takes exact blocks (its integers
  // decoded for that row alone: the integer sums cost less than the FMAs); a tile of
  // more rows shares each decoded integer among its rows' FMA chains, which then cost
  // less, except Q6_K's, whose decoding costs more. Q8_0 and Q5_K take the chains.
  const bool q4 = t.kind == QKind::Q4 || t.kind == QKind::Q4K;
  const bool exact = t.kind == QKind::Q6K || (q4 && m % 4 == 1);
  // A 4-bit type's one-row tile is the last row (for_each_tile<4>): only it reads them.
  const ExactBlocks ex(xp, exact ? m : 0, k, t.sub, exact_qmax(t), q4 ? m - 1 : 0);
  const bool scaled = q4 && m > 1 && scaled_nibbles(xp, m * k);
  std::vector<float> xos, xes;
  if (scaled) {   // x / s for the place s of the integer it multiplies (scaled_nibbles)
    Flush flush;
    xos.resize(m * pairs), xes.resize(m * pairs);
    for (int64_t i = 0; i < m * pairs; ++i) {
      xos[i] = xo[i] * (i % 2 ? 1.f / 4096 : 1.f / 256);
      xes[i] = xe[i] * (i % 2 ? 1.f / 16 : 1.f);
    }
  }
  with_kind(t, [&](auto kind) {
    constexpr QKind KD = decltype(kind)::value;
    for_each_tile<4>(m, cbs, [&](auto rows, int64_t r, int64_t b, int64_t nb) {
      constexpr int MR = decltype(rows)::value;
      constexpr int LN = std::max(1, 4 / MR);
      const uint8_t* next = nb >= 0 ? wp + nb * stride : nullptr;
      if constexpr (KD == QKind::Q6K || ((KD == QKind::Q4 || KD == QKind::Q4K) && MR == 1)) {
        qtile_exact_avx2<MR, KD>(t, lay, xo.data() + r * pairs, xe.data() + r * pairs, tx.data() + r * kq, ex,
                                 wp + b * stride, out, r, b * 16);
      } else if constexpr (KD == QKind::Q4 || KD == QKind::Q4K) {
        if (scaled) {
          qtile_avx2<MR, LN, KD, true>(t, lay, xos.data() + r * pairs, xes.data() + r * pairs, k, tx.data() + r * kq,
                                       wp + b * stride, next, out, r, b * 16);
        } else {
          qtile_avx2<MR, LN, KD, false>(t, lay, xo.data() + r * pairs, xe.data() + r * pairs, k, tx.data() + r * kq,
                                        wp + b * stride, next, out, r, b * 16);
        }
      } else {
        qtile_avx2<MR, LN, KD, false>(t, lay, xo.data() + r * pairs, xe.data() + r * pairs, k, tx.data() + r * kq,
                                      wp + b * stride, next, out, r, b * 16);
      }
    });
  });
#else
  for_each_tile<4>(m, cbs, [&](auto rows, int64_t r, int64_t b, int64_t) {
    qtile_portable<decltype(rows)::value>(t, lay, xp + r * k, k, tx.data() + r * kq, wp + b * stride, out, r, b * 16);
  });
#endif
  return result;
}

torch::Tensor qlinear(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, bool portable, int64_t per) {
  return qlinear_lanes(x, packed, n, f32, portable, per, 4);
}

// The bf16 values of rows `ids` of a quantized packed weight (SPEC.md: an embedding's
// rows): bf16(d * q), bf16((d * q) + m) for Q4_1, bf16((d * sc) * q) for Q6_K and
// bf16(((d * sc) * q) - (dmin * min)) for Q4_K and Q5_K.
torch::Tensor qrows(torch::Tensor packed, torch::Tensor ids, int64_t per) {
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 && packed.is_contiguous(),
              "packed must come from qpack");
  const QType& t = qtype_of_record(packed.size(2));
  ids = ids.to(torch::kLong).contiguous();
  const int64_t nb = packed.size(1), k = nb * t.values, rows = ids.numel();
  const QLayout lay(nb, per);
  auto out = torch::empty({rows, k}, torch::kBFloat16);
  u16* o = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  Flush flush;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t cb = id[r] / 16;
    const int c = static_cast<int>(id[r] % 16);
    TORCH_CHECK(id[r] >= 0 && cb < packed.size(0), "row id ", id[r], " out of range");
    for (int64_t g = 0; g < nb; ++g) {
      const uint8_t* rec = wp + (cb * nb + lay.record(g)) * t.rec;
      for (int v = 0; v < t.values; ++v) {
        const int j = v / t.sub;
        float value = qscale(t, rec, j, c) * qint(t, rec, v / 2, c, v % 2);
        if (t.mins) value = t.kq() ? value - qmin(t, rec, j, c) : value + qmin(t, rec, j, c);
        o[r * k + g * t.values + v] = to_bf(value);
      }
    }
  }
  return out;
}

// x @ w.T on a packed weight (pack, or qpack for a quantized one, laid out with `per`):
// bf16 out (rounded), or binary32 out (f32 = true).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t per) {
  if (packed.scalar_type() == torch::kUInt8) return qlinear(x, packed, n, f32, false, per);
  TORCH_CHECK(per == 0, "per is a quantized weight's layout");
  check_packed(x, packed, n);
  x = x.contiguous();
  auto result = torch::empty({x.size(0), n}, x.options().dtype(f32 ? torch::kFloat : torch::kBFloat16));
  matmul(x, packed, Blocks{(x.size(1) / 2 + DOT_BLOCKS - 1) / DOT_BLOCKS, 4}, out_to(result, n));
  return result;
}

// log2(n) for n a power of two from 1 to 16: how many of the tree's levels n of its
// inputs fill.
int tree_levels(int64_t n, const char* what) {
  int levels = 0;
  while ((int64_t{1} << levels) < n) ++levels;
  TORCH_CHECK(n >= 1 && n <= DOT_BLOCKS && (int64_t{1} << levels) == n, what, " must be a power of two from 1 to 16");
  return levels;
}

// One tensor-parallel rank's share of x @ w.T (SPEC.md, "tensor parallelism"): x and
// the packed w hold the rank's slice of K, `blocks` (a power of two, at most 16) of
// the whole K's blocks of `per` pairs (a quantized weight: lanes of `per` GGUF blocks,
// packed with that per); binary32 out, each the subtree over those blocks.
torch::Tensor linear_partial(torch::Tensor x, torch::Tensor packed, int64_t n, int64_t per, int64_t blocks) {
  const int levels = tree_levels(blocks, "blocks");
  if (packed.scalar_type() == torch::kUInt8) {
    TORCH_CHECK(per >= 1, "per must be at least 1");
    return qlinear_lanes(x, packed, n, true, false, per, levels);
  }
  check_packed(x, packed, n);
  TORCH_CHECK(per >= 1 && x.size(1) / 2 <= per * blocks, "x holds more pairs than its blocks");
  x = x.contiguous();
  auto result = torch::empty({x.size(0), n}, x.options().dtype(torch::kFloat));
  matmul(x, packed, Blocks{per, levels}, out_to(result, n));
  return result;
}

// ---- the row-wise ops -------------------------------------------------------------

void check_bf16(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kBFloat16, name, " must be a bf16 CPU tensor");
}
const u16* cbits(const torch::Tensor& t) { return reinterpret_cast<const u16*>(t.data_ptr<at::BFloat16>()); }
u16* bits(torch::Tensor& t) { return reinterpret_cast<u16*>(t.data_ptr<at::BFloat16>()); }

// RMSNorm of one row (SPEC.md, "RMSNorm"): the mean square from dot(x, x), the
// normalized value rounded to bf16 before the weight multiplies it.
inline void rms_norm_row(const u16* x, const u16* w, u16* y, int64_t h, float eps) {
  const float ms = dot(x, x, h) / static_cast<float>(h);
  const float inv = 1.f / std::sqrt(ms + eps);
  for (int64_t i = 0; i < h; ++i) y[i] = to_bf(bf(w[i]) * bf(to_bf(bf(x[i]) * inv)));
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_bf16(x, "x");
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1), "w must be [hidden]");
  x = x.contiguous();
  w = w.contiguous();
  auto out = torch::empty_like(x);
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  const u16 *xp = cbits(x), *wp = cbits(w);
  u16* op = bits(out);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r) rms_norm_row(xp + r * h, wp, op + r * h, h, e);
  });
  return out;
}

// (bf16(h + add), rms_norm of it): the residual add and the norm after it.
std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor add, torch::Tensor w, double eps) {
  check_bf16(h, "h");
  check_bf16(add, "add");
  check_bf16(w, "w");
  TORCH_CHECK(add.sizes() == h.sizes() && w.dim() == 1 && w.size(0) == h.size(-1), "add must match h, w [hidden]");
  h = h.contiguous();
  add = add.contiguous();
  w = w.contiguous();
  auto h_out = torch::empty_like(h), x_out = torch::empty_like(h);
  const int64_t n = h.size(-1), rows = n ? h.numel() / n : 0;
  const u16 *hp = cbits(h), *ap = cbits(add), *wp = cbits(w);
  u16 *ho = bits(h_out), *xo = bits(x_out);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < n; ++i) ho[r * n + i] = to_bf(bf(hp[r * n + i]) + bf(ap[r * n + i]));
      rms_norm_row(ho + r * n, wp, xo + r * n, n, e);
    }
  });
  return {h_out, x_out};
}

// bf16(a + b), elementwise (a bias add); b broadcasts over a's rows when 1-D.
torch::Tensor add(torch::Tensor a, torch::Tensor b) {
  check_bf16(a, "a");
  check_bf16(b, "b");
  a = a.contiguous();
  b = b.contiguous();
  const int64_t n = a.size(-1), rows = n ? a.numel() / n : 0;
  TORCH_CHECK(b.numel() == n || b.sizes() == a.sizes(), "b must be [n] or a's shape");
  const int64_t stride = b.numel() == n ? 0 : n;
  auto out = torch::empty_like(a);
  const u16 *ap = cbits(a), *bp = cbits(b);
  u16* op = bits(out);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r)
      for (int64_t i = 0; i < n; ++i) op[r * n + i] = to_bf(bf(ap[r * n + i]) + bf(bp[r * stride + i]));
  });
  return out;
}

// out = bf16(bf16(x / (1 + exp(-x))) * up) for gate_up = [gate | up] (SPEC.md, "SiLU").
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_bf16(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * n]");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  const u16* gp = cbits(gate_up);
  u16* op = bits(out);
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r) {
      const u16* g = gp + r * 2 * n;
      const u16* u = g + n;
      for (int64_t i = 0; i < n; ++i) {
        const float x = bf(g[i]);
        const float s = x / (1.f + spec_exp(-x));
        op[r * n + i] = to_bf(bf(to_bf(s)) * bf(u[i]));
      }
    }
  });
  return out;
}

// RoPE (rotate-half) on a row's query and key heads, its key and value stored at its
// cache slot (SPEC.md, "RoPE"): y = bf16(bf16(x cos) + bf16(rot(x) sin)). qkv [rows,
// (Hq + 2 Hkv) D]; cos, sin [rows, D] (the spec's tables at the rows' positions).
// Slot -1 (a padding row) stores nothing. Returns q [rows, Hq, D].
torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor slots, int64_t hq) {
  check_bf16(qkv, "qkv");
  check_bf16(cos, "cos");
  check_bf16(sin, "sin");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "the KV cache must be contiguous [blocks, block_size, Hkv, D]");
  TORCH_CHECK(slots.scalar_type() == torch::kLong, "slots: int64");
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3), rows = qkv.size(0);
  TORCH_CHECK(d % 2 == 0 && qkv.dim() == 2 && qkv.size(1) == (hq + 2 * hkv) * d, "qkv must be [rows, (Hq + 2 Hkv) D]");
  TORCH_CHECK(cos.numel() == rows * d && sin.numel() == rows * d && slots.numel() == rows,
              "cos, sin: [rows, D]; slots: [rows]");
  qkv = qkv.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  slots = slots.contiguous();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t capacity = k_cache.size(0) * k_cache.size(1);
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(sp[r] >= -1 && sp[r] < capacity, "row ", r, " names slot ", sp[r], " of ", capacity);
  }
  auto q = torch::empty({rows, hq, d}, qkv.options());
  const u16 *xp = cbits(qkv), *cp = cbits(cos), *snp = cbits(sin);
  u16 *qp = bits(q), *kp = bits(k_cache), *vp = bits(v_cache);
  const int64_t half = d / 2, width = (hq + 2 * hkv) * d;
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    Flush flush;
    auto rotate = [&](const u16* x, const u16* c, const u16* s, u16* y) {
      for (int64_t i = 0; i < d; ++i) {
        const float rot = i < half ? -bf(x[i + half]) : bf(x[i - half]);
        y[i] = to_bf(bf(to_bf(bf(x[i]) * bf(c[i]))) + bf(to_bf(rot * bf(s[i]))));
      }
    };
    for (int64_t r = begin; r < end; ++r) {
      const u16* row = xp + r * width;
      for (int64_t h = 0; h < hq; ++h) rotate(row + h * d, cp + r * d, snp + r * d, qp + (r * hq + h) * d);
      if (sp[r] < 0) continue;
      for (int64_t h = 0; h < hkv; ++h) rotate(row + (hq + h) * d, cp + r * d, snp + r * d, kp + (sp[r] * hkv + h) * d);
      std::memcpy(vp + sp[r] * hkv * d, row + (hq + hkv) * d, hkv * d * sizeof(u16));
    }
  });
  return q;
}

// ---- attention --------------------------------------------------------------------
// One query row per call row (SPEC.md, "attention"). Keys in chunks of 16 at absolute
// positions [16c, 16c + 16); per chunk the scores s_t = dot(q, k_t) * scale, an online
// softmax step and the value chain. Nothing depends on the KV block size or on the
// call's rows.
constexpr int64_t CHUNK = 16;

#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
// kt[p * 16 + t] = pair p of key t, for a chunk's 16 keys (past n: key 0's, whose
// scores are discarded): 8 x 8 transposes of u32, so the score chains read a pair
// of all 16 keys as one vector. pairs: a multiple of 8.
inline void transpose_keys(const u16* const* keys, int64_t n, int64_t pairs, u32* kt) {
  for (int64_t half = 0; half < 2; ++half) {
    const u32* src[8];
    for (int64_t i = 0; i < 8; ++i) src[i] = reinterpret_cast<const u32*>(keys[half * 8 + i < n ? half * 8 + i : 0]);
    for (int64_t p0 = 0; p0 < pairs; p0 += 8) {
      __m256i r[8], t[8], u[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src[i] + p0));
      for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
      }
      for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
      }
      for (int j = 0; j < 4; ++j) {
        r[j] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x20);
        r[j + 4] = _mm256_permute2x128_si256(u[j], u[j + 4], 0x31);
      }
      for (int j = 0; j < 8; ++j) _mm256_storeu_si256(reinterpret_cast<__m256i*>(kt + (p0 + j) * 16 + half * 8), r[j]);
    }
  }
}

// The scores of a chunk's 16 keys for G query heads (lanes are the keys; each lane's
// chain is its own key's dot, in the spec's order): s[j * 16 + t] = dot(q_j, k_t) * scale.
// qp: the heads' queries as pairs (u32, [G][pairs]); qo, qe: their odd and even
// elements as binary32 ([G][pairs]).
template <int G>
void chunk_scores(const u32* qp, const float* qo, const float* qe, const u32* kt, int64_t pairs, float scale,
                  float* s) {
  const int64_t per = pairs / 16;
#if defined(GATEENG_REF_AVX512BF16)
  (void)qo, (void)qe;
  __m512 lvl[5][G];
  for (int l = 0; l < 16; ++l) {
    __m512 acc[G];
    for (int j = 0; j < G; ++j) acc[j] = _mm512_setzero_ps();
    for (int64_t p = l * per; p < (l + 1) * per; ++p) {
      const __m512bh kv = (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(kt + p * 16));
      for (int j = 0; j < G; ++j) {
        acc[j] = _mm512_dpbf16_ps(acc[j], (__m512bh)_mm512_set1_epi32(static_cast<int>(qp[j * pairs + p])), kv);
      }
    }
    int i = 0;
    for (; (l >> i) & 1; ++i) {
      for (int j = 0; j < G; ++j) acc[j] = _mm512_add_ps(lvl[i][j], acc[j]);
    }
    for (int j = 0; j < G; ++j) lvl[i][j] = acc[j];
  }
  for (int j = 0; j < G; ++j) _mm512_storeu_ps(s + j * CHUNK, _mm512_mul_ps(lvl[4][j], _mm512_set1_ps(scale)));
#else
  (void)qp;
  const __m256i hi_mask = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m256 lvl[5][G][2];
  for (int l = 0; l < 16; ++l) {
    __m256 acc[G][2];
    for (int j = 0; j < G; ++j) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    for (int64_t p = l * per; p < (l + 1) * per; ++p) {
      const __m256i k0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + p * 16));
      const __m256i k1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(kt + p * 16 + 8));
      const __m256 o0 = _mm256_castsi256_ps(_mm256_and_si256(k0, hi_mask));
      const __m256 o1 = _mm256_castsi256_ps(_mm256_and_si256(k1, hi_mask));
      const __m256 e0 = _mm256_castsi256_ps(_mm256_slli_epi32(k0, 16));
      const __m256 e1 = _mm256_castsi256_ps(_mm256_slli_epi32(k1, 16));
      for (int j = 0; j < G; ++j) {
        const __m256 vo = _mm256_broadcast_ss(qo + j * pairs + p), ve = _mm256_broadcast_ss(qe + j * pairs + p);
        acc[j][0] = _mm256_fmadd_ps(ve, e0, _mm256_fmadd_ps(vo, o0, acc[j][0]));
        acc[j][1] = _mm256_fmadd_ps(ve, e1, _mm256_fmadd_ps(vo, o1, acc[j][1]));
      }
    }
    int i = 0;
    for (; (l >> i) & 1; ++i) {
      for (int j = 0; j < G; ++j) {
        acc[j][0] = _mm256_add_ps(lvl[i][j][0], acc[j][0]);
        acc[j][1] = _mm256_add_ps(lvl[i][j][1], acc[j][1]);
      }
    }
    for (int j = 0; j < G; ++j) lvl[i][j][0] = acc[j][0], lvl[i][j][1] = acc[j][1];
  }
  const __m256 sc = _mm256_set1_ps(scale);
  for (int j = 0; j < G; ++j) {
    _mm256_storeu_ps(s + j * CHUNK, _mm256_mul_ps(lvl[4][j][0], sc));
    _mm256_storeu_ps(s + j * CHUNK + 8, _mm256_mul_ps(lvl[4][j][1], sc));
  }
#endif
}

constexpr int64_t MAX_GROUP = 8;   // query heads per KV head the vector scores take (more: portable)

template <int G = MAX_GROUP>
inline void chunk_scores_for(int64_t g, const u32* qp, const float* qo, const float* qe, const u32* kt, int64_t pairs,
                             float scale, float* s) {
  if constexpr (G > 1) {
    if (g < G) return chunk_scores_for<G - 1>(g, qp, qo, qe, kt, pairs, scale, s);
  }
  chunk_scores<G>(qp, qo, qe, kt, pairs, scale, s);
}
#endif

// portable: the portable code only (the start-up probe's yardstick for the vector paths).
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                               torch::Tensor lens, double scale, bool portable) {
  check_bf16(q, "q");
  check_bf16(k_cache, "k_cache");
  check_bf16(v_cache, "v_cache");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(), "bad shapes");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && lens.scalar_type() == torch::kLong, "tables, lens: int64");
  const int64_t batch = q.size(0), hq = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && hq % hkv == 0, "head shapes do not match");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == batch && lens.numel() == batch, "tables [B, W], lens [B]");
  q = q.contiguous();
  tables = tables.contiguous();
  lens = lens.contiguous();
  const int64_t width = tables.size(1), blocks = k_cache.size(0);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * block_size, "row ", b, " attends ", lp[b],
                " keys, outside its block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i) {
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < blocks, "row ", b, " names block ",
                  tp[b * width + i], " of ", blocks);
    }
  }
  auto out = torch::empty_like(q);
  const u16 *qp = cbits(q), *kp = cbits(k_cache), *vp = cbits(v_cache);
  u16* op = bits(out);
  const int64_t g = hq / hkv, tok = hkv * d;
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    Flush flush;
    std::vector<const u16*> qs(g), keys(CHUNK), values(CHUNK);
    std::vector<float> s(g * CHUNK), es(g * CHUNK), acc(g * d), m(g), l(g);
    const int64_t pairs = d / 2;
#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
    const bool vector = !portable && d % 32 == 0 && g <= MAX_GROUP;   // pairs in whole 16-lane blocks of 8
    std::vector<u32> qpairs(g * pairs), kt(pairs * CHUNK);
    std::vector<float> qo(g * pairs), qe(g * pairs);
#endif
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, h = item % hkv, len = lp[b];
      for (int64_t j = 0; j < g; ++j) qs[j] = qp + (b * hq + h * g + j) * d;
#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
      for (int64_t j = 0; j < g && vector; ++j) {
        std::memcpy(qpairs.data() + j * pairs, qs[j], pairs * sizeof(u32));
        for (int64_t p = 0; p < pairs; ++p) qo[j * pairs + p] = bf(qs[j][2 * p + 1]), qe[j * pairs + p] = bf(qs[j][2 * p]);
      }
#endif
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -kInf);
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = 0; start < len; start += CHUNK) {
        const int64_t n = std::min(CHUNK, len - start);
        for (int64_t t = 0; t < n; ++t) {
          const int64_t pos = start + t;
          const int64_t slot = tp[b * width + pos / block_size] * block_size + pos % block_size;
          keys[t] = kp + slot * tok + h * d;
          values[t] = vp + slot * tok + h * d;
        }
#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
        if (vector) {
          transpose_keys(keys.data(), n, pairs, kt.data());
          chunk_scores_for(g, qpairs.data(), qo.data(), qe.data(), kt.data(), pairs, sc, s.data());
        } else
#endif
        {
          for (int64_t j = 0; j < g; ++j)
            for (int64_t t = 0; t < n; ++t) s[j * CHUNK + t] = dot(qs[j], keys[t], d) * sc;
        }
        for (int64_t j = 0; j < g; ++j) {
          const float* sj = s.data() + j * CHUNK;
          float mx = m[j];
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sj[t]);
          const float rescale = spec_exp(m[j] - mx);
          float* e = es.data() + j * CHUNK;   // head j's weights, kept for the value chains
          for (int64_t t = 0; t < CHUNK; ++t) e[t] = t < n ? spec_exp(sj[t] - mx) : 0.f;   // +0 past the keys
          float lvl[5];
          for (int t = 0; t < CHUNK; ++t) fold(t, e[t], lvl, add_f);
          m[j] = mx;
          l[j] = l[j] * rescale + lvl[4];
          float* aj = acc.data() + j * d;
          for (int64_t i = 0; i < d; ++i) aj[i] = aj[i] * rescale;
        }
        // The value chains: acc[j][i] = acc[j][i] + e[j][t] * v_t[i] for each key t in
        // order (a multiply, then an add). Each element's chain is the same whichever
        // loop runs outside; eight elements of the G heads at a time stay in registers.
        int64_t i0 = 0;
#if defined(GATEENG_REF_AVX2) || defined(GATEENG_REF_AVX512BF16)
        if (!portable && g <= MAX_GROUP) {
          for (; i0 + 8 <= d; i0 += 8) {
            __m256 a[MAX_GROUP];
            for (int64_t j = 0; j < g; ++j) a[j] = _mm256_loadu_ps(acc.data() + j * d + i0);
            for (int64_t t = 0; t < n; ++t) {
              const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(values[t] + i0));
              const __m256 v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
              for (int64_t j = 0; j < g; ++j)
                a[j] = _mm256_add_ps(a[j], _mm256_mul_ps(_mm256_broadcast_ss(es.data() + j * CHUNK + t), v));
            }
            for (int64_t j = 0; j < g; ++j) _mm256_storeu_ps(acc.data() + j * d + i0, a[j]);
          }
        }
#endif
        for (int64_t j = 0; j < g; ++j) {
          float* aj = acc.data() + j * d;
          for (int64_t t = 0; t < n; ++t) {
            const float p = es[j * CHUNK + t];
            for (int64_t i = i0; i < d; ++i) aj[i] = aj[i] + p * bf(values[t][i]);
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        const float inv = 1.f / l[j];
        u16* o = op + (b * hq + h * g + j) * d;
        for (int64_t i = 0; i < d; ++i) o[i] = to_bf(acc[j * d + i] * inv);
      }
    }
  });
  return out;
}

// ---- token choice -----------------------------------------------------------------

void check_f32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kFloat && t.is_contiguous(), name,
              " must be a contiguous float32 CPU tensor");
}

// Per row of scores [R, V]: the lowest id of the largest value, and that value minus
// the largest of the others (0 where the largest is tied).
std::vector<torch::Tensor> argmax_margin(torch::Tensor scores) {
  check_f32(scores, "scores");
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) >= 2, "scores must be [rows, vocab >= 2]");
  const int64_t rows = scores.size(0), v = scores.size(1);
  auto tokens = torch::empty({rows}, torch::kLong);
  auto margins = torch::empty({rows}, torch::kFloat);
  const float* sp = scores.data_ptr<float>();
  int64_t* tk = tokens.data_ptr<int64_t>();
  float* mg = margins.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r) {
      const float* x = sp + r * v;
      int64_t best = 0;
      float first = x[0], second = -kInf;
      for (int64_t i = 1; i < v; ++i) {
        if (x[i] > first) {
          second = first;
          first = x[i];
          best = i;
        } else if (x[i] > second) {
          second = x[i];
        }
      }
      tk[r] = best;
      mg[r] = first - second;
    }
  });
  return {tokens, margins};
}

// The spec's scores for one sampled row (SPEC.md, "sampling"): z / T, then top-k,
// then top-p; dropped ids -inf.
torch::Tensor sample_scores(torch::Tensor z, double temperature, int64_t top_k, double top_p) {
  check_f32(z, "z");
  TORCH_CHECK(z.dim() == 1 && temperature > 0, "z must be [vocab], temperature > 0");
  Flush flush;
  const int64_t v = z.size(0);
  auto out = torch::empty_like(z);
  const float* zp = z.data_ptr<float>();
  float* s = out.data_ptr<float>();
  const float t = static_cast<float>(temperature);
  for (int64_t i = 0; i < v; ++i) s[i] = zp[i] / t;
  if (top_k > 0 && top_k < v) {
    std::vector<float> copy(s, s + v);
    std::nth_element(copy.begin(), copy.begin() + (top_k - 1), copy.end(), std::greater<float>());
    const float kth = copy[top_k - 1];
    for (int64_t i = 0; i < v; ++i) {
      if (s[i] < kth) s[i] = -kInf;
    }
  }
  const float p_max = static_cast<float>(top_p);
  if (p_max < 1.f) {
    std::vector<int64_t> order(v);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return s[a] > s[b]; });
    std::vector<float> e(v);
    const float top = s[order[0]];
    for (int64_t j = 0; j < v; ++j) e[j] = spec_exp(s[order[j]] - top);
    const float total = sum(e.data(), v);
    float before = 0.f;   // the probability of the ids above this one
    std::vector<char> drop(v, 0);
    for (int64_t j = 0; j < v; ++j) {
      const float p = e[j] / total;
      drop[j] = before > p_max;
      before = before + p;
    }
    for (int64_t j = 0; j < v; ++j) {
      if (drop[j]) s[order[j]] = -kInf;
    }
  }
  return out;
}

// Gumbel noise for one row (SPEC.md, "sampling"): u = (2 (h >> 9) + 1) 2^-24 from the
// id's 32-bit hash h, then -log(-log(u)).
torch::Tensor gumbel(int64_t key, int64_t vocab) {
  Flush flush;
  auto out = torch::empty({vocab}, torch::kFloat);
  float* g = out.data_ptr<float>();
  const u32 k = static_cast<u32>(key);
  for (int64_t i = 0; i < vocab; ++i) {
    u32 x = (static_cast<u32>(i) * 0x9E3779B1u) ^ k;
    x ^= x >> 16;
    x *= 0x7FEB352Du;
    x ^= x >> 15;
    x *= 0x846CA68Bu;
    x ^= x >> 16;
    const float u = static_cast<float>(2u * (x >> 9) + 1u) * 0x1p-24f;
    g[i] = -spec_log(-spec_log(u));
  }
  return out;
}

// The ranks' partials [size, M, N] combined by the tree's top levels, in rank order
// (flushed): the whole dot's bits; rounded to bf16 unless f32.
torch::Tensor combine_partials(torch::Tensor partials, bool f32) {
  check_f32(partials, "partials");
  TORCH_CHECK(partials.dim() == 3, "partials must be [size, M, N]");
  const int64_t size = partials.size(0), count = partials.size(1) * partials.size(2);
  const int levels = tree_levels(size, "size");
  partials = partials.contiguous();
  auto result = torch::empty({partials.size(1), partials.size(2)},
                             partials.options().dtype(f32 ? torch::kFloat : torch::kBFloat16));
  const float* p = partials.data_ptr<float>();
  float* out32 = f32 ? result.data_ptr<float>() : nullptr;
  u16* out16 = f32 ? nullptr : reinterpret_cast<u16*>(result.data_ptr<at::BFloat16>());
  Flush flush;
  for (int64_t i = 0; i < count; ++i) {
    float lvl[5];
    for (int r = 0; r < size; ++r) fold(r, p[r * count + i], lvl, add_f);
    if (f32) {
      out32[i] = lvl[levels];
    } else {
      out16[i] = to_bf(lvl[levels]);
    }
  }
  return result;
}

// Elementwise a + b in binary32 (flushed), e.g. scores plus their Gumbel noise.
torch::Tensor add_f32(torch::Tensor a, torch::Tensor b) {
  check_f32(a, "a");
  check_f32(b, "b");
  TORCH_CHECK(a.sizes() == b.sizes(), "a and b must have one shape");
  Flush flush;
  auto out = torch::empty_like(a);
  const float *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < a.numel(); ++i) op[i] = ap[i] + bp[i];
  return out;
}

// log_softmax of one row (SPEC.md, "logprobs"): (s - max) - log(sum(exp(s - max))).
torch::Tensor log_softmax(torch::Tensor s) {
  check_f32(s, "s");
  TORCH_CHECK(s.dim() == 1 && s.numel() >= 1, "s must be [vocab]");
  Flush flush;
  const int64_t v = s.size(0);
  const float* x = s.data_ptr<float>();
  float mx = -kInf;
  for (int64_t i = 0; i < v; ++i) mx = std::max(mx, x[i]);
  std::vector<float> e(v);
  for (int64_t i = 0; i < v; ++i) e[i] = spec_exp(x[i] - mx);
  const float lz = spec_log(sum(e.data(), v));
  auto out = torch::empty_like(s);
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < v; ++i) o[i] = (x[i] - mx) - lz;
  return out;
}

// A mixture of experts' routing of each row (SPEC.md, "Mixture of experts"): from
// the binary32 router logits z [rows, E], the k chosen experts in ascending id
// order, their binary32 weights, and the router margin (the k-th ranking score
// minus the (k+1)-th; +inf when k = E). softmax_first: p = softmax(z) ranks and
// weighs (renormalized over the k when renorm); else z ranks and the k weights are
// the softmax over the k chosen logits. Ties rank the lower id first.
std::vector<torch::Tensor> moe_route(torch::Tensor logits, int64_t k, bool softmax_first, bool renorm) {
  check_f32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && k >= 1 && k <= logits.size(1), "logits must be [rows, E], 1 <= k <= E");
  logits = logits.contiguous();
  const int64_t rows = logits.size(0), e = logits.size(1);
  auto ids = torch::empty({rows, k}, torch::kLong);
  auto weights = torch::empty({rows, k}, torch::kFloat);
  auto margins = torch::empty({rows}, torch::kFloat);
  const float* zp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* wp = weights.data_ptr<float>();
  float* mp = margins.data_ptr<float>();
  Flush flush;
  std::vector<float> score(e), ex(e);
  std::vector<int64_t> order(e);
  for (int64_t r = 0; r < rows; ++r) {
    const float* z = zp + r * e;
    for (int64_t j = 0; j < e; ++j) TORCH_CHECK(z[j] == z[j], "router logit is NaN (row ", r, ", expert ", j, ")");
    if (softmax_first) {
      float mx = -kInf;
      for (int64_t j = 0; j < e; ++j) mx = std::max(mx, z[j]);
      for (int64_t j = 0; j < e; ++j) ex[j] = spec_exp(z[j] - mx);
      const float total = sum(ex.data(), e);
      for (int64_t j = 0; j < e; ++j) score[j] = ex[j] / total;
    } else {
      for (int64_t j = 0; j < e; ++j) score[j] = z[j];
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return score[a] > score[b]; });
    mp[r] = k < e ? score[order[k - 1]] - score[order[k]] : kInf;
    std::sort(order.begin(), order.begin() + k);   // the chosen, by ascending id
    int64_t* id = ip + r * k;
    float* w = wp + r * k;
    for (int64_t s = 0; s < k; ++s) id[s] = order[s];
    if (softmax_first) {
      for (int64_t s = 0; s < k; ++s) w[s] = score[id[s]];
      if (renorm) {
        float t = 0.f;
        for (int64_t s = 0; s < k; ++s) t = t + w[s];
        for (int64_t s = 0; s < k; ++s) w[s] = w[s] / t;
      }
    } else {
      float mx = -kInf;
      for (int64_t s = 0; s < k; ++s) mx = std::max(mx, z[id[s]]);
      float t = 0.f;
      for (int64_t s = 0; s < k; ++s) {
        w[s] = spec_exp(z[id[s]] - mx);
        t = t + w[s];
      }
      for (int64_t s = 0; s < k; ++s) w[s] = w[s] / t;
    }
  }
  return {ids, weights, margins};
}

// Each row's experts' outputs y [rows, k, H] (bf16, in ascending expert id order)
// weighted and summed (SPEC.md, "Mixture of experts"): acc = +0, then per expert in
// order acc = acc + w * y (a multiply, then an add), then bf16(acc).
torch::Tensor moe_combine(torch::Tensor y, torch::Tensor weights) {
  check_bf16(y, "y");
  check_f32(weights, "weights");
  TORCH_CHECK(y.dim() == 3 && weights.dim() == 2 && weights.size(0) == y.size(0) && weights.size(1) == y.size(1),
              "y must be [rows, k, H], weights [rows, k]");
  y = y.contiguous();
  weights = weights.contiguous();
  const int64_t rows = y.size(0), k = y.size(1), h = y.size(2);
  auto out = torch::empty({rows, h}, y.options());
  const u16* yp = cbits(y);
  const float* wp = weights.data_ptr<float>();
  u16* op = bits(out);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    Flush flush;
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < h; ++i) {
        float acc = 0.f;
        for (int64_t s = 0; s < k; ++s) {
          const float term = wp[r * k + s] * bf(yp[(r * k + s) * h + i]);
          acc = acc + term;
        }
        op[r * h + i] = to_bf(acc);
      }
    }
  });
  return out;
}

// A matrix as linear multiplies it: its packed parts (one, or a stack whose parts are
// stored in different types: SPEC.md, "Stacked projections"), each with its output size
// and lanes (`per`, as linear takes it); x @ W.T is the parts' outputs side by side.
struct Matrix {
  std::vector<torch::Tensor> parts;
  std::vector<int64_t> n, per;
  Matrix(std::vector<torch::Tensor> parts, std::vector<int64_t> n, std::vector<int64_t> per)
      : parts(std::move(parts)), n(std::move(n)), per(std::move(per)) {
    TORCH_CHECK(!this->parts.empty() && this->n.size() == this->parts.size() && this->per.size() == this->parts.size(),
                "a matrix has parts, each with its output size and lanes");
    for (const auto& part : this->parts) TORCH_CHECK(part.is_contiguous(), "a packed part must be contiguous");
  }
  int64_t rows() const { return std::accumulate(n.begin(), n.end(), int64_t{0}); }
  torch::Tensor apply(const torch::Tensor& x, bool f32) const {
    if (parts.size() == 1) return linear(x, parts[0], n[0], f32, per[0]);
    std::vector<torch::Tensor> outs;
    for (size_t i = 0; i < parts.size(); ++i) outs.push_back(linear(x, parts[i], n[i], f32, per[i]));
    return torch::cat(outs, 1);
  }
};

// A routing layer as the reference computes it (SPEC.md, "Mixture of experts"): its
// router (bf16, binary32 logits), every expert's gate_up and down, and the rule.
struct MoeLayer {
  Matrix router;
  std::vector<Matrix> gate_up, down;
  int64_t k;
  bool softmax_first, renorm;
  MoeLayer(Matrix router, std::vector<Matrix> gate_up, std::vector<Matrix> down, int64_t k, bool softmax_first,
           bool renorm)
      : router(std::move(router)), gate_up(std::move(gate_up)), down(std::move(down)), k(k),
        softmax_first(softmax_first), renorm(renorm) {
    const int64_t experts = this->router.rows();
    TORCH_CHECK(static_cast<int64_t>(this->gate_up.size()) == experts &&
                    static_cast<int64_t>(this->down.size()) == experts, "one gate_up and one down per router row");
    TORCH_CHECK(k >= 1 && k <= experts, "1 <= k <= experts");
    for (const auto& part : this->router.parts)
      TORCH_CHECK(part.scalar_type() == torch::kBFloat16, "the router is a bf16 weight (never quantized)");
  }
};

// A routing layer's MLP output for x [M, H] bf16, and each row's router margin: the
// router's binary32 logits (linear), the routing rule (moe_route), each active expert's
// gate_up, silu_mul and down once over the rows routed to it (row-invariant kernels: a
// row's outputs are those of the row alone), then moe_combine, in ascending expert id
// order. The same functions the per-op path calls one by one, so the same bits. With at
// least two active experts per thread the experts split across the threads (each
// expert's kernels then run inline on its thread: a parallel_for inside a parallel
// region does), else each matmul's column blocks split as in linear.
std::vector<torch::Tensor> moe_layer(torch::Tensor x, const MoeLayer& layer) {
  check_bf16(x, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [rows, hidden]");
  x = x.contiguous();
  const int64_t m = x.size(0), h = x.size(1), k = layer.k, experts = layer.router.rows();
  std::vector<torch::Tensor> routed = moe_route(layer.router.apply(x, true), k, layer.softmax_first, layer.renorm);
  // The (row, slot) pairs grouped by expert, each expert's in row order; the experts with
  // the most rows first: the threads that take them one by one then finish together.
  // (The order changes no bits: each expert's outputs are its own.)
  const gateeng::ExpertGroups groups(routed[0].data_ptr<int64_t>(), m, k, experts);
  std::vector<int64_t> active = groups.active;
  std::stable_sort(active.begin(), active.end(),
                   [&](int64_t a, int64_t b) { return groups.rows(a) > groups.rows(b); });
  auto y = torch::empty({m, k, h}, x.options());   // each (row, slot)'s expert output
  const u16* xp = cbits(x);
  u16* yp = bits(y);
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      const int64_t e = active[a];
      auto rows = torch::empty({groups.rows(e), h}, x.options());
      groups.gather(e, xp, h, bits(rows));
      const auto out = layer.down[e].apply(silu_mul(layer.gate_up[e].apply(rows, false)), false);
      TORCH_CHECK(out.size(1) == h, "an expert's down must give hidden-size rows");
      groups.scatter(e, cbits(out), h, yp);
    }
  };
  const int64_t count = static_cast<int64_t>(active.size()), threads = at::get_num_threads();
  if (count >= 2 * threads) {   // each thread takes the next expert left (a thread a neighbour holds takes fewer)
    std::atomic<int64_t> next{0};
    at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
      for (int64_t a = next++; a < count; a = next++) run(a, a + 1);
    });
  } else {
    run(0, count);
  }
  return {moe_combine(y, routed[1]), routed[2]};
}

// One decoder layer as decode_layers runs it: the reference's matrices (Matrix), norms
// and, for a routing layer, its MoeLayer (else its plain MLP's gate_up and down).
struct DecoderLayer {
  Matrix qkv, o;
  c10::optional<torch::Tensor> qkv_bias, q_norm, k_norm, o_bias;
  torch::Tensor post_norm, next_norm;
  c10::optional<Matrix> gate_up, down;
  c10::optional<MoeLayer> moe;
  DecoderLayer(Matrix qkv, c10::optional<torch::Tensor> qkv_bias, c10::optional<torch::Tensor> q_norm,
               c10::optional<torch::Tensor> k_norm, Matrix o, c10::optional<torch::Tensor> o_bias,
               torch::Tensor post_norm, c10::optional<Matrix> gate_up, c10::optional<Matrix> down,
               c10::optional<MoeLayer> moe, torch::Tensor next_norm)
      : qkv(std::move(qkv)), o(std::move(o)), qkv_bias(std::move(qkv_bias)), q_norm(std::move(q_norm)),
        k_norm(std::move(k_norm)), o_bias(std::move(o_bias)), post_norm(std::move(post_norm)),
        next_norm(std::move(next_norm)), gate_up(std::move(gate_up)), down(std::move(down)), moe(std::move(moe)) {
    TORCH_CHECK(this->q_norm.has_value() == this->k_norm.has_value(), "a q norm and a k norm, or neither");
    TORCH_CHECK(this->moe.has_value() != (this->gate_up.has_value() && this->down.has_value()) &&
                    this->gate_up.has_value() == this->down.has_value(),
                "a routing layer (moe), or a plain MLP's gate_up and down");
  }
};

// Every decoder layer of a reference pass in one call (LlamaModel.forward's loop): the
// same functions in the same order as the per-op path calls them from Python, so the
// same bits, without a Python call per op (about ten a layer); `::` keeps torch's own
// functions of these names out (argument-dependent lookup). Each row attends its own
// keys (tables, lens), as the reference's attention does for prefill rows too. h: the
// residual stream; x: the first layer's normed input; k_cache, v_cache: [layers, blocks,
// block_size, Hkv, D]. Returns (the final normed hidden states, each row's smallest
// router margin over the routing layers: +inf where there are none).
std::vector<torch::Tensor> decode_layers(torch::Tensor h, torch::Tensor x, const std::vector<DecoderLayer>& layers,
                                         torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                         torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables,
                                         torch::Tensor lens, int64_t hq, double eps, double scale) {
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() &&
                  k_cache.size(0) == static_cast<int64_t>(layers.size()),
              "the KV cache must be [layers, blocks, block_size, Hkv, D], a layer each");
  const int64_t rows = x.size(0), hkv = k_cache.size(3), d = k_cache.size(4);
  auto margins = torch::full({rows}, std::numeric_limits<float>::infinity(), torch::kFloat);
  for (size_t l = 0; l < layers.size(); ++l) {
    const DecoderLayer& L = layers[l];
    const auto kc = k_cache[l], vc = v_cache[l];
    auto qkv = L.qkv.apply(x, false);
    if (L.qkv_bias) qkv = ::add(qkv, *L.qkv_bias);
    if (L.q_norm) {   // each span of a norm's width (a head, or OLMoE's whole projection), as rows
      const int64_t qn = L.q_norm->size(0), kn = L.k_norm->size(0);
      const auto q = qkv.narrow(1, 0, hq * d), k = qkv.narrow(1, hq * d, hkv * d), v = qkv.narrow(1, (hq + hkv) * d, hkv * d);
      qkv = torch::cat({::rms_norm(q.reshape({-1, qn}), *L.q_norm, eps).view(q.sizes()),
                        ::rms_norm(k.reshape({-1, kn}), *L.k_norm, eps).view(k.sizes()), v}, -1);
    }
    const auto q = ::rope_store(qkv, cos, sin, kc, vc, slots, hq);
    auto o = L.o.apply(::decode_attention(q, kc, vc, tables, lens, scale, false).reshape({rows, hq * d}), false);
    if (L.o_bias) o = ::add(o, *L.o_bias);
    auto hx = ::add_rms_norm(h, o, L.post_norm, eps);
    torch::Tensor mlp;
    if (L.moe) {
      auto out = ::moe_layer(hx[1], *L.moe);
      margins = torch::minimum(margins, out[1]);
      mlp = out[0];
    } else {
      mlp = L.down->apply(::silu_mul(L.gate_up->apply(hx[1], false)), false);
    }
    hx = ::add_rms_norm(hx[0], mlp, L.next_norm, eps);
    h = hx[0];
    x = hx[1];
  }
  return {x, margins};
}

// The spec's functions one at a time, for the tests against the oracle.
torch::Tensor map_f32(torch::Tensor x, int64_t which) {
  check_f32(x, "x");
  Flush flush;
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t i = 0; i < x.numel(); ++i) op[i] = which == 0 ? spec_exp(xp[i]) : spec_log(xp[i]);
  return out;
}

torch::Tensor dot_rows(torch::Tensor a, torch::Tensor b) {
  check_bf16(a, "a");
  check_bf16(b, "b");
  TORCH_CHECK(a.dim() == 2 && a.sizes() == b.sizes(), "a, b: [rows, K]");
  a = a.contiguous();
  b = b.contiguous();
  Flush flush;
  auto out = torch::empty({a.size(0)}, torch::kFloat);
  for (int64_t r = 0; r < a.size(0); ++r)
    out.data_ptr<float>()[r] = dot(cbits(a) + r * a.size(1), cbits(b) + r * a.size(1), a.size(1));
  return out;
}

torch::Tensor sum_f32(torch::Tensor x) {
  check_f32(x, "x");
  Flush flush;
  return torch::full({}, sum(x.data_ptr<float>(), x.numel()), torch::kFloat);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.attr("isa") = GATEENG_REF_ISA;
  m.def("pack", &pack, "a bf16 [N, K] weight in linear's layout");
  m.def("linear", &linear, "x @ w.T on a packed weight, bf16 or float32 out (per: a quantized weight's layout)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
  m.def("qpack", &qpack, "a GGUF Q8_0, Q4_0, Q4_1, Q4_K, Q5_K or Q6_K weight's rows (uint8 [N, row bytes], GGML type id) in qlinear's "
        "layout, lanes of `per` blocks (0: ceil(blocks / 16))", py::arg("raw"), py::arg("ggml"), py::arg("per") = 0);
  m.def("qunpack", &qunpack, "the GGUF rows of a quantized packed weight of n rows (qpack's inverse)",
        py::arg("packed"), py::arg("n"), py::arg("per") = 0);
  m.def("qtype", &qtype, "the GGML type id of a quantized packed weight");
  m.def("qblock", &qblock, "the values per GGUF block of a quantized packed weight (32, or a K-quant's 256)");
  m.def("qlinear", &qlinear, "x @ w.T on a quantized packed weight, bf16 or float32 out (portable: the spec's plain loops)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("portable") = false, py::arg("per") = 0);
  m.def("qrows", &qrows, "the bf16 values of rows of a quantized packed weight", py::arg("packed"), py::arg("ids"),
        py::arg("per") = 0);
  m.def("linear_partial", &linear_partial, "a tensor-parallel rank's subtree sums of x @ w.T on its slice of K",
        py::call_guard<py::gil_scoped_release>());
  m.def("combine_partials", &combine_partials, "the ranks' subtree sums combined by the tree, bf16 or float32 out");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim");
  m.def("add_rms_norm", &add_rms_norm, "(h + add, RMSNorm(h + add))");
  m.def("add", &add, "bf16(a + b), b broadcast over rows when 1-D");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up]");
  m.def("rope_store", &rope_store, "RoPE on q and k heads; k and v stored at their cache slots; returns q");
  m.def("decode_attention", &decode_attention, "one-query-per-row attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>(), py::arg("q"),
        py::arg("k_cache"), py::arg("v_cache"), py::arg("tables"), py::arg("lens"), py::arg("scale"),
        py::arg("portable") = false);
  m.def("argmax_margin", &argmax_margin, "(lowest argmax id, top-1 minus top-2) per row");
  m.def("sample_scores", &sample_scores, "z / T with top-k and top-p applied (-inf: dropped)");
  m.def("gumbel", &gumbel, "Gumbel noise of one row from its 32-bit key");
  m.def("add_f32", &add_f32, "a + b in float32");
  m.def("log_softmax", &log_softmax, "log_softmax of one row");
  m.def("moe_route", &moe_route, "(ids, weights, margins) of each row's k experts from its router logits",
        py::arg("logits"), py::arg("k"), py::arg("softmax_first"), py::arg("renorm"));
  m.def("moe_combine", &moe_combine, "each row's experts' outputs weighted and summed in order, bf16");
  py::class_<Matrix>(m, "Matrix", "a packed weight as linear multiplies it: its parts, output sizes and lanes")
      .def(py::init<std::vector<torch::Tensor>, std::vector<int64_t>, std::vector<int64_t>>(), py::arg("parts"),
           py::arg("n"), py::arg("per"));
  py::class_<MoeLayer>(m, "MoeLayer", "a routing layer's router, experts and rule, for moe_layer")
      .def(py::init<Matrix, std::vector<Matrix>, std::vector<Matrix>, int64_t, bool, bool>(), py::arg("router"),
           py::arg("gate_up"), py::arg("down"), py::arg("k"), py::arg("softmax_first"), py::arg("renorm"));
  py::class_<DecoderLayer>(m, "DecoderLayer", "one decoder layer's matrices, biases, norms and MLP, for decode_layers")
      .def(py::init<Matrix, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>, c10::optional<torch::Tensor>,
                    Matrix, c10::optional<torch::Tensor>, torch::Tensor, c10::optional<Matrix>, c10::optional<Matrix>,
                    c10::optional<MoeLayer>, torch::Tensor>(),
           py::arg("qkv"), py::arg("qkv_bias"), py::arg("q_norm"), py::arg("k_norm"), py::arg("o"), py::arg("o_bias"),
           py::arg("post_norm"), py::arg("gate_up"), py::arg("down"), py::arg("moe"), py::arg("next_norm"));
  m.def("decode_layers", &decode_layers, "(final normed hidden, router margins): every decoder layer in one call",
        py::call_guard<py::gil_scoped_release>(), py::arg("h"), py::arg("x"), py::arg("layers"), py::arg("cos"),
        py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("slots"), py::arg("tables"), py::arg("lens"),
        py::arg("hq"), py::arg("eps"), py::arg("scale"));
  m.def("moe_layer", &moe_layer, "(output, router margins): a routing layer routed and run, the reference's way",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("layer"));
  m.def("map_f32", &map_f32, "the spec's exp (0) or log (1), elementwise");
  m.def("dot_rows", &dot_rows, "the spec's dot of a[r] and b[r] per row");
  m.def("sum_f32", &sum_f32, "the spec's sum of all elements");
}
