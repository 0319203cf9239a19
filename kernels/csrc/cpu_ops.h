// The C++ kernels behind kernels/cpu_ops.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

#include "simd.h"

namespace cpu_ops {

// Every e4m3 code's value (exact in fp32).
static const std::array<float, 256>& fp8_values() {
  static const std::array<float, 256> table = [] {
    std::array<float, 256> t{};
    for (int i = 0; i < 256; ++i)
      t[i] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(i),
                                                   c10::Float8_e4m3fn::from_bits()));
    return t;
  }();
  return table;
}

// Whether k_cache / v_cache [NB, BS, KVH, D] are int8 or fp8 alike, with contiguous fp32
// scales [NB, BS, KVH] each (one per token and KV head).
static bool scaled_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                         const std::optional<torch::Tensor>& k_scale,
                         const std::optional<torch::Tensor>& v_scale) {
  const auto type = k_cache.scalar_type();
  return (type == torch::kChar || type == torch::kFloat8_e4m3fn) &&
         v_cache.scalar_type() == type && k_scale && v_scale &&
         k_scale->scalar_type() == torch::kFloat && v_scale->scalar_type() == torch::kFloat &&
         k_scale->is_contiguous() && v_scale->is_contiguous() &&
         k_scale->numel() * k_cache.size(3) == k_cache.numel() &&
         v_scale->numel() == k_scale->numel();
}

// Rows per parallel_for task: about 32k floats of work, so that a decode step's few rows run
// inline on the calling thread.
static int64_t grain(int64_t row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1));
}

static inline void norm_row(const float* x, const float* w, float* o, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (x[i] * r);
}

// w * (x * rsqrt(mean(x^2) + eps)) for each row of x [T, n].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * n, wp, op + t * n, n, eps);
  });
  return out;
}

// residual += x (in place), then rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * n;
      const float* a = xp + t * n;
      for (int64_t i = 0; i < n; ++i) r[i] += a[i];
      norm_row(r, wp, op + t * n, n, eps);
    }
  });
  return out;
}

// Rotate heads [0, nrot) of qkv [T, heads, d] (rows contiguous) in place by the rows pos[t] of
// the cos / sin tables [P, d] (rotate-half convention: x * cos + rotate_half(x) * sin).
void rope_(torch::Tensor qkv, int64_t nrot, torch::Tensor pos, torch::Tensor cos_t,
           torch::Tensor sin_t) {
  const int64_t T = qkv.size(0), d = qkv.size(2), half = d / 2;
  const int64_t row = qkv.stride(0);
  float* xp = qkv.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos_t.data_ptr<float>();
  const float* sp = sin_t.data_ptr<float>();
  at::parallel_for(0, T, grain(nrot * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pp[t] * d;
      const float* s = sp + pp[t] * d;
      for (int64_t h = 0; h < nrot; ++h) {
        float* x = xp + t * row + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

// silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I].
torch::Tensor silu_mul(torch::Tensor gu) {
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// A quantized cache's rows, bit for bit as reference.quantize_kv: per row of d values (a
// multiple of VW), scale = max(amax / QMAX, 1e-8) and the values x / scale rounded. The
// divisions are the division instruction's (IEEE): -ffast-math would multiply by a reciprocal
// instead, another last bit now and then, so not in these functions.
#pragma GCC push_options
#pragma GCC optimize("no-fast-math")
static inline float quant_scale(const float* x, int64_t d, float qmax) {
  vf amax{};
  for (int64_t i = 0; i < d; i += VW) amax = vmax(amax, (vf)((vi)loadv(x + i) & 0x7fffffff));
  return std::max(hmax(amax) / qmax, 1e-8f);
}

// int8: round-half-even(x / scale) clamped to +-127.
static __attribute__((noinline)) void quantize_int8_row(const float* x, int64_t d, int8_t* q,
                                                         float* scale) {
  const float s = quant_scale(x, d, 127.f);
  for (int64_t i = 0; i < d; i += VW) {
    vf y = round_even(loadv(x + i) / s);
    y = y < -127.f ? vf{} - 127.f : y;
    y = y > 127.f ? vf{} + 127.f : y;
    store_bytes(q + i, __builtin_convertvector(y, vi));
  }
  *scale = s;
}

// fp8 e4m3fn (torch's cast): y = x / scale clamped to +-448, rounded to the nearest e4m3 value
// (ties to even: y scaled by the power of two that puts its last kept mantissa bit at 1,
// rounded, scaled back; the subnormal step below 2^-6), then encoded: a normal value's
// exponent (rebiased) and 3 mantissa bits, a subnormal one's mantissa, and the sign (a
// negative zero keeps it, as torch's does); stored as the signed byte of those bits.
static __attribute__((noinline)) void quantize_fp8_row(const float* x, int64_t d, int8_t* q,
                                                        float* scale) {
  const float s = quant_scale(x, d, 448.f);
  for (int64_t i = 0; i < d; i += VW) {
    vf y = loadv(x + i) / s;
    y = y < -448.f ? vf{} - 448.f : y;
    y = y > 448.f ? vf{} + 448.f : y;
    vi e = (((vi)y >> 23) & 0xFF) - 127;
    e = e < -6 ? vi{} - 6 : e;
    const vf inv_step = (vf)((127 + 3 - e) << 23), step = (vf)((127 - 3 + e) << 23);
    const vi qb = (vi)(round_even(y * inv_step) * step);  // an e4m3 value, as fp32
    const vi qe = ((qb >> 23) & 0xFF) - 127;
    const vf mag = (vf)(qb & 0x7fffffff);
    const vi sub = __builtin_convertvector(mag * 512.f, vi);  // exact below 2^-6
    const vi code = qe >= -6 ? ((qe + 7) << 3) | ((qb >> 20) & 7) : sub;
    store_bytes(q + i, qb < 0 ? code - 128 : code);
  }
  *scale = s;
}
#pragma GCC pop_options

// K and V of T tokens ([T, KVH, D] each, a token's heads contiguous) into the paged caches
// [NB, BS, KVH, D] at flat slots[t] = block * BS + offset: fp32 caches copied, int8 and fp8
// ones quantized per (token, head) with their scales [NB, BS, KVH] written beside.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
              torch::Tensor v_cache, torch::Tensor slots,
              std::optional<torch::Tensor> k_scale = std::nullopt,
              std::optional<torch::Tensor> v_scale = std::nullopt) {
  const int64_t T = key.size(0), heads = key.size(1), d = key.size(2), row = heads * d;
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  const auto type = k_cache.scalar_type();
  if (type == torch::kChar || type == torch::kFloat8_e4m3fn) {
    TORCH_CHECK(scaled_cache(k_cache, v_cache, k_scale, v_scale) && d % VW == 0,
                "store_kv: an int8 or fp8 cache needs its fp32 scales [NB, BS, KVH]");
    int8_t* kc = static_cast<int8_t*>(k_cache.data_ptr());
    int8_t* vc = static_cast<int8_t*>(v_cache.data_ptr());
    float* ksp = k_scale->data_ptr<float>();
    float* vsp = v_scale->data_ptr<float>();
    const auto quantize = type == torch::kChar ? quantize_int8_row : quantize_fp8_row;
    at::parallel_for(0, T, grain(2 * row), [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t slot = sp[t] * heads + h;
          quantize(kp + t * ks + h * d, d, kc + slot * d, ksp + slot);
          quantize(vp + t * vs + h * d, d, vc + slot * d, vsp + slot);
        }
    });
    return;
  }
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * row), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * ks, row * sizeof(float));
      std::memcpy(vc + sp[t] * row, vp + t * vs, row * sizeof(float));
    }
  });
}

// Per row of logits [N, V]: the index of the (first) largest value, log(sum(exp(row))) (the
// max subtracted first) and the largest value itself. Two passes over the row; the second
// reads it from cache.
std::vector<torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  const int64_t N = logits.size(0), V = logits.size(1);
  auto ids = torch::empty({N}, logits.options().dtype(torch::kLong));
  auto lse = torch::empty({N}, logits.options());
  auto top = torch::empty({N}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* sp = lse.data_ptr<float>();
  float* tp = top.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      float mx = x[0];
      for (int64_t i = 1; i < V; ++i) mx = std::max(mx, x[i]);
      float sum = 0.f;
      for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - mx);
      int64_t at = 0;
      while (x[at] != mx) ++at;
      ip[r] = at;
      sp[r] = mx + std::log(sum);
      tp[r] = mx;
    }
  });
  return {ids, lse, top};
}

// The embedding rows `ids` [T] (int64) of a Q4_1 or Q8_0 weight split as BlockRows holds it:
// quants q [V, nb, 16] (uint8, two 4-bit quants a byte: low nibbles are a block's first 16) or
// [V, nb, 32] (int8), scales d and, for Q4_1, mins m [V, nb, 1] (fp32). fp32 [T, nb * 32]:
// d q + m, or q d, rounded after the product and after the sum as torch's ops round them (the
// fence keeps -ffast-math from fusing them).
torch::Tensor embed_rows(torch::Tensor q, torch::Tensor d, std::optional<torch::Tensor> m,
                         torch::Tensor ids) {
  const int64_t V = q.size(0), nb = q.size(1), T = ids.size(0);
  const int64_t* id = ids.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < V, "embed_rows: token id ", id[t], " out of range");
  auto out = torch::empty({T, nb * 32}, torch::kFloat);
  float* o = out.data_ptr<float>();
  const float* dp = d.data_ptr<float>();
  const float* mp = m ? m->data_ptr<float>() : nullptr;
  const uint8_t* q4 = mp ? q.data_ptr<uint8_t>() : nullptr;
  const int8_t* q8 = mp ? nullptr : q.data_ptr<int8_t>();
  at::parallel_for(0, T, grain(nb * 32), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = id[t] * nb + b;
        const float db = dp[at];
        float* ob = o + (t * nb + b) * 32;
        if (q4 == nullptr) {
          for (int j = 0; j < 32; ++j) ob[j] = static_cast<float>(q8[at * 32 + j]) * db;
          continue;
        }
        const float mb = mp[at];
        for (int j = 0; j < 16; ++j) {
          const uint8_t byte = q4[at * 16 + j];
          float lo = db * static_cast<float>(byte & 15), hi = db * static_cast<float>(byte >> 4);
          asm("" : "+x"(lo), "+x"(hi));
          ob[j] = lo + mb;
          ob[16 + j] = hi + mb;
        }
      }
  });
  return out;
}

}  // namespace cpu_ops
