// CPU kernels for both plans (gateeng/cpu_ops.py builds and loads them).
//
// At decode shapes a torch op costs more in dispatch and in copies than in
// arithmetic: RMSNorm is seven ops, and attention over a paged cache needs each
// sequence's whole context gathered into a new tensor per layer per step. Here
// attention reads the KV blocks where they are.
//
// The invariant plan's promise rests on these. Invariant: one row's output (for
// attention, one row and KV head) is computed start to finish by one thread, in a
// fixed order, from that row's inputs only (its query, its block table and key
// count, the KV cache). Nothing depends on how many rows a call has, on which
// thread takes a row, or on the other rows' values. Keep it so: no split of one
// row's reduction across threads, no loop bound or branch that depends on the
// call's row count.
//
// Arithmetic in float32; inputs and outputs in the model dtype (float32 or bf16).
// Built with -ffast-math (vectorized exp and reductions): every value stays finite.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace {

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
void rms_norm_rows(const T* x, const T* w, T* out, int64_t rows, int64_t h, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * h;
      T* yr = out + r * h;
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
  });
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
          float mx = m[j];
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sj[t]);
          const float rescale = std::exp(m[j] - mx);   // 0 on the first block (m = lowest)
#pragma omp simd
          for (int64_t t = 0; t < n; ++t) sj[t] = std::exp(sj[t] - mx);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) sum += sj[t];
          float* aj = acc.data() + j * d;
#pragma omp simd
          for (int64_t i = 0; i < d; ++i) aj[i] *= rescale;
          for (int64_t t = 0; t < n; ++t) {
            const float p = sj[t];
            const float* vt = vf.data() + t * d;
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) aj[i] += p * vt[i];
          }
          m[j] = mx;
          l[j] = l[j] * rescale + sum;
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

template <typename T>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, const int64_t* tables,
                       const int64_t* lens, torch::Tensor& out, int64_t batch, int64_t hq, int64_t hkv, int64_t d,
                       int64_t block_size, int64_t width, double scale) {
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

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dim (float32 arithmetic)");
  m.def("decode_attention", &decode_attention, "one-query-per-sequence attention over a paged KV cache");
}
