// CPU kernels for both plans (gateeng/plans/cpu_ops.py builds and loads them).
//
// At decode shapes a torch op costs more in dispatch and in copies than in
// arithmetic: RMSNorm is seven ops, RoPE and the KV store a dozen, and attention
// over a paged cache needs each sequence's whole context gathered into a new
// tensor per layer per step. Here attention reads the KV blocks where they are.
//
// The invariant plan's promise rests on these. Invariant: one row's output (for
// attention, one row and KV head; for the matmul, one row and output column) is
// computed start to finish by one thread, in a fixed order, from that row's inputs
// only (its query, its block table and key count, the KV cache; the weights).
// Nothing depends on how many rows a call has, on which thread takes a row, or on
// the other rows' values. Keep it so: no split of one row's reduction across
// threads, no loop bound or branch that depends on the call's row count.
//
// Arithmetic in float32; inputs and outputs in the model dtype (float32 or bf16).
// Built with -ffast-math (vectorized exp and reductions): every value stays finite.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "expert_groups.h"
#include "packed_checks.h"
#include <omp.h>
#include <pybind11/functional.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

using u16 = uint16_t;

// Conversions written as bit operations, which the compiler vectorizes (the
// c10::BFloat16 ones check for NaN and do not). Values are finite (see above).
inline float f32(float v) { return v; }
inline float f32(at::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T to(float v);
template <>
inline float to<float>(float v) { return v; }
template <>
inline at::BFloat16 to<at::BFloat16>(float v) {   // round to nearest even, as torch does
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  return at::BFloat16(static_cast<uint16_t>(bits >> 16), at::BFloat16::from_bits());
}

// out[r] = w * bf(x[r] / rms(x[r])): the Llama/HF RMSNorm, with the normalized row
// rounded to the model dtype before the weight multiplies it (as transformers does).
template <typename T>
inline void rms_norm_row(const T* xr, const T* w, T* yr, int64_t h, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < h; ++i) {
    float v = f32(xr[i]);
    ss += v * v;
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(h) + eps);
  for (int64_t i = 0; i < h; ++i) {
    T normed = to<T>(f32(xr[i]) * inv);
    yr[i] = to<T>(f32(w[i]) * f32(normed));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) rms_norm_row(x + r * h, w, out + r * h, h, eps);
  });
}

// h_out[r] = dt(h[r] + add[r]) and x_out[r] = rms_norm(h_out[r]): the residual add and
// the next RMSNorm in one pass (dt: rounded to the model dtype, as the torch add is).
template <typename T>
void add_rms_norm_rows(const T* h, const T* add, const T* w, T* h_out, T* x_out, int64_t rows, int64_t n,
                       float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* hr = h + r * n;
      const T* ar = add + r * n;
      T* ho = h_out + r * n;
      for (int64_t i = 0; i < n; ++i) ho[i] = to<T>(f32(hr[i]) + f32(ar[i]));
      rms_norm_row(ho, w, x_out + r * n, n, eps);
    }
  });
}

// out[r] = dt(dt(silu(gate[r])) * up[r]), gate_up[r] = [gate | up] (each n wide): the
// two torch ops (silu, then the product, each rounded to the model dtype) in one pass.
// A row is one loop over its n elements, so which elements take the vector body and
// which the tail depends on n alone, never on the call's row count.
template <typename T>
void silu_mul_rows(const T* gate_up, T* out, int64_t rows, int64_t n) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gate_up + r * 2 * n;
      const T* u = g + n;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const float x = f32(g[i]);
        const float e = std::exp(std::min(-x, 80.f));   // finite (see the header)
        o[i] = to<T>(f32(to<T>(x / (1.f + e))) * f32(u[i]));
      }
    }
  });
}

// Rotary embedding (rotate-half) of a row's query and key heads, its key and value
// stored at its cache slot: qkv[r] = [q heads | k heads | v heads], each head d wide;
// cos, sin: [rows, d] for the rows' positions. A rotated value is
// dt(dt(x * cos) + dt(rot(x) * sin)), the torch ops' roundings. Slot -1 (a padding
// row) stores nothing.
template <typename T>
void rope_store_rows(const T* qkv, const T* cos, const T* sin, const int64_t* slots, T* q_out, T* k_cache,
                     T* v_cache, int64_t rows, int64_t hq, int64_t hkv, int64_t d) {
  const int64_t half = d / 2, width = (hq + 2 * hkv) * d;
  auto rotate = [&](const T* x, const T* c, const T* s, T* y) {
    for (int64_t i = 0; i < d; ++i) {
      const float rot = i < half ? -f32(x[i + half]) : f32(x[i - half]);
      y[i] = to<T>(f32(to<T>(f32(x[i]) * f32(c[i]))) + f32(to<T>(rot * f32(s[i]))));
    }
  };
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* row = qkv + r * width;
      const T* c = cos + r * d;
      const T* s = sin + r * d;
      for (int64_t h = 0; h < hq; ++h) rotate(row + h * d, c, s, q_out + (r * hq + h) * d);
      if (slots[r] < 0) continue;
      T* kd = k_cache + slots[r] * hkv * d;
      for (int64_t h = 0; h < hkv; ++h) rotate(row + (hq + h) * d, c, s, kd + h * d);
      std::memcpy(v_cache + slots[r] * hkv * d, row + (hq + hkv) * d, hkv * d * sizeof(T));
    }
  });
}

// One block of an online softmax: s[0..n) (scores) become exp(s - max), the running
// max m and sum l take them in; returns the factor the accumulated values scale by
// (0 on the first block, where m = lowest).
inline float softmax_block(float* s, int64_t n, float& m, float& l) {
  float mx = m;
  for (int64_t t = 0; t < n; ++t) mx = std::max(mx, s[t]);
  const float rescale = std::exp(m - mx);
#pragma omp simd
  for (int64_t t = 0; t < n; ++t) s[t] = std::exp(s[t] - mx);
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += s[t];
  m = mx;
  l = l * rescale + sum;
  return rescale;
}

// One query row per sequence (a decode step). q: [B, Hq, D]; k, v: [blocks,
// block_size, Hkv, D] (contiguous); tables: [B, W] block ids; lens: [B] keys each
// row attends (its position + 1). Query heads h*G .. h*G+G-1 share KV head h. Keys
// are visited block by block with an online softmax, so nothing is gathered.
// DC: the head dim as a compile-time constant (64, 128), or 0 for any.
template <typename T, int64_t DC>
void decode_attention_rows(const T* q, const T* k, const T* v, const int64_t* tables, const int64_t* lens,
                           T* out, int64_t batch, int64_t hq, int64_t hkv, int64_t d_any, int64_t block_size,
                           int64_t width, float scale) {
  const int64_t d = DC ? DC : d_any;
  const int64_t g = hq / hkv;
  const int64_t tok_stride = hkv * d;
  const int64_t block_stride = block_size * tok_stride;
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(g * d), acc(g * d), kf(block_size * d), vf(block_size * d), s(g * block_size);
    std::vector<float> m(g), l(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, h = item % hkv;
      const int64_t len = lens[b];
      for (int64_t j = 0; j < g; ++j) {
        const T* qr = q + (b * hq + h * g + j) * d;
        for (int64_t i = 0; i < d; ++i) qf[j * d + i] = f32(qr[i]) * scale;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      // Finite start: the build uses -ffast-math, which assumes no infinities.
      std::fill(m.begin(), m.end(), std::numeric_limits<float>::lowest());
      std::fill(l.begin(), l.end(), 0.f);
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t block = tables[b * width + start / block_size];
        const T* kb = k + block * block_stride + h * d;
        const T* vb = v + block * block_stride + h * d;
        for (int64_t t = 0; t < n; ++t) {
          for (int64_t i = 0; i < d; ++i) {
            kf[t * d + i] = f32(kb[t * tok_stride + i]);
            vf[t * d + i] = f32(vb[t * tok_stride + i]);
          }
        }
        for (int64_t j = 0; j < g; ++j) {
          const float* qj = qf.data() + j * d;
          float* sj = s.data() + j * block_size;
          for (int64_t t = 0; t < n; ++t) {
            const float* kt = kf.data() + t * d;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t i = 0; i < d; ++i) dot += qj[i] * kt[i];
            sj[t] = dot;
          }
          const float rescale = softmax_block(sj, n, m[j], l[j]);
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) aj[i] *= rescale;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sj[t];
            const float* vt = vf.data() + t * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) aj[i] += p * vt[i];
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        T* o = out + (b * hq + h * g + j) * d;
        const float inv = 1.f / l[j];
        for (int64_t i = 0; i < d; ++i) o[i] = to<T>(acc[j * d + i] * inv);
      }
    }
  });
}

// f(std::integral_constant<int, mr>) for a runtime 1 <= mr <= MAX: a tile's row count
// is a compile-time constant, so its accumulators live in registers.
template <int MAX, typename F>
inline void with_rows(int mr, F&& f) {
  if constexpr (MAX > 1) {
    if (mr < MAX) return with_rows<MAX - 1>(mr, f);
  }
  f(std::integral_constant<int, MAX>{});
}

// tile(rows, cols, r, b, wb, next) over row tiles of up to MR rows (from row r) and
// column tiles of NR blocks (from block b; the blocks past the last whole tile one at
// a time); rows and cols are integral constants. w holds the packed weights, one
// column block per `block_stride` elements; wb points at block b's, and `next` at the
// next column tile's when that tile is whole (else nullptr). Threads split the column
// tiles, and each tile runs over the whole K, so no output's chain depends on the
// tiling. A tile prefetches `next` while it computes, so the weight stream from
// memory overlaps the multiply-adds instead of stalling the first row tile (at 8
// rows that made the step's matmuls a third faster on an EPYC).
template <int MR, int NR, typename W, typename Tile>
void for_each_tile(int64_t m, int64_t blocks, const W* w, int64_t block_stride, Tile tile) {
  at::parallel_for(0, (blocks + NR - 1) / NR, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t b = t * NR;
      const W* next = b + 2 * NR <= blocks ? w + (b + NR) * block_stride : nullptr;
      for (int64_t r = 0; r < m; r += MR) {
        with_rows<MR>(static_cast<int>(std::min<int64_t>(MR, m - r)), [&](auto rows) {
          if (b + NR <= blocks) {
            tile(rows, std::integral_constant<int, NR>{}, r, b, w + b * block_stride, next);
          } else {
            for (int64_t b1 = b; b1 < blocks; ++b1) {
              tile(rows, std::integral_constant<int, 1>{}, r, b1, w + b1 * block_stride, static_cast<const W*>(nullptr));
            }
          }
        });
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define GATEENG_AVX512_BF16 1

// 16 bf16 values as 16 floats (exact: a bf16 is the top half of a float).
inline __m512 load_bf16x16(const at::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

inline __m512bh load_bf16x32(const at::BFloat16* p) {
  return (__m512bh)_mm512_loadu_si512(reinterpret_cast<const void*>(p));
}

// decode_attention_rows for bf16 where the CPU has AVX-512 BF16 dot products (D a
// multiple of 32). A score is one query row and one key row multiplied pairwise by
// VDPBF16PS (exact products, float32 sums in lanes) into 16 lanes, then the lanes
// summed in the fixed order of _mm512_reduce_add_ps, then scaled. V rows are
// converted to float once per key and shared by the G query heads. The order of
// every reduction is fixed by D and the key's position in its block, never by the
// call's row count: the same invariant as the generic loop.
template <int64_t D>
void decode_attention_bf16(const at::BFloat16* q, const at::BFloat16* k, const at::BFloat16* v,
                           const int64_t* tables, const int64_t* lens, at::BFloat16* out, int64_t batch,
                           int64_t hq, int64_t hkv, int64_t block_size, int64_t width, float scale) {
  static_assert(D % 32 == 0, "D must be a multiple of 32");
  constexpr int64_t NP = D / 32;   // 32-value bf16 vectors per head row
  constexpr int64_t NF = D / 16;   // 16-value float vectors per head row
  const int64_t g = hq / hkv;
  const int64_t tok_stride = hkv * D;
  const int64_t block_stride = block_size * tok_stride;
  at::parallel_for(0, batch * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<__m512bh> qv(g * NP);
    std::vector<__m512> acc(g * NF);
    std::vector<float> s(g * block_size), m(g), l(g);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / hkv, h = item % hkv;
      const int64_t len = lens[b];
      for (int64_t j = 0; j < g; ++j) {
        for (int64_t c = 0; c < NP; ++c) qv[j * NP + c] = load_bf16x32(q + (b * hq + h * g + j) * D + c * 32);
        for (int64_t c = 0; c < NF; ++c) acc[j * NF + c] = _mm512_setzero_ps();
        m[j] = std::numeric_limits<float>::lowest();
        l[j] = 0.f;
      }
      for (int64_t start = 0; start < len; start += block_size) {
        const int64_t n = std::min(block_size, len - start);
        const int64_t block = tables[b * width + start / block_size];
        const at::BFloat16* kb = k + block * block_stride + h * D;
        const at::BFloat16* vb = v + block * block_stride + h * D;
        for (int64_t t = 0; t < n; ++t) {
          __m512bh kt[NP];
          for (int64_t c = 0; c < NP; ++c) kt[c] = load_bf16x32(kb + t * tok_stride + c * 32);
          for (int64_t j = 0; j < g; ++j) {
            __m512 dot = _mm512_setzero_ps();
            for (int64_t c = 0; c < NP; ++c) dot = _mm512_dpbf16_ps(dot, qv[j * NP + c], kt[c]);
            s[j * block_size + t] = _mm512_reduce_add_ps(dot) * scale;
          }
        }
        for (int64_t j = 0; j < g; ++j) {
          const __m512 r = _mm512_set1_ps(softmax_block(s.data() + j * block_size, n, m[j], l[j]));
          for (int64_t c = 0; c < NF; ++c) acc[j * NF + c] = _mm512_mul_ps(acc[j * NF + c], r);
        }
        for (int64_t t = 0; t < n; ++t) {
          __m512 vt[NF];
          for (int64_t c = 0; c < NF; ++c) vt[c] = load_bf16x16(vb + t * tok_stride + c * 16);
          for (int64_t j = 0; j < g; ++j) {
            const __m512 p = _mm512_set1_ps(s[j * block_size + t]);
            for (int64_t c = 0; c < NF; ++c) acc[j * NF + c] = _mm512_fmadd_ps(p, vt[c], acc[j * NF + c]);
          }
        }
      }
      for (int64_t j = 0; j < g; ++j) {
        at::BFloat16* o = out + (b * hq + h * g + j) * D;
        const __m512 inv = _mm512_set1_ps(1.f / l[j]);
        alignas(64) float row[D];
        for (int64_t c = 0; c < NF; ++c) _mm512_store_ps(row + c * 16, _mm512_mul_ps(acc[j * NF + c], inv));
        for (int64_t i = 0; i < D; ++i) o[i] = to<at::BFloat16>(row[i]);
      }
    }
  });
}

// x @ w.T for bf16, on weights packed once into VDPBF16PS's operand layout:
// [ceil(N/16)][K/2][16][2], i.e. per block of 16 output columns and per pair of inputs
// k, 2k+1, the 16 columns' two weights side by side (zero columns pad the last block).
// That is the reference's layout: its `pack` (kernels/ref_ops.cpp) makes the one
// packed copy that both plans multiply. One instruction multiplies a row's input
// pair, broadcast, by 16 columns' pairs and adds both products into 16 float32 lanes.
//
// Invariant: output (m, n) is one lane's chain of VDPBF16PS over k pairs 0, 1, ...,
// K/2 - 1 in that order, from zero, then rounded to bf16 (nearest even). Nothing in it
// depends on the row count M, on the row's place among the rows, or on which thread
// takes which columns: the kernel is row-invariant at any M, with no padding rows.
// Rows go 8 at a time (MR <= 8 accumulators per column block, 2 column blocks per
// pass: 16 of the 32 vector registers), each pass over the whole K.

// `next`: the next column tile's weights (for_each_tile), prefetched into L2 a
// cache line per block per step, or nullptr.
template <int MR, int NR>
inline void dpbf16_tile(const u16* x, int64_t k, const u16* w, int64_t block_stride, u16* out, int64_t n,
                        int64_t col, const u16* next) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k / 2; ++p) {
    __m512bh wv[NR];
    for (int j = 0; j < NR; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(w + j * block_stride + p * 32);
    if (next != nullptr) {
      for (int j = 0; j < NR; ++j) _mm_prefetch(reinterpret_cast<const char*>(next + j * block_stride + p * 32),
                                                _MM_HINT_T1);
    }
    for (int i = 0; i < MR; ++i) {
      int32_t pair;
      std::memcpy(&pair, x + i * k + 2 * p, sizeof(pair));
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
  for (int j = 0; j < NR; ++j) {
    const int64_t c = col + j * 16, valid = std::min<int64_t>(16, n - c);
    const __mmask16 mask = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
    for (int i = 0; i < MR; ++i) {
      _mm256_mask_storeu_epi16(out + i * n + c, mask, (__m256i)_mm512_cvtneps_pbh(acc[i][j]));
    }
  }
}

torch::Tensor linear_dpbf16(torch::Tensor x, torch::Tensor packed, int64_t n) {
  gateeng::check_packed(x, packed, n);
  const int64_t m = x.size(0), k = x.size(1), blocks = packed.size(0);
  x = x.contiguous();
  auto out = torch::empty({m, n}, x.options());
  const u16* xp = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  const u16* wp = reinterpret_cast<const u16*>(packed.data_ptr<at::BFloat16>());
  u16* op = reinterpret_cast<u16*>(out.data_ptr<at::BFloat16>());
  const int64_t block_stride = k * 16;
  for_each_tile<8, 2>(m, blocks, wp, block_stride, [&](auto rows, auto cols, int64_t r, int64_t b, const u16* wb,
                                                       const u16* next) {
    dpbf16_tile<decltype(rows)::value, decltype(cols)::value>(xp + r * k, k, wb, block_stride, op + r * n, n, b * 16,
                                                              next);
  });
  return out;
}
#endif

#if defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define GATEENG_QINT8 1
// The fast plan's matmul on quantized weights (GGUF Q8_0, Q4_0, Q4_1 as stored), in
// the layout of the reference's `qpack` (kernels/ref_ops.cpp owns it: per column block,
// records of 16 columns' binary16 scales (and Q4_1's minimums) then integers pair by
// pair, in the order QLayout gives). Not the reference's arithmetic: each row's block
// of 32 inputs is quantized to int8 with its own scale (as llama.cpp does), the
// integer dot products are exact in int32 and each block's sum is scaled into a
// binary32 accumulator. Two tiles compute that: AVX-512 VNNI (VPDPBUSD for 4-bit
// weights, VPDPWSSD for 8-bit; qvnni) and AVX2 (VPMADDUBSW then VPMADDWD for 4-bit,
// VPMADDWD for 8-bit; qavx2), the same float steps in the same order, so the same
// bits. A row's output depends on that row only (row-invariant), not on the
// reference's bits.
namespace qint8 {

using gateeng::QK;
constexpr int64_t REC_Q8_0 = 32 + 512, REC_Q4_0 = 32 + 256, REC_Q4_1 = 64 + 256;

// One row's inputs by block: int8 values, their scale, the sum of the int8s, the sum of x.
void quantize_rows(const u16* x, int64_t m, int64_t k, int8_t* q, float* d, int32_t* qsum, float* xsum) {
  const int64_t nb = k / QK;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t g = 0; g < nb; ++g) {
      float v[QK], amax = 0.f, sum = 0.f;
      for (int j = 0; j < QK; ++j) {
        v[j] = c10::bit_cast<float>(static_cast<uint32_t>(x[i * k + g * QK + j]) << 16);
        amax = std::max(amax, std::fabs(v[j]));
        sum += v[j];
      }
      const float inv = amax > 0.f ? 127.f / amax : 0.f;
      int32_t s = 0;
      for (int j = 0; j < QK; ++j) {
        const int8_t iq = static_cast<int8_t>(std::nearbyint(v[j] * inv));
        q[i * k + g * QK + j] = iq;
        s += iq;
      }
      d[i * nb + g] = amax / 127.f;
      qsum[i * nb + g] = s;
      xsum[i * nb + g] = sum;
    }
  }
}

// The reference's QLayout: step s holds block l * per + s of each lane l that has one
// (base: its first record, live: how many); per is the whole K's where this is a
// tensor-parallel rank's slice of it.
inline void layout_steps(int64_t nb, int64_t whole_per, std::vector<int64_t>& base, std::vector<int64_t>& live) {
  const int64_t per = whole_per > 0 ? whole_per : (nb + 15) / 16;
  TORCH_CHECK(whole_per >= 0 && nb <= 16 * per, "packed weight does not match per");
  base.assign(per, 0);
  live.assign(per, 0);
  for (int64_t s = 0, at = 0; s < per; ++s) {
    int64_t lanes = 0;
    while (lanes < 16 && lanes * per + s < nb) ++lanes;
    base[s] = at;
    live[s] = lanes;
    at += lanes;
  }
}

// A tile's MR rows x 16 columns (two 8-lane halves) stored, binary32 or rounded to bf16.
template <int MR>
inline void store_rows(const __m256 (&acc)[MR][2], void* out, bool f32, int64_t n, int64_t row, int64_t col) {
  for (int h = 0; h < 2; ++h) {
    const int64_t c = col + 8 * h, valid = std::min<int64_t>(8, n - c);
    for (int i = 0; i < MR && valid > 0; ++i) {
      alignas(32) float v[8];
      _mm256_store_ps(v, acc[i][h]);
      for (int64_t j = 0; j < valid; ++j) {
        if (f32) static_cast<float*>(out)[(row + i) * n + c + j] = v[j];
        else static_cast<at::BFloat16*>(out)[(row + i) * n + c + j] = to<at::BFloat16>(v[j]);
      }
    }
  }
}

// Each record of a column block's weights in the layout's order, as f(block g, record),
// the next column block's same record prefetched into L2.
template <typename F>
inline void for_each_record(int64_t rec_bytes, const std::vector<int64_t>& base, const std::vector<int64_t>& live,
                            const uint8_t* w, const uint8_t* next, F&& f) {
  const int64_t per = static_cast<int64_t>(base.size());
  for (int64_t s = 0; s < per; ++s) {
    for (int64_t l = 0; l < live[s]; ++l) {
      const int64_t at = (base[s] + l) * rec_bytes;
      if (next != nullptr) {
        for (int64_t off = 0; off < rec_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(next + at + off), _MM_HINT_T1);
      }
      f(l * per + s, w + at);
    }
  }
}

// Every tile of x @ w.T over the column blocks (cbs of them, split across threads) and
// the rows in fours: f(column block b, first row r, rows, its records, the next block's
// records to prefetch or nullptr).
template <typename F>
inline void for_each_tile(int64_t cbs, int64_t m, const uint8_t* w, int64_t stride, F&& f) {
  at::parallel_for(0, cbs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      const uint8_t* next = b + 1 < end ? w + (b + 1) * stride : nullptr;
      for (int64_t r = 0; r < m; r += 4) f(b, r, std::min<int64_t>(4, m - r), w + b * stride, next);
    }
  });
}

// A tile: 16 columns (one column block) of MR rows, over the whole K.
using TileFn = void (*)(int64_t rec_bytes, int64_t nb, const std::vector<int64_t>& base,
                        const std::vector<int64_t>& live, const uint8_t* w, const uint8_t* next, const int8_t* xq,
                        const int32_t* xpairs, const float* xd, const int32_t* xqs, const float* xs, int64_t k,
                        void* out, bool f32, int64_t n, int64_t row, int64_t col);

// x @ w.T on a quantized packed weight, `tiles[MR - 1]` computing MR = 1..4 rows: the
// inputs' int8 blocks, the layout's steps and the column blocks across threads, which
// both tiles share.
torch::Tensor qlinear_on(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t whole_per,
                         const TileFn (&tiles)[4]) {
  gateeng::check_qpacked(x, packed, n);
  TORCH_CHECK(packed.size(2) == REC_Q8_0 || packed.size(2) == REC_Q4_0 || packed.size(2) == REC_Q4_1,
              "packed must come from the reference's qpack (a Q8_0, Q4_0 or Q4_1 record)");
  const int64_t m = x.size(0), k = x.size(1), nb = packed.size(1), cbs = packed.size(0), rec = packed.size(2);
  x = x.contiguous();
  auto out = torch::empty({m, n}, x.options().dtype(f32 ? torch::kFloat : torch::kBFloat16));
  if (m == 0 || n == 0) return out;
  std::vector<int64_t> base, live;
  layout_steps(nb, whole_per, base, live);
  std::vector<int8_t> xq(m * k);
  std::vector<float> xd(m * nb), xs(m * nb);
  std::vector<int32_t> xqs(m * nb);
  quantize_rows(reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>()), m, k, xq.data(), xd.data(), xqs.data(),
                xs.data());
  std::vector<int32_t> xpairs(rec == REC_Q8_0 ? m * k / 2 : 0);   // VPDPWSSD's operand: two int16 inputs per dword
  for (size_t j = 0; j < xpairs.size(); ++j)
    xpairs[j] = static_cast<int32_t>(static_cast<uint16_t>(static_cast<int16_t>(xq[2 * j]))) |
                static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(static_cast<int16_t>(xq[2 * j + 1]))) << 16);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  void* op = f32 ? static_cast<void*>(out.data_ptr<float>()) : static_cast<void*>(out.data_ptr<at::BFloat16>());
  for_each_tile(cbs, m, wp, nb * rec, [&](int64_t b, int64_t r, int64_t rows, const uint8_t* w, const uint8_t* next) {
    tiles[rows - 1](rec, nb, base, live, w, next, xq.data() + r * k, xpairs.data() + (xpairs.empty() ? 0 : r * k / 2),
                    xd.data() + r * nb, xqs.data() + r * nb, xs.data() + r * nb, k, op, f32, n, r, b * 16);
  });
  return out;
}

}  // namespace qint8

namespace qavx2 {
using namespace qint8;

// The VNNI tile's steps on 8-lane vectors: each 16-column record as two halves.
template <int MR>
void tile(int64_t rec_bytes, int64_t nb, const std::vector<int64_t>& base, const std::vector<int64_t>& live,
          const uint8_t* w, const uint8_t* next, const int8_t* xq, const int32_t* xpairs, const float* xd,
          const int32_t* xqs, const float* xs, int64_t k, void* out, bool f32, int64_t n, int64_t row, int64_t col) {
  const bool q8 = rec_bytes == REC_Q8_0, mins = rec_bytes == REC_Q4_1;
  const int64_t qoff = mins ? 64 : 32;
  const __m256i nib = _mm256_set1_epi32(0x0F0F0F0F), ones = _mm256_set1_epi16(1);
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for_each_record(rec_bytes, base, live, w, next, [&](int64_t g, const uint8_t* rec) {
    __m256i dot[MR][2];
    for (int i = 0; i < MR; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    if (q8) {
      for (int p = 0; p < 16; ++p) {
        const __m128i* src = reinterpret_cast<const __m128i*>(rec + 32 + p * 32);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src)), w1 = _mm256_cvtepi8_epi16(_mm_loadu_si128(src + 1));
        for (int i = 0; i < MR; ++i) {
          const __m256i xv = _mm256_set1_epi32(xpairs[i * (k / 2) + g * QK / 2 + p]);
          dot[i][0] = _mm256_add_epi32(dot[i][0], _mm256_madd_epi16(w0, xv));
          dot[i][1] = _mm256_add_epi32(dot[i][1], _mm256_madd_epi16(w1, xv));
        }
      }
    } else {
      for (int pp = 0; pp < 8; ++pp) {
        const __m128i* src = reinterpret_cast<const __m128i*>(rec + qoff + pp * 32);
        const __m256i v0 = _mm256_cvtepu16_epi32(_mm_loadu_si128(src)), v1 = _mm256_cvtepu16_epi32(_mm_loadu_si128(src + 1));
        // per column the dword of its 4 nibbles in K order: lo(b0), lo(b1), hi(b0), hi(b1)
        const __m256i w0 = _mm256_and_si256(_mm256_or_si256(v0, _mm256_slli_epi32(v0, 12)), nib);
        const __m256i w1 = _mm256_and_si256(_mm256_or_si256(v1, _mm256_slli_epi32(v1, 12)), nib);
        for (int i = 0; i < MR; ++i) {
          int32_t four;
          std::memcpy(&four, xq + i * k + g * QK + 4 * pp, sizeof(four));
          const __m256i xv = _mm256_set1_epi32(four);   // pairs of u4 x s8 fit int16: no saturation
          dot[i][0] = _mm256_add_epi32(dot[i][0], _mm256_madd_epi16(_mm256_maddubs_epi16(w0, xv), ones));
          dot[i][1] = _mm256_add_epi32(dot[i][1], _mm256_madd_epi16(_mm256_maddubs_epi16(w1, xv), ones));
        }
      }
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec) + h));
      for (int i = 0; i < MR; ++i) {
        __m256 f = _mm256_cvtepi32_ps(dot[i][h]);
        if (!q8 && !mins) f = _mm256_sub_ps(f, _mm256_set1_ps(8.f * static_cast<float>(xqs[i * nb + g])));
        acc[i][h] = _mm256_fmadd_ps(f, _mm256_mul_ps(d, _mm256_set1_ps(xd[i * nb + g])), acc[i][h]);
        if (mins) {
          const __m256 m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 32) + h));
          acc[i][h] = _mm256_fmadd_ps(m, _mm256_set1_ps(xs[i * nb + g]), acc[i][h]);
        }
      }
    }
  });
  store_rows<MR>(acc, out, f32, n, row, col);
}

}  // namespace qavx2

torch::Tensor qlinear_avx2(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t per) {
  using namespace qavx2;
  return qint8::qlinear_on(x, packed, n, f32, per, {tile<1>, tile<2>, tile<3>, tile<4>});
}

// The K-quants (Q4_K, Q5_K, Q6_K; the reference's qpack records of a super-block of 256
// values): the same int8 inputs (quantize_rows: each row's block of 32 inputs to int8
// with its own scale). A record's 32 bytes of integers for two pairs hold all 16
// columns side by side ([16][2] bytes), so one VPMADDUBSW (stored unsigned integer x
// the broadcast int8 input pair) gives every column's pair product in its int16 lane.
// Those are summed in int16 while the exact sum fits (Q4_K: 16 values, 16 x 15 x 127;
// Q5_K: 8 values, 8 x 31 x 127; Q6_K: 8 values less its 32 bias, 8 x 32 x 127; the
// lanes wrap mod 2^16, so only the sum must fit), then VPMADDWD multiplies them by the
// sub-block scales into int32, even and odd columns apart (a scale vector zero in the
// other half of each dword). Each input block's int32 sum is scaled in binary32:
// (d * xd) * sum, Q4_K and Q5_K less (dmin * min) * (the block's sum of x). The
// accumulators hold the even columns and the odd columns; they are interleaved once,
// when stored. A row's output depends on that row only.
namespace kavx2 {
using namespace qint8;

constexpr int64_t REC_Q4_K = 2368, REC_Q5_K = 2880, REC_Q6_K = 3360;   // ref_ops.cpp's record sizes
constexpr int64_t SC_OFF_45 = 64, M_OFF_45 = 192, Q_OFF_45 = 320, HI_OFF_5 = 2368;
constexpr int64_t SC_OFF_6 = 32, Q_OFF_6 = 288, HI_OFF_6 = 2336;

// 16 columns' binary16 values at p as binary32: even columns into e, odd into o (lanes
// 0-3: columns 0, 2, 4, 6 (1, 3, 5, 7); lanes 4-7: 8 .. 14 (9 .. 15)), as VPMADDWD leaves them.
inline void halves_fp16(const uint8_t* p, __m256& e, __m256& o) {
  const __m256i split = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256 a = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), split);
  const __m256 b = _mm256_permutevar8x32_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1)), split);
  e = _mm256_permute2f128_ps(a, b, 0x20);
  o = _mm256_permute2f128_ps(a, b, 0x31);
}

// How many records ahead of the one being multiplied its lines are prefetched (into L1,
// a line or two per quad of pairs, so that the misses in flight stay few and steady).
// The hardware's stream prefetcher alone leaves a record's three interleaved streams
// (integers, top bits, scales) waiting on memory: on a 2-core AVX2 EPYC, one thread's
// Q6_K records streamed from memory ran 1.4-1.9x faster with it (Q4_K 1.05-1.2x), at
// 1 to 3 records ahead alike.
constexpr int64_t PREFETCH_RECORDS = 2;

// The 16 columns' integers of pairs 4j .. 4j + 3 (inputs 8j .. 8j + 7) as four vectors
// of unsigned byte pairs, KD bits each: the record's two 32-byte vectors of nibbles
// for them (low nibbles: pairs 4j, 4j + 2; high: 4j + 1, 4j + 3) and their top bits.
template <int KD>
inline void pair_quad(const uint8_t* rec, int j, __m256i (&a)[4]) {
  constexpr int64_t qoff = KD == 6 ? Q_OFF_6 : Q_OFF_45;
  const __m256i low = _mm256_set1_epi8(0x0F);
  const __m256i v0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + qoff + 64 * j));
  const __m256i v1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + qoff + 64 * j + 32));
  a[0] = _mm256_and_si256(v0, low);
  a[1] = _mm256_and_si256(_mm256_srli_epi16(v0, 4), low);
  a[2] = _mm256_and_si256(v1, low);
  a[3] = _mm256_and_si256(_mm256_srli_epi16(v1, 4), low);
  if constexpr (KD == 5) {   // the fifth bits: pair p's u32 mask, bit 2c + e (byte 2c + e's)
    const __m256i spread = _mm256_setr_epi64x(0, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303);
    const __m256i bit = _mm256_set1_epi64x(static_cast<int64_t>(0x8040201008040201ull));
    const __m256i fifth = _mm256_set1_epi8(0x10);
    for (int t = 0; t < 4; ++t) {
      uint32_t m;
      std::memcpy(&m, rec + HI_OFF_5 + 4 * (4 * j + t), 4);
      const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(m)), spread), bit);
      a[t] = _mm256_or_si256(a[t], _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), fifth));
    }
  } else if constexpr (KD == 6) {   // the top two bits: pair 4j + t at bits 2t of [j][16][2]
    const __m256i top = _mm256_set1_epi8(0x30);
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + HI_OFF_6 + 32 * j));
    a[0] = _mm256_or_si256(a[0], _mm256_and_si256(_mm256_slli_epi16(h, 4), top));
    a[1] = _mm256_or_si256(a[1], _mm256_and_si256(_mm256_slli_epi16(h, 2), top));
    a[2] = _mm256_or_si256(a[2], _mm256_and_si256(h, top));
    a[3] = _mm256_or_si256(a[3], _mm256_and_si256(_mm256_srli_epi16(h, 2), top));
  }
}

// One input block of 32's binary32 step, the same in both K-quant kernels (so, from
// the same integers, the same bits): per column, acc += float(isum) * (d * the
// block's input scale), then for Q4_K and Q5_K acc -= mins * (the block's sum of x).
// The two 8-lane halves hold whichever columns the kernel keeps there, d and mins alike.
template <int MR, int KD>
inline void block_step(__m256 (&acc)[MR][2], const __m256i (&isum)[MR][2], const __m256 (&d)[2],
                       const __m256 (&mins)[2], const float* xd, const float* xs, int64_t k32, int64_t at32) {
  for (int i = 0; i < MR; ++i) {
    const __m256 scale = _mm256_set1_ps(xd[i * k32 + at32]);
    for (int h = 0; h < 2; ++h) {
      acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[i][h]), _mm256_mul_ps(d[h], scale), acc[i][h]);
      if constexpr (KD != 6) acc[i][h] = _mm256_fnmadd_ps(mins[h], _mm256_set1_ps(xs[i * k32 + at32]), acc[i][h]);
    }
  }
}

// KD: 4, 5 or 6 (Q4_K, Q5_K, Q6_K). xpair: each input pair's int8s twice in a dword
// (the broadcast operand); xbias: Q6_K's 32 x (the sum of 8 inputs) twice as int16;
// xd, xs: each block of 32 inputs' scale and sum of x.
template <int MR, int KD>
void tile(int64_t rec_bytes, const std::vector<int64_t>& base, const std::vector<int64_t>& live, const uint8_t* w,
          const int32_t* xpair, const int32_t* xbias, const float* xd, const float* xs, int64_t k,
          void* out, bool f32, int64_t n, int64_t row, int64_t col) {
  constexpr int SUBS = KD == 6 ? 16 : 8, SUB_J = 32 / SUBS;   // sub-blocks; the quads (8 inputs) in each
  constexpr int RUN_J = KD == 4 ? 2 : 1;                       // quads summed in int16
  constexpr int64_t sc_off = KD == 6 ? SC_OFF_6 : SC_OFF_45;
  constexpr int LINES = static_cast<int>(((KD == 4 ? REC_Q4_K : KD == 5 ? REC_Q5_K : REC_Q6_K) + 63) / 64);
  const int64_t k2 = k / 2, k8 = k / 8, k32 = k / 32;
  const int64_t ahead = PREFETCH_RECORDS * rec_bytes;
  const __m256i even = _mm256_set1_epi32(0xFFFF);
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for_each_record(rec_bytes, base, live, w, nullptr, [&](int64_t g, const uint8_t* rec) {
    __m256 d[2], dm[2];
    halves_fp16(rec, d[0], d[1]);
    if constexpr (KD != 6) halves_fp16(rec + 32, dm[0], dm[1]);
    const int32_t* xg = xpair + g * 128;
    const int32_t* bg = KD == 6 ? xbias + g * 32 : nullptr;
    for (int xb = 0; xb < 8; ++xb) {   // the inputs' blocks of 32
      __m256i isum[MR][2];
      for (int i = 0; i < MR; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
      for (int sb = xb * SUBS / 8; sb < (xb + 1) * SUBS / 8; ++sb) {
        const __m128i s8 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + sc_off + sb * 16));
        const __m256i sc = KD == 6 ? _mm256_cvtepi8_epi16(s8) : _mm256_cvtepu8_epi16(s8);
        const __m256i sc_e = _mm256_and_si256(sc, even), sc_o = _mm256_andnot_si256(even, sc);
        for (int j0 = sb * SUB_J; j0 < (sb + 1) * SUB_J; j0 += RUN_J) {
          __m256i p[MR];
          for (int i = 0; i < MR; ++i) p[i] = _mm256_setzero_si256();
          for (int j = j0; j < j0 + RUN_J; ++j) {
            for (int l = 2 * j; l < 2 * j + 2 && l < LINES; ++l)
              _mm_prefetch(reinterpret_cast<const char*>(rec + ahead + 64 * l), _MM_HINT_T0);
            __m256i a[4];
            pair_quad<KD>(rec, j, a);
            for (int i = 0; i < MR; ++i) {
              const int32_t* xp = xg + i * k2 + 4 * j;
              const __m256i p01 = _mm256_add_epi16(_mm256_maddubs_epi16(a[0], _mm256_set1_epi32(xp[0])),
                                                   _mm256_maddubs_epi16(a[1], _mm256_set1_epi32(xp[1])));
              const __m256i p23 = _mm256_add_epi16(_mm256_maddubs_epi16(a[2], _mm256_set1_epi32(xp[2])),
                                                   _mm256_maddubs_epi16(a[3], _mm256_set1_epi32(xp[3])));
              p[i] = _mm256_add_epi16(p[i], _mm256_add_epi16(p01, p23));
              if constexpr (KD == 6) p[i] = _mm256_sub_epi16(p[i], _mm256_set1_epi32(bg[i * k8 + j]));
            }
          }
          for (int i = 0; i < MR; ++i) {
            isum[i][0] = _mm256_add_epi32(isum[i][0], _mm256_madd_epi16(p[i], sc_e));
            isum[i][1] = _mm256_add_epi32(isum[i][1], _mm256_madd_epi16(p[i], sc_o));
          }
        }
      }
      __m256 mins[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};   // Q6_K: none
      if constexpr (KD != 6) {   // sub-block xb's minimums
        const __m256i m = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + M_OFF_45 + xb * 16)));
        mins[0] = _mm256_mul_ps(dm[0], _mm256_cvtepi32_ps(_mm256_and_si256(m, even)));
        mins[1] = _mm256_mul_ps(dm[1], _mm256_cvtepi32_ps(_mm256_srli_epi32(m, 16)));
      }
      block_step<MR, KD>(acc, isum, d, mins, xd, xs, k32, g * 8 + xb);
    }
  });
  __m256 cols[MR][2];   // columns 0-7, 8-15
  for (int i = 0; i < MR; ++i) {
    const __m256 lo = _mm256_unpacklo_ps(acc[i][0], acc[i][1]), hi = _mm256_unpackhi_ps(acc[i][0], acc[i][1]);
    cols[i][0] = _mm256_permute2f128_ps(lo, hi, 0x20);
    cols[i][1] = _mm256_permute2f128_ps(lo, hi, 0x31);
  }
  store_rows<MR>(cols, out, f32, n, row, col);
}

}  // namespace kavx2

namespace kavx2 {

// What both K-quant kernels start from: the record's bits (4, 5 or 6: Q4_K, Q5_K, Q6_K),
// the output, the layout's steps and each row's inputs by block of 32 (quantize_rows).
struct KCall {
  int kd = 0;
  int64_t m = 0, k = 0, rec = 0, cbs = 0;
  torch::Tensor out;
  std::vector<int64_t> base, live;
  std::vector<int8_t> xq;
  std::vector<float> xd, xs;
  std::vector<int32_t> xqs;
  bool empty() const { return xq.empty(); }
};

KCall k_call(torch::Tensor x, const torch::Tensor& packed, int64_t n, bool f32, int64_t whole_per) {
  gateeng::check_qpacked(x, packed, n, 256);
  KCall c;
  c.rec = packed.size(2);
  TORCH_CHECK(c.rec == REC_Q4_K || c.rec == REC_Q5_K || c.rec == REC_Q6_K,
              "packed must come from the reference's qpack (a Q4_K, Q5_K or Q6_K record)");
  c.kd = c.rec == REC_Q4_K ? 4 : c.rec == REC_Q5_K ? 5 : 6;
  c.m = x.size(0), c.k = x.size(1), c.cbs = packed.size(0);
  x = x.contiguous();
  c.out = torch::empty({c.m, n}, x.options().dtype(f32 ? torch::kFloat : torch::kBFloat16));
  if (c.m == 0 || n == 0) return c;
  layout_steps(packed.size(1), whole_per, c.base, c.live);
  c.xq.resize(c.m * c.k);
  c.xd.resize(c.m * (c.k / 32)), c.xs.resize(c.m * (c.k / 32)), c.xqs.resize(c.m * (c.k / 32));
  quantize_rows(reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>()), c.m, c.k, c.xq.data(), c.xd.data(),
                c.xqs.data(), c.xs.data());
  return c;
}

// Every tile of the call: tiles[MR - 1](its first row r, rows, the column block's records, b * 16).
template <typename Tiles>
void k_tiles(const KCall& c, const torch::Tensor& packed, Tiles&& tile) {
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  qint8::for_each_tile(c.cbs, c.m, wp, packed.size(1) * c.rec,
                       [&](int64_t b, int64_t r, int64_t rows, const uint8_t* w, const uint8_t*) {
                         tile(r, rows, w, b * 16);
                       });
}

// out's pointer, binary32 or bf16.
inline void* k_out(const KCall& c, bool f32) {
  return f32 ? static_cast<void*>(c.out.data_ptr<float>()) : static_cast<void*>(c.out.data_ptr<at::BFloat16>());
}

}  // namespace kavx2

// x @ w.T on a K-quant packed weight (the reference's qpack of Q4_K, Q5_K or Q6_K), int8 AVX2.
torch::Tensor qlinear_k_avx2(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t whole_per) {
  using namespace kavx2;
  const KCall c = k_call(x, packed, n, f32, whole_per);
  if (c.empty()) return c.out;
  const int64_t m = c.m, k = c.k;
  std::vector<int32_t> xpair(m * k / 2), xbias(c.kd == 6 ? m * k / 8 : 0);
  for (int64_t j = 0; j < m * k / 2; ++j) {
    const uint32_t two = static_cast<uint8_t>(c.xq[2 * j]) | static_cast<uint32_t>(static_cast<uint8_t>(c.xq[2 * j + 1])) << 8;
    xpair[j] = static_cast<int32_t>(two | two << 16);
  }
  for (size_t j = 0; j < xbias.size(); ++j) {
    int32_t sum = 0;
    for (int e = 0; e < 8; ++e) sum += c.xq[8 * j + e];
    const uint32_t b = static_cast<uint16_t>(static_cast<int16_t>(32 * sum));   // |32 x 8 x 127| fits int16
    xbias[j] = static_cast<int32_t>(b | b << 16);
  }
  auto pick = [&](auto rows) -> decltype(&tile<1, 4>) {
    constexpr int MR = decltype(rows)::value;
    return c.kd == 4 ? &tile<MR, 4> : c.kd == 5 ? &tile<MR, 5> : &tile<MR, 6>;
  };
  decltype(&tile<1, 4>) tiles[4] = {pick(std::integral_constant<int, 1>{}), pick(std::integral_constant<int, 2>{}),
                                    pick(std::integral_constant<int, 3>{}), pick(std::integral_constant<int, 4>{})};
  void* op = k_out(c, f32);
  k_tiles(c, packed, [&](int64_t r, int64_t rows, const uint8_t* w, int64_t col) {
    tiles[rows - 1](c.rec, c.base, c.live, w, xpair.data() + r * (k / 2), xbias.data() + (xbias.empty() ? 0 : r * (k / 8)),
                    c.xd.data() + r * (k / 32), c.xs.data() + r * (k / 32), k, op, f32, n, r, col);
  });
  return c.out;
}
#endif

#if defined(GATEENG_AVX512_BF16) && defined(__AVX512VNNI__) && defined(GATEENG_QINT8)
#define GATEENG_AVX512_VNNI 1
namespace qvnni {
using namespace qint8;

template <int MR>
void tile(int64_t rec_bytes, int64_t nb, const std::vector<int64_t>& base, const std::vector<int64_t>& live,
          const uint8_t* w, const uint8_t* next, const int8_t* xq, const int32_t* xpairs, const float* xd,
          const int32_t* xqs, const float* xs, int64_t k, void* out, bool f32, int64_t n, int64_t row, int64_t col) {
  const bool q8 = rec_bytes == REC_Q8_0, mins = rec_bytes == REC_Q4_1;
  const int64_t qoff = mins ? 64 : 32;
  const __m512i nib = _mm512_set1_epi32(0x0F0F0F0F);
  __m512 acc[MR];
  for (int i = 0; i < MR; ++i) acc[i] = _mm512_setzero_ps();
  for_each_record(rec_bytes, base, live, w, next, [&](int64_t g, const uint8_t* rec) {
    __m512i dot[MR];
    for (int i = 0; i < MR; ++i) dot[i] = _mm512_setzero_si512();
    if (q8) {
      for (int p = 0; p < 16; ++p) {
        const __m512i wv = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32 + p * 32)));
        for (int i = 0; i < MR; ++i)
          dot[i] = _mm512_dpwssd_epi32(dot[i], wv, _mm512_set1_epi32(xpairs[i * (k / 2) + g * QK / 2 + p]));
      }
    } else {
      for (int pp = 0; pp < 8; ++pp) {
        const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + qoff + pp * 32)));
        // per column the dword of its 4 nibbles in K order: lo(b0), lo(b1), hi(b0), hi(b1)
        const __m512i wv = _mm512_and_si512(_mm512_or_si512(v, _mm512_slli_epi32(v, 12)), nib);
        for (int i = 0; i < MR; ++i) {
          int32_t four;
          std::memcpy(&four, xq + i * k + g * QK + 4 * pp, sizeof(four));
          dot[i] = _mm512_dpbusd_epi32(dot[i], wv, _mm512_set1_epi32(four));
        }
      }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec)));
    for (int i = 0; i < MR; ++i) {
      __m512 f = _mm512_cvtepi32_ps(dot[i]);
      if (!q8 && !mins) f = _mm512_sub_ps(f, _mm512_set1_ps(8.f * static_cast<float>(xqs[i * nb + g])));
      acc[i] = _mm512_fmadd_ps(f, _mm512_mul_ps(d, _mm512_set1_ps(xd[i * nb + g])), acc[i]);
      if (mins) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 32)));
        acc[i] = _mm512_fmadd_ps(m, _mm512_set1_ps(xs[i * nb + g]), acc[i]);
      }
    }
  });
  const int64_t valid = std::min<int64_t>(16, n - col);
  const __mmask16 mask = valid == 16 ? 0xFFFF : static_cast<__mmask16>((1u << valid) - 1);
  for (int i = 0; i < MR; ++i) {
    if (f32) {
      _mm512_mask_storeu_ps(static_cast<float*>(out) + (row + i) * n + col, mask, acc[i]);
    } else {
      _mm256_mask_storeu_epi16(static_cast<u16*>(out) + (row + i) * n + col, mask, (__m256i)_mm512_cvtneps_pbh(acc[i]));
    }
  }
}

}  // namespace qvnni

// x @ w.T on a quantized packed weight (the reference's qpack), bf16 or binary32 out:
// the signature of the reference's linear, so decode_layers_with takes it too.
torch::Tensor qlinear_vnni(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t per) {
  using namespace qvnni;
  return qint8::qlinear_on(x, packed, n, f32, per, {tile<1>, tile<2>, tile<3>, tile<4>});
}
#endif

// The K-quants on VPDPBUSD (AVX-512 VNNI on 8-lane vectors): the same int8 inputs as
// qlinear_k_avx2 and the same integers and float steps, so the same bits. A quad of
// pairs (8 inputs) of the 16 columns, as pair_quad gives it, is interleaved by 16-bit
// words so that each dword holds 4 inputs of one column (columns 0-3 and 8-11 in one
// vector, 4-7 and 12-15 in the other), and one VPDPBUSD per vector adds those 4
// products (stored unsigned integer x int8 input) into the column's int32 sum of its
// sub-block, exactly. Each sub-block's sum (Q6_K's less 32 x its inputs' sum) times its
// scale (VPMULLD) is the integer qlinear_k_avx2 reaches through int16 runs and VPMADDWD;
// from there both take the same binary32 steps. GATEENG_KVNNI_EMULATED builds it where
// the CPU has no VNNI, each VPDPBUSD computed exactly with AVX2 (two VPMADDWD), so that
// the tile's bits can be checked against qlinear_k_avx2 on any AVX2 CPU.
#if defined(GATEENG_QINT8) && (defined(GATEENG_AVX512_VNNI) || defined(GATEENG_KVNNI_EMULATED))
#define GATEENG_KVNNI 1
namespace kvnni {
using namespace qint8;
using kavx2::M_OFF_45;
using kavx2::PREFETCH_RECORDS;
using kavx2::REC_Q4_K;
using kavx2::REC_Q5_K;
using kavx2::REC_Q6_K;
using kavx2::SC_OFF_45;
using kavx2::SC_OFF_6;

// acc + the sum of each dword's 4 products u (unsigned bytes) x s (signed bytes).
inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  const __m256i low = _mm256_set1_epi16(0x00FF);   // bytes as int16 (each product fits; VPMADDWD sums in int32)
  const __m256i ue = _mm256_and_si256(u, low), uo = _mm256_srli_epi16(u, 8);
  const __m256i se = _mm256_srai_epi16(_mm256_slli_epi16(s, 8), 8), so = _mm256_srai_epi16(s, 8);
  return _mm256_add_epi32(acc, _mm256_add_epi32(_mm256_madd_epi16(ue, se), _mm256_madd_epi16(uo, so)));
#endif
}

// 16 columns' bytes at p as int32, columns 0-3 and 8-11 into lo, 4-7 and 12-15 into hi.
template <bool SIGNED>
inline void quads_i32(const uint8_t* p, __m256i& lo, __m256i& hi) {
  const __m128i v = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)),
                                     _mm_setr_epi8(0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15));
  lo = SIGNED ? _mm256_cvtepi8_epi32(v) : _mm256_cvtepu8_epi32(v);
  hi = SIGNED ? _mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)) : _mm256_cvtepu8_epi32(_mm_srli_si128(v, 8));
}

// 16 columns' binary16 values at p as binary32, in quads_i32's order.
inline void quads_fp16(const uint8_t* p, __m256& lo, __m256& hi) {
  const __m256 a = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 b = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p) + 1));
  lo = _mm256_permute2f128_ps(a, b, 0x20);
  hi = _mm256_permute2f128_ps(a, b, 0x31);
}

// KD: 4, 5 or 6. xq: the rows' int8 inputs; xbias: Q6_K's 32 x (the sum of each 16
// inputs); xd, xs: each block of 32 inputs' scale and sum of x.
template <int MR, int KD>
void tile(int64_t rec_bytes, const std::vector<int64_t>& base, const std::vector<int64_t>& live, const uint8_t* w,
          const int8_t* xq, const int32_t* xbias, const float* xd, const float* xs, int64_t k,
          void* out, bool f32, int64_t n, int64_t row, int64_t col) {
  constexpr int SUBS = KD == 6 ? 16 : 8, SUB_J = 32 / SUBS;   // sub-blocks; the quads (8 inputs) in each
  constexpr int64_t sc_off = KD == 6 ? SC_OFF_6 : SC_OFF_45;
  constexpr int LINES = static_cast<int>(((KD == 4 ? REC_Q4_K : KD == 5 ? REC_Q5_K : REC_Q6_K) + 63) / 64);
  const int64_t k16 = k / 16, k32 = k / 32;
  const int64_t ahead = PREFETCH_RECORDS * rec_bytes;
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for_each_record(rec_bytes, base, live, w, nullptr, [&](int64_t g, const uint8_t* rec) {
    __m256 d[2], dm[2];
    quads_fp16(rec, d[0], d[1]);
    if constexpr (KD != 6) quads_fp16(rec + 32, dm[0], dm[1]);
    const int8_t* xg = xq + g * 256;
    for (int xb = 0; xb < 8; ++xb) {   // the inputs' blocks of 32
      __m256i isum[MR][2];
      for (int i = 0; i < MR; ++i) isum[i][0] = isum[i][1] = _mm256_setzero_si256();
      for (int sb = xb * SUBS / 8; sb < (xb + 1) * SUBS / 8; ++sb) {
        __m256i sum[MR][2];
        for (int i = 0; i < MR; ++i) sum[i][0] = sum[i][1] = _mm256_setzero_si256();
        for (int j = sb * SUB_J; j < (sb + 1) * SUB_J; ++j) {
          for (int l = 2 * j; l < 2 * j + 2 && l < LINES; ++l)
            _mm_prefetch(reinterpret_cast<const char*>(rec + ahead + 64 * l), _MM_HINT_T0);
          __m256i a[4];
          kavx2::pair_quad<KD>(rec, j, a);
          const __m256i lo01 = _mm256_unpacklo_epi16(a[0], a[1]), hi01 = _mm256_unpackhi_epi16(a[0], a[1]);
          const __m256i lo23 = _mm256_unpacklo_epi16(a[2], a[3]), hi23 = _mm256_unpackhi_epi16(a[2], a[3]);
          for (int i = 0; i < MR; ++i) {
            int32_t x4[2];
            std::memcpy(x4, xg + i * k + 8 * j, sizeof(x4));
            const __m256i b0 = _mm256_set1_epi32(x4[0]), b1 = _mm256_set1_epi32(x4[1]);
            sum[i][0] = dpbusd(dpbusd(sum[i][0], lo01, b0), lo23, b1);
            sum[i][1] = dpbusd(dpbusd(sum[i][1], hi01, b0), hi23, b1);
          }
        }
        __m256i sc[2];
        quads_i32<KD == 6>(rec + sc_off + sb * 16, sc[0], sc[1]);
        for (int i = 0; i < MR; ++i) {
          for (int h = 0; h < 2; ++h) {
            __m256i v = sum[i][h];
            if constexpr (KD == 6) v = _mm256_sub_epi32(v, _mm256_set1_epi32(xbias[i * k16 + g * 16 + sb]));
            isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_mullo_epi32(v, sc[h]));
          }
        }
      }
      __m256 mins[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};   // Q6_K: none
      if constexpr (KD != 6) {   // sub-block xb's minimums
        __m256i m[2];
        quads_i32<false>(rec + M_OFF_45 + xb * 16, m[0], m[1]);
        mins[0] = _mm256_mul_ps(dm[0], _mm256_cvtepi32_ps(m[0]));
        mins[1] = _mm256_mul_ps(dm[1], _mm256_cvtepi32_ps(m[1]));
      }
      kavx2::block_step<MR, KD>(acc, isum, d, mins, xd, xs, k32, g * 8 + xb);
    }
  });
  __m256 cols[MR][2];   // columns 0-7, 8-15
  for (int i = 0; i < MR; ++i) {
    cols[i][0] = _mm256_permute2f128_ps(acc[i][0], acc[i][1], 0x20);
    cols[i][1] = _mm256_permute2f128_ps(acc[i][0], acc[i][1], 0x31);
  }
  store_rows<MR>(cols, out, f32, n, row, col);
}

}  // namespace kvnni

// x @ w.T on a K-quant packed weight (the reference's qpack of Q4_K, Q5_K or Q6_K), int8
// VNNI: qlinear_k_avx2's bits.
torch::Tensor qlinear_k_vnni(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t whole_per) {
  using namespace kvnni;
  const kavx2::KCall c = kavx2::k_call(x, packed, n, f32, whole_per);
  if (c.empty()) return c.out;
  const int64_t m = c.m, k = c.k;
  std::vector<int32_t> xbias(c.kd == 6 ? m * k / 16 : 0);
  for (size_t j = 0; j < xbias.size(); ++j) {
    int32_t sum = 0;
    for (int e = 0; e < 16; ++e) sum += c.xq[16 * j + e];
    xbias[j] = 32 * sum;
  }
  auto pick = [&](auto rows) -> decltype(&tile<1, 4>) {
    constexpr int MR = decltype(rows)::value;
    return c.kd == 4 ? &tile<MR, 4> : c.kd == 5 ? &tile<MR, 5> : &tile<MR, 6>;
  };
  decltype(&tile<1, 4>) tiles[4] = {pick(std::integral_constant<int, 1>{}), pick(std::integral_constant<int, 2>{}),
                                    pick(std::integral_constant<int, 3>{}), pick(std::integral_constant<int, 4>{})};
  void* op = kavx2::k_out(c, f32);
  kavx2::k_tiles(c, packed, [&](int64_t r, int64_t rows, const uint8_t* w, int64_t col) {
    tiles[rows - 1](c.rec, c.base, c.live, w, c.xq.data() + r * k, xbias.data() + (xbias.empty() ? 0 : r * (k / 16)),
                    c.xd.data() + r * (k / 32), c.xs.data() + r * (k / 32), k, op, f32, n, r, col);
  });
  return c.out;
}
#endif

template <typename T>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const int64_t* tables,
                       const int64_t* lens, torch::Tensor& out, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                       int64_t block_size, int64_t width, double scale) {
#ifdef GATEENG_AVX512_BF16
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    auto run_bf16 = [&](auto fn) {
      fn(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), tables, lens, out.data_ptr<T>(), batch, hq, hkv,
         block_size, width, static_cast<float>(scale));
    };
    if (d == 64) return run_bf16(decode_attention_bf16<64>);
    if (d == 128) return run_bf16(decode_attention_bf16<128>);
  }
#endif
  auto run = [&](auto fn) {
    fn(q.data_ptr<T>(), k.data_ptr<T>(), v.data_ptr<T>(), tables, lens, out.data_ptr<T>(), batch, hq, hkv, d,
       block_size, width, static_cast<float>(scale));
  };
  if (d == 64) {
    run(decode_attention_rows<T, 64>);
  } else if (d == 128) {
    run(decode_attention_rows<T, 128>);
  } else {
    run(decode_attention_rows<T, 0>);
  }
}

void check_dtype(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.scalar_type() == torch::kFloat || t.scalar_type() == torch::kBFloat16,
              name, " must be float32 or bfloat16");
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  check_dtype(x, "x");
  TORCH_CHECK(w.scalar_type() == x.scalar_type() && w.dim() == 1 && w.size(0) == x.size(-1),
              "w must be [hidden] in x's dtype");
  x = x.contiguous();
  w = w.contiguous();
  auto out = torch::empty_like(x);
  const int64_t h = x.size(-1), rows = h ? x.numel() / h : 0;
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_rows<float>(x.data_ptr<float>(), w.data_ptr<float>(), out.data_ptr<float>(), rows, h, eps);
  } else {
    using bf = at::BFloat16;
    rms_norm_rows<bf>(x.data_ptr<bf>(), w.data_ptr<bf>(), out.data_ptr<bf>(), rows, h, eps);
  }
  return out;
}

// libgomp keeps a pool of worker threads per thread that has started a parallel
// region, and once it manages more threads than there are CPUs it stops spinning
// between regions: every region then waits for its workers to wake (measured on 2
// cores: a 16-row projection 1.5x slower on the engine thread once the thread that
// built the engine had its own pool). Called on a thread that is done with parallel
// work, this frees that thread's pool (its workers exit); a later region on it
// starts a new one.
void release_idle_threads() { omp_pause_resource_all(omp_pause_soft); }

// The greedy candidate search (plan.greedy_top2) over bf16 logits [R, V]: per row,
// the ids whose logit is at least second - largest * 2^-6 - slack[r], where second is
// the row's second-largest value (a tie with the largest counts) and largest its
// largest magnitude. Returns (rows, ids) of the candidates, row by row, ids in
// order; a row holding an infinity or a NaN makes the call return no candidates and
// ok = false (the caller then decides densely). Only which ids are candidates comes
// from here; a row's result does not depend on the other rows.
std::vector<torch::Tensor> greedy_candidates(torch::Tensor logits, torch::Tensor slack) {
  TORCH_CHECK(logits.scalar_type() == torch::kBFloat16 && logits.dim() == 2 && logits.device().is_cpu(),
              "logits must be bf16 [rows, vocab] on the CPU");
  TORCH_CHECK(slack.scalar_type() == torch::kFloat && slack.numel() == logits.size(0), "slack: float32 [rows]");
  logits = logits.contiguous();
  slack = slack.contiguous();
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab >= 2, "need at least two ids");
  const uint16_t* base = reinterpret_cast<const uint16_t*>(logits.data_ptr<at::BFloat16>());
  const float* sl = slack.data_ptr<float>();
  std::vector<std::vector<int64_t>> found(rows);
  std::vector<char> bad(rows, 0);
  constexpr int64_t L = 16;   // lanes: each keeps its own top two, merged at the end
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint16_t* x = base + r * vocab;
      auto val = [&](int64_t i) {
        uint32_t bits = static_cast<uint32_t>(x[i]) << 16;
        float v;
        std::memcpy(&v, &bits, sizeof(v));
        return v;
      };
      float t1[L], t2[L], big[L];
      uint16_t special = 0;   // exponent bits all set somewhere: an infinity or NaN
      for (int64_t l = 0; l < L; ++l) t1[l] = t2[l] = std::numeric_limits<float>::lowest(), big[l] = 0.f;
      const int64_t body = vocab / L * L;
      for (int64_t i = 0; i < body; i += L) {
        for (int64_t l = 0; l < L; ++l) {
          const float v = val(i + l);
          special |= static_cast<uint16_t>(((x[i + l] & 0x7F80u) == 0x7F80u) ? 1u : 0u);
          t2[l] = std::max(t2[l], std::min(t1[l], v));
          t1[l] = std::max(t1[l], v);
          big[l] = std::max(big[l], std::abs(v));
        }
      }
      float first = std::numeric_limits<float>::lowest(), second = first, largest = 0.f;
      auto take = [&](float v) {
        second = std::max(second, std::min(first, v));
        first = std::max(first, v);
      };
      for (int64_t l = 0; l < L; ++l) {
        take(t1[l]);
        second = std::max(second, t2[l]);   // a lane's second is below its own first
        largest = std::max(largest, big[l]);
      }
      for (int64_t i = body; i < vocab; ++i) {
        special |= static_cast<uint16_t>(((x[i] & 0x7F80u) == 0x7F80u) ? 1u : 0u);
        take(val(i));
        largest = std::max(largest, std::abs(val(i)));
      }
      if (special) {
        bad[r] = 1;
        continue;
      }
      const float threshold = second - largest * 0x1p-6f - sl[r];
      for (int64_t i = 0; i < vocab; ++i) {
        if (val(i) >= threshold) found[r].push_back(i);
      }
    }
  });
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (bad[r]) return {torch::empty({0}, torch::kLong), torch::empty({0}, torch::kLong), torch::zeros({}, torch::kBool)};
    total += static_cast<int64_t>(found[r].size());
  }
  auto out_rows = torch::empty({total}, torch::kLong), out_ids = torch::empty({total}, torch::kLong);
  int64_t* pr = out_rows.data_ptr<int64_t>();
  int64_t* pi = out_ids.data_ptr<int64_t>();
  for (int64_t r = 0, k = 0; r < rows; ++r) {
    for (int64_t id : found[r]) pr[k] = r, pi[k++] = id;
  }
  return {out_rows, out_ids, torch::ones({}, torch::kBool)};
}

// Calls fn.template operator()<T>() for x's dtype (float32 or bf16).
template <typename F>
void by_dtype(const torch::Tensor& x, F fn) {
  if (x.scalar_type() == torch::kFloat) {
    fn(float{});
  } else {
    fn(at::BFloat16{});
  }
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor h, torch::Tensor add, torch::Tensor w, double eps) {
  check_dtype(h, "h");
  TORCH_CHECK(add.scalar_type() == h.scalar_type() && add.sizes() == h.sizes(), "add must match h");
  TORCH_CHECK(w.scalar_type() == h.scalar_type() && w.dim() == 1 && w.size(0) == h.size(-1),
              "w must be [hidden] in h's dtype");
  h = h.contiguous();
  add = add.contiguous();
  w = w.contiguous();
  auto h_out = torch::empty_like(h), x_out = torch::empty_like(h);
  const int64_t n = h.size(-1), rows = n ? h.numel() / n : 0;
  by_dtype(h, [&](auto tag) {
    using T = decltype(tag);
    add_rms_norm_rows<T>(h.data_ptr<T>(), add.data_ptr<T>(), w.data_ptr<T>(), h_out.data_ptr<T>(),
                         x_out.data_ptr<T>(), rows, n, eps);
  });
  return {h_out, x_out};
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_dtype(gate_up, "gate_up");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0, "gate_up must be [rows, 2 * n]");
  gate_up = gate_up.contiguous();
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  by_dtype(gate_up, [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(gate_up.data_ptr<T>(), out.data_ptr<T>(), rows, n);
  });
  return out;
}

void check_experts(const std::vector<torch::Tensor>& gate_up, const std::vector<torch::Tensor>& down, int64_t down_n,
                   int64_t h) {
  TORCH_CHECK(!gate_up.empty() && down.size() == gate_up.size(), "one gate_up and one down per expert");
  TORCH_CHECK(down_n == h, "down must give hidden outputs");
}

// A routing rule (kernels/SPEC.md, "Mixture of experts"): k of the experts;
// softmax_first: softmax, then top-k (renorm: the k probabilities renormalized), else
// top-k, then softmax over the k logits.
struct Routing {
  int64_t k;
  bool softmax_first, renorm;
};

// The fast plan's routing of rows x [M, H] bf16 by the router R [E, H] bf16: the spec's
// rule and tie-break (the reference's moe_route) in this file's arithmetic, so its
// bits may differ from the reference's, never its rule. Per row: the binary32 logits
// z[j] = x . R[j], the ranking scores (softmax(z), or z), the k + 1 best, the lower id
// first among equal scores, the k chosen in ascending id order (ids [M, k]) with their
// weights ([M, k]), and the router margin (margins [M]: the k-th score minus the
// (k+1)-th, +inf when k = E). A logit that is not finite is refused (this file's
// arithmetic assumes finite values).
void route_rows(const u16* x, const u16* router, int64_t m, int64_t e, int64_t h, Routing rule, int64_t* ids,
                float* weights, float* margins) {
  const int64_t k = rule.k, kk = std::min(k + 1, e);
  at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(h), z(e), s(e);
    std::vector<int64_t> top(kk);
    for (int64_t r = begin; r < end; ++r) {
      for (int64_t i = 0; i < h; ++i) xf[i] = c10::bit_cast<float>(static_cast<uint32_t>(x[r * h + i]) << 16);
      for (int64_t j = 0; j < e; ++j) {
        const u16* rj = router + j * h;
        float acc = 0.f;
        for (int64_t i = 0; i < h; ++i) acc += xf[i] * c10::bit_cast<float>(static_cast<uint32_t>(rj[i]) << 16);
        TORCH_CHECK((c10::bit_cast<uint32_t>(acc) & 0x7f800000u) != 0x7f800000u, "router logit is not finite (row ",
                    r, ", expert ", j, ")");
        z[j] = acc;
      }
      if (rule.softmax_first) {
        float mx = z[0], total = 0.f;
        for (int64_t j = 1; j < e; ++j) mx = std::max(mx, z[j]);
        for (int64_t j = 0; j < e; ++j) total += s[j] = std::exp(z[j] - mx);
        for (int64_t j = 0; j < e; ++j) s[j] /= total;
      } else {
        std::copy(z.begin(), z.end(), s.begin());
      }
      // The kk best by insertion, ids ascending: an expert enters only above a strictly
      // smaller score, so among equal scores the lower id stays ahead.
      int64_t n = 0;
      for (int64_t j = 0; j < e; ++j) {
        if (n == kk && !(s[j] > s[top[kk - 1]])) continue;
        int64_t p = n < kk ? n++ : kk - 1;
        for (; p > 0 && s[top[p - 1]] < s[j]; --p) top[p] = top[p - 1];
        top[p] = j;
      }
      margins[r] = k < e ? s[top[k - 1]] - s[top[k]] : std::numeric_limits<float>::infinity();
      int64_t* id = ids + r * k;
      float* w = weights + r * k;
      std::copy(top.begin(), top.begin() + k, id);
      std::sort(id, id + k);
      if (rule.softmax_first) {
        float t = 0.f;
        for (int64_t i = 0; i < k; ++i) t += w[i] = s[id[i]];
        if (rule.renorm)
          for (int64_t i = 0; i < k; ++i) w[i] /= t;
      } else {
        float mx = z[id[0]], t = 0.f;
        for (int64_t i = 1; i < k; ++i) mx = std::max(mx, z[id[i]]);
        for (int64_t i = 0; i < k; ++i) t += w[i] = std::exp(z[id[i]] - mx);
        for (int64_t i = 0; i < k; ++i) w[i] /= t;
      }
    }
  });
}

#ifdef GATEENG_QINT8
// x @ w.T on any weight the int8 kernels take, by its record: Q8_0, Q4_0 and Q4_1 on
// qlinear_vnni where `vnni` (and built with it), else qlinear_avx2; the K-quants on
// qlinear_k_vnni where `vnni`, else qlinear_k_avx2 (the same bits).
torch::Tensor qlinear_int8_on(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t per, bool vnni) {
  TORCH_CHECK(packed.dim() == 3, "packed must come from the reference's qpack");
  const int64_t rec = packed.size(2);
  if (rec == qint8::REC_Q8_0 || rec == qint8::REC_Q4_0 || rec == qint8::REC_Q4_1) {
#ifdef GATEENG_AVX512_VNNI
    if (vnni) return qlinear_vnni(x, packed, n, f32, per);
#endif
    return qlinear_avx2(x, packed, n, f32, per);
  }
#ifdef GATEENG_AVX512_VNNI
  if (vnni) return qlinear_k_vnni(x, packed, n, f32, per);
#endif
  return qlinear_k_avx2(x, packed, n, f32, per);
}

// qlinear_int8_on with VNNI wherever built: a model whose layers mix record types (a
// Q4_K_M file's Q4_K and Q6_K) hands decode_layers_with this one C++ matmul, so no
// Python runs between its layers' matmuls.
torch::Tensor qlinear_int8(torch::Tensor x, torch::Tensor packed, int64_t n, bool f32, int64_t per) {
#ifdef GATEENG_AVX512_VNNI
  return qlinear_int8_on(x, packed, n, f32, per, true);
#else
  return qlinear_int8_on(x, packed, n, f32, per, false);
#endif
}

// A routing layer's experts on the fast plan, in one call: the (row, slot) pairs grouped
// by expert (a counting sort, so each expert's rows keep their order), each active
// expert's gate_up, SiLU gate and down once over its rows on the int8 kernels above
// (qlinear_vnni and qlinear_k_vnni where `vnni`, else qlinear_avx2 and qlinear_k_avx2),
// then each row's weighted sum of its k outputs in binary32 in slot order, rounded to
// bf16. x [M, H] bf16 (contiguous), ids [M, k] (ids < the experts), weights [M, k];
// gate_up and down: every expert's packed weight (the reference's qpack, whole K).
// Each matmul is row-invariant, so a row's output depends on that row only.
torch::Tensor experts_combined(const torch::Tensor& x, const int64_t* ids, const float* wp, int64_t k,
                               const std::vector<torch::Tensor>& gate_up, const std::vector<torch::Tensor>& down,
                               int64_t gate_up_n, int64_t down_n, bool vnni) {
  const int64_t experts = static_cast<int64_t>(gate_up.size());
  const int64_t m = x.size(0), h = x.size(1), pairs = m * k;
  const gateeng::ExpertGroups groups(ids, m, k, experts);
  auto linear = [&](const torch::Tensor& in, const torch::Tensor& packed, int64_t n) {
    return qlinear_int8_on(in, packed, n, false, 0, vnni);
  };
  const u16* xs = reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>());
  std::vector<u16> y(pairs * h);   // each pair's expert output, bf16 bits
  const std::vector<int64_t>& active = groups.active;
  auto run = [&](int64_t begin, int64_t end) {
    for (int64_t a = begin; a < end; ++a) {
      const int64_t e = active[a], n = groups.rows(e);
      auto rows = torch::empty({n, h}, x.options());
      groups.gather(e, xs, h, reinterpret_cast<u16*>(rows.data_ptr<at::BFloat16>()));
      auto gu = linear(rows, gate_up[e], gate_up_n);
      auto act = torch::empty({n, gate_up_n / 2}, x.options());
      silu_mul_rows<at::BFloat16>(gu.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), n, gate_up_n / 2);
      auto out = linear(act, down[e], down_n);
      groups.scatter(e, reinterpret_cast<const u16*>(out.data_ptr<at::BFloat16>()), h, y.data());
    }
  };
  // With at least two active experts per thread, the experts split across the threads,
  // each expert's matmuls on one (a parallel_for inside a parallel region runs inline):
  // one fork and join per layer, not two per expert. Fewer: each matmul's columns split.
  const int64_t count = static_cast<int64_t>(active.size());
  if (count >= 2 * at::get_num_threads()) at::parallel_for(0, count, 1, run);
  else run(0, count);
  auto result = torch::empty({m, h}, x.options());
  at::BFloat16* rp = result.data_ptr<at::BFloat16>();
  at::parallel_for(0, m, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(h);
    for (int64_t r = begin; r < end; ++r) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < k; ++i) {
        const float w = wp[r * k + i];
        const u16* yr = y.data() + (r * k + i) * h;
        for (int64_t j = 0; j < h; ++j) acc[j] += w * c10::bit_cast<float>(static_cast<uint32_t>(yr[j]) << 16);
      }
      for (int64_t j = 0; j < h; ++j) rp[r * h + j] = to<at::BFloat16>(acc[j]);
    }
  });
  return result;
}

// moe_experts on the caller's choice: x [M, H] bf16, chosen [M, k] int64, weights [M, k] float32.
torch::Tensor moe_experts(torch::Tensor x, torch::Tensor chosen, torch::Tensor weights,
                          const std::vector<torch::Tensor>& gate_up, const std::vector<torch::Tensor>& down,
                          int64_t gate_up_n, int64_t down_n, bool vnni) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [rows, hidden]");
  TORCH_CHECK(chosen.dim() == 2 && chosen.size(0) == x.size(0) && chosen.scalar_type() == torch::kLong,
              "chosen must be int64 [rows, k]");
  TORCH_CHECK(weights.sizes() == chosen.sizes() && weights.scalar_type() == torch::kFloat,
              "weights must be float32 [rows, k]");
  check_experts(gate_up, down, down_n, x.size(1));
  x = x.contiguous();
  chosen = chosen.contiguous();
  weights = weights.contiguous();
  return experts_combined(x, chosen.data_ptr<int64_t>(), weights.data_ptr<float>(), chosen.size(1), gate_up, down,
                          gate_up_n, down_n, vnni);
}

// A routing layer's MLP on the fast plan in one call: route_rows, then
// experts_combined. x [M, H] bf16, router [E, H] bf16. Returns (the layer's output
// [M, H] bf16, the router margins [M], the chosen ids [M, k], their weights [M, k]).
std::vector<torch::Tensor> moe_layer(torch::Tensor x, torch::Tensor router, int64_t k, bool softmax_first,
                                     bool renorm, const std::vector<torch::Tensor>& gate_up,
                                     const std::vector<torch::Tensor>& down, int64_t gate_up_n, int64_t down_n,
                                     bool vnni) {
  TORCH_CHECK(x.scalar_type() == torch::kBFloat16 && x.dim() == 2, "x must be bf16 [rows, hidden]");
  TORCH_CHECK(router.scalar_type() == torch::kBFloat16 && router.dim() == 2 && router.size(1) == x.size(1),
              "router must be bf16 [experts, hidden]");
  TORCH_CHECK(static_cast<int64_t>(gate_up.size()) == router.size(0), "one expert per router row");
  TORCH_CHECK(k >= 1 && k <= router.size(0), "1 <= k <= experts");
  check_experts(gate_up, down, down_n, x.size(1));
  x = x.contiguous();
  router = router.contiguous();
  const int64_t m = x.size(0);
  auto ids = torch::empty({m, k}, torch::kLong);
  auto weights = torch::empty({m, k}, torch::kFloat);
  auto margins = torch::empty({m}, torch::kFloat);
  route_rows(reinterpret_cast<const u16*>(x.data_ptr<at::BFloat16>()),
             reinterpret_cast<const u16*>(router.data_ptr<at::BFloat16>()), m, router.size(0), x.size(1),
             Routing{k, softmax_first, renorm}, ids.data_ptr<int64_t>(), weights.data_ptr<float>(),
             margins.data_ptr<float>());
  auto out = experts_combined(x, ids.data_ptr<int64_t>(), weights.data_ptr<float>(), k, gate_up, down, gate_up_n,
                              down_n, vnni);
  return {out, margins, ids, weights};
}
#endif

torch::Tensor rope_store(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                         torch::Tensor v_cache, torch::Tensor slots, int64_t hq) {
  check_dtype(qkv, "qkv");
  TORCH_CHECK(k_cache.scalar_type() == qkv.scalar_type() && v_cache.scalar_type() == qkv.scalar_type() &&
                  cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "cos, sin and the KV cache must have qkv's dtype");
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
  by_dtype(qkv, [&](auto tag) {
    using T = decltype(tag);
    rope_store_rows<T>(qkv.data_ptr<T>(), cos.data_ptr<T>(), sin.data_ptr<T>(), sp, q.data_ptr<T>(),
                       k_cache.data_ptr<T>(), v_cache.data_ptr<T>(), rows, hq, hkv, d);
  });
  return q;
}

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor tables, torch::Tensor lens, double scale) {
  check_dtype(q, "q");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "the KV cache must have q's dtype");
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
  const int64_t width = tables.size(1);
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t blocks = k_cache.size(0);
  for (int64_t b = 0; b < batch; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= width * block_size, "row ", b, " attends ", lp[b],
                " keys, outside its block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i) {
      TORCH_CHECK(tp[b * width + i] >= 0 && tp[b * width + i] < blocks, "row ", b, " names block ",
                  tp[b * width + i], " of ", blocks);
    }
  }
  auto out = torch::empty_like(q);
  if (q.scalar_type() == torch::kFloat) {
    dispatch_head_dim<float>(q, k_cache, v_cache, tp, lp, out, batch, hq, hkv, d, block_size, width, scale);
  } else {
    dispatch_head_dim<at::BFloat16>(q, k_cache, v_cache, tp, lp, out, batch, hq, hkv, d, block_size, width, scale);
  }
  return out;
}

// A mixture of experts' routing layers for decode_layers_on, in layer order: each one's
// router [E, H] bf16 and its experts' packed gate_up and down (as moe_layer takes them),
// and the rule.
struct MoeLayers {
  std::vector<torch::Tensor> routers;
  std::vector<std::vector<torch::Tensor>> gate_up, down;
  int64_t gate_up_n, down_n;
  Routing rule;
  bool vnni;

  MoeLayers(std::vector<torch::Tensor> routers, std::vector<std::vector<torch::Tensor>> gate_up,
            std::vector<std::vector<torch::Tensor>> down, int64_t gate_up_n, int64_t down_n, int64_t k,
            bool softmax_first, bool renorm, bool vnni)
      : routers(std::move(routers)), gate_up(std::move(gate_up)), down(std::move(down)), gate_up_n(gate_up_n),
        down_n(down_n), rule{k, softmax_first, renorm}, vnni(vnni) {
    TORCH_CHECK(this->gate_up.size() == this->routers.size() && this->down.size() == this->routers.size(),
                "one router, one set of gate_up and one of down per routing layer");
    for (size_t i = 0; i < this->routers.size(); ++i) {
      const auto& r = this->routers[i];
      TORCH_CHECK(r.scalar_type() == torch::kBFloat16 && r.dim() == 2 && r.is_contiguous() &&
                      static_cast<int64_t>(this->gate_up[i].size()) == r.size(0),
                  "a router is contiguous bf16 [experts, hidden], one expert per row");
      TORCH_CHECK(k >= 1 && k <= r.size(0), "1 <= k <= experts");
      check_experts(this->gate_up[i], this->down[i], down_n, r.size(1));
    }
  }
};

// q and k of qkv [rows, (Hq + 2 Hkv) D] each RMSNormed in place over spans of their
// norm weight's width (a head's D, or the whole projection: OLMoE), as the per-op
// path's rms_norm does them (the same row function).
void qk_norm(torch::Tensor& qkv, const torch::Tensor& q_norm, const torch::Tensor& k_norm, int64_t q_width,
             int64_t k_width, double eps) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), qn = q_norm.size(0), kn = k_norm.size(0);
  TORCH_CHECK(q_norm.scalar_type() == qkv.scalar_type() && k_norm.scalar_type() == qkv.scalar_type() &&
                  q_width % qn == 0 && k_width % kn == 0, "q/k norms: qkv's dtype, spans of q and k");
  by_dtype(qkv, [&](auto tag) {
    using T = decltype(tag);
    T* p = qkv.data_ptr<T>();
    const T* qw = q_norm.data_ptr<T>();
    const T* kw = k_norm.data_ptr<T>();
    for (int64_t r = 0; r < rows; ++r) {
      T* row = p + r * width;
      for (int64_t i = 0; i < q_width; i += qn) rms_norm_row(row + i, qw, row + i, qn, eps);
      for (int64_t i = 0; i < k_width; i += kn) rms_norm_row(row + q_width + i, kw, row + q_width + i, kn, eps);
    }
  });
}

// Every decoder layer of a fast-plan decode step (each row attends its own sequence's
// keys; no prefill chunk) in one call: the same kernels in the same order as the
// per-op path (LlamaModel.forward over the fast plan), so the same bits, without a
// Python call per op. h: the residual stream; x: the first layer's normed input.
// Per layer l: matrices 4l .. 4l+3 are qkv, o, gate_up and down in the reference's
// layout, norms[2l] the post-attention norm and norms[2l+1] the norm after the MLP (the
// next layer's input norm, or the final one). Matrix i is parts[i] packed weights in a
// row, each with its output size in ns (a stack whose parts are stored in different
// types: their outputs side by side); packed and ns hold every part of every matrix in
// order. qk_norms: empty, or each layer's q norm and k norm (applied after qkv). A
// routing layer's gate_up and down have no parts: its MLP is moe_layer's on the next of
// `moe`'s routing layers. linear(x, packed, n): the matmul on that layout. Returns (the
// final normed hidden states, each row's smallest router margin over the routing
// layers, +inf where none).
template <typename Linear>
std::vector<torch::Tensor> decode_layers_on(Linear linear, torch::Tensor h, torch::Tensor x,
                                            const std::vector<torch::Tensor>& packed, const std::vector<int64_t>& ns,
                                            const std::vector<int64_t>& parts, const std::vector<torch::Tensor>& norms,
                                            const std::vector<torch::Tensor>& qk_norms, const MoeLayers* moe,
                                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                            torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables,
                                            torch::Tensor lens, int64_t hq, double eps, double scale) {
  const int64_t layers = k_cache.size(0), rows = x.size(0);
  TORCH_CHECK(k_cache.dim() == 5 && v_cache.sizes() == k_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(), "the KV cache must be contiguous [layers, blocks, block_size, Hkv, D]");
  TORCH_CHECK(static_cast<int64_t>(parts.size()) == 4 * layers && static_cast<int64_t>(norms.size()) == 2 * layers,
              "4 matrices and 2 norms per layer");
  TORCH_CHECK(qk_norms.empty() || static_cast<int64_t>(qk_norms.size()) == 2 * layers, "no q/k norms, or 2 per layer");
  std::vector<int64_t> first(parts.size() + 1, 0);   // matrix i's parts: [first[i], first[i + 1])
  int64_t routing = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const bool mlp = i % 4 >= 2;
    TORCH_CHECK(parts[i] >= 1 || (mlp && parts[i] == 0 && parts[i ^ 1] == 0), "every matrix has a part, but a "
                "routing layer's gate_up and down");
    if (i % 4 == 2 && parts[i] == 0) ++routing;
    first[i + 1] = first[i] + parts[i];
  }
  TORCH_CHECK(static_cast<int64_t>(packed.size()) == first.back() && static_cast<int64_t>(ns.size()) == first.back(),
              "packed and ns: one entry per part");
  TORCH_CHECK(routing == (moe ? static_cast<int64_t>(moe->routers.size()) : 0), "one of moe's layers per routing layer");
  TORCH_CHECK(routing == 0 || x.scalar_type() == torch::kBFloat16, "routing layers run on bf16");
  const int64_t hkv = k_cache.size(3), d = k_cache.size(4);
  auto mm = [&](const torch::Tensor& a, int64_t i) {
    if (parts[i] == 1) return linear(a, packed[first[i]], ns[first[i]]);
    std::vector<torch::Tensor> outs;
    for (int64_t j = first[i]; j < first[i + 1]; ++j) outs.push_back(linear(a, packed[j], ns[j]));
    return torch::cat(outs, 1);
  };
  auto margins = torch::full({rows}, std::numeric_limits<float>::infinity(), torch::kFloat);
  int64_t r = 0;   // the next routing layer
  for (int64_t l = 0; l < layers; ++l) {
    const auto kc = k_cache[l], vc = v_cache[l];
    auto qkv = mm(x, 4 * l);
    if (!qk_norms.empty()) {
      qkv = qkv.contiguous();
      qk_norm(qkv, qk_norms[2 * l], qk_norms[2 * l + 1], hq * d, hkv * d, eps);
    }
    const auto q = rope_store(qkv, cos, sin, kc, vc, slots, hq);
    const auto attn = decode_attention(q, kc, vc, tables, lens, scale).reshape({rows, -1});
    std::vector<torch::Tensor> hx = add_rms_norm(h, mm(attn, 4 * l + 1), norms[2 * l], eps);
    torch::Tensor mlp;
    if (parts[4 * l + 2] > 0) {
      mlp = mm(silu_mul(mm(hx[1], 4 * l + 2)), 4 * l + 3);
    } else {
#ifdef GATEENG_QINT8
      const torch::Tensor in = hx[1].contiguous();
      const int64_t k = moe->rule.k;
      std::vector<int64_t> ids(rows * k);
      std::vector<float> weights(rows * k), least(rows);
      route_rows(reinterpret_cast<const u16*>(in.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const u16*>(moe->routers[r].data_ptr<at::BFloat16>()), rows, moe->routers[r].size(0),
                 in.size(1), moe->rule, ids.data(), weights.data(), least.data());
      float* mp = margins.data_ptr<float>();
      for (int64_t i = 0; i < rows; ++i) mp[i] = std::min(mp[i], least[i]);
      mlp = experts_combined(in, ids.data(), weights.data(), k, moe->gate_up[r], moe->down[r], moe->gate_up_n,
                             moe->down_n, moe->vnni);
      ++r;
#else
      TORCH_CHECK(false, "routing layers need the int8 kernels");
#endif
    }
    hx = add_rms_norm(hx[0], mlp, norms[2 * l + 1], eps);
    h = hx[0];
    x = hx[1];
  }
  return {x, margins};
}

// The matmul from another extension: the reference's linear(x, packed, n, f32, per) (its
// AVX2 build where this CPU has no VDPBF16PS), or this one's int8 qlinear. pybind11
// calls a bound C++ function of this exact signature directly, without Python.
using RefLinear = std::function<torch::Tensor(torch::Tensor, torch::Tensor, int64_t, bool, int64_t)>;

std::vector<torch::Tensor> decode_layers_with(RefLinear ref_linear, torch::Tensor h, torch::Tensor x,
                                              std::vector<torch::Tensor> packed, std::vector<int64_t> ns,
                                              std::vector<int64_t> parts, std::vector<torch::Tensor> norms,
                                              std::vector<torch::Tensor> qk_norms, const MoeLayers* moe,
                                              torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                                              torch::Tensor v_cache, torch::Tensor slots, torch::Tensor tables,
                                              torch::Tensor lens, int64_t hq, double eps, double scale) {
  auto linear = [&](const torch::Tensor& a, const torch::Tensor& w, int64_t n) { return ref_linear(a, w, n, false, 0); };
  return decode_layers_on(linear, h, x, packed, ns, parts, norms, qk_norms, moe, cos, sin, k_cache, v_cache, slots,
                          tables, lens, hq, eps, scale);
}

#ifdef GATEENG_AVX512_BF16
std::vector<torch::Tensor> decode_layers(torch::Tensor h, torch::Tensor x, std::vector<torch::Tensor> packed,
                                         std::vector<int64_t> ns, std::vector<int64_t> parts,
                                         std::vector<torch::Tensor> norms, std::vector<torch::Tensor> qk_norms,
                                         const MoeLayers* moe, torch::Tensor cos, torch::Tensor sin,
                                         torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                                         torch::Tensor tables, torch::Tensor lens, int64_t hq, double eps,
                                         double scale) {
  return decode_layers_on(linear_dpbf16, h, x, packed, ns, parts, norms, qk_norms, moe, cos, sin, k_cache, v_cache,
                          slots, tables, lens, hq, eps, scale);
}
#endif

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32 arithmetic)");
  m.def("decode_attention", &decode_attention, "one-query-per-sequence attention over a paged KV cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm", &add_rms_norm, "(h + add, RMSNorm(h + add)) in one pass");
  m.def("silu_mul", &silu_mul, "silu(gate) * up for gate_up = [gate | up]");
  m.def("greedy_candidates", &greedy_candidates, "(rows, ids, ok) of the greedy top-2 candidates");
  m.def("release_idle_threads", &release_idle_threads, "let this thread's OpenMP worker pool go");
  m.def("rope_store", &rope_store, "RoPE on q and k heads; k and v stored at their cache slots; returns q");
  py::class_<MoeLayers>(m, "MoeLayers", "a mixture of experts' routing layers for decode_layers")
      .def(py::init<std::vector<torch::Tensor>, std::vector<std::vector<torch::Tensor>>,
                    std::vector<std::vector<torch::Tensor>>, int64_t, int64_t, int64_t, bool, bool, bool>(),
           py::arg("routers"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_n"), py::arg("down_n"),
           py::arg("k"), py::arg("softmax_first"), py::arg("renorm"), py::arg("vnni"));
  m.def("decode_layers_with", &decode_layers_with, "decode_layers on another extension's matmul (the reference's)",
        py::call_guard<py::gil_scoped_release>());
#ifdef GATEENG_QINT8
  m.def("qlinear_avx2", &qlinear_avx2, "x @ w.T on a quantized weight packed by the reference's qpack (int8 AVX2)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
  m.def("qlinear_k_avx2", &qlinear_k_avx2, "x @ w.T on a K-quant weight packed by the reference's qpack (int8 AVX2)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
  m.def("qlinear_int8", &qlinear_int8, "x @ w.T on a weight packed by the reference's qpack, on the int8 kernel "
        "of its record (qlinear_vnni and qlinear_k_vnni where built, else qlinear_avx2 and qlinear_k_avx2)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
  m.def("moe_experts", &moe_experts, "a routing layer's experts on the int8 kernels, combined (the fast plan)",
        py::call_guard<py::gil_scoped_release>());
  m.def("moe_layer", &moe_layer, "(output, margins, ids, weights): a routing layer routed and run (the fast plan)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("router"), py::arg("k"),
        py::arg("softmax_first"), py::arg("renorm"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_n"),
        py::arg("down_n"), py::arg("vnni"));
  m.attr("qavx2") = true;
#else
  m.attr("qavx2") = false;
#endif
#ifdef GATEENG_AVX512_VNNI
  m.def("qlinear_vnni", &qlinear_vnni, "x @ w.T on a quantized weight packed by the reference's qpack (int8 VNNI)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
  m.attr("qvnni") = true;
#else
  m.attr("qvnni") = false;
#endif
#ifdef GATEENG_KVNNI
  m.def("qlinear_k_vnni", &qlinear_k_vnni, "x @ w.T on a K-quant weight packed by the reference's qpack (int8 VNNI)",
        py::call_guard<py::gil_scoped_release>(), py::arg("x"), py::arg("packed"), py::arg("n"), py::arg("f32"),
        py::arg("per") = 0);
#endif
#ifdef GATEENG_AVX512_BF16
  m.def("linear_dpbf16", &linear_dpbf16, "x @ w.T on a weight packed by the reference's pack (row-invariant)",
        py::call_guard<py::gil_scoped_release>());
  m.def("decode_layers", &decode_layers, "every decoder layer of a decode step in one call (the fast plan)",
        py::call_guard<py::gil_scoped_release>());
  m.attr("dpbf16") = true;
#else
  m.attr("dpbf16") = false;
#endif
}
