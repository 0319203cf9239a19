// The C++ kernels behind kernels/cpu_prefill_attention.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <vector>

#include "simd.h"

namespace cpu_prefill_attention {

constexpr int64_t kQueryTile = 32;  // query positions per work item

// Register blocking for head dim D: KT keys per tile; scores for SR rows at a time (two
// vectors each); P V for PR rows and CB vectors of the head dim at a time. SR, PR and CB keep
// the accumulators within the 32 AVX-512 or 16 AVX2 vector registers.
template <int D>
struct Tiling {
  static constexpr int64_t KT = 2 * VW;
  static constexpr int NC = D / VW;
#if VW == 16
  static constexpr int SR = 8, CB = NC, PR = NC <= 6 ? 4 : 2;
#else
  static constexpr int SR = 6, CB = NC % 4 == 0 ? 4 : (NC % 5 == 0 ? 5 : NC);
  static constexpr int PR = CB <= 4 ? 3 : 2;
#endif
  static constexpr int64_t RQ = std::lcm(SR, PR);  // rows are padded to a multiple of both
  static_assert(NC % CB == 0 && SR <= VW);
};

// The keys t0 .. (at most KT of them, up to `last`) of KV head `kh`, possibly from two blocks,
// into kt [D][KT] (transposed, zero past the last key) and vt [KT][D]; returns their number.
template <int D>
static inline __attribute__((always_inline)) int64_t gather_keys(
    int64_t t0, int64_t last, const float* kc, const float* vc, const int32_t* table, int64_t BS,
    int64_t stride, int64_t kh, float* kt, float* vt) {
  constexpr int64_t KT = Tiling<D>::KT;
  int64_t nt = 0;
  while (nt < KT && t0 + nt <= last) {
    const int64_t t = t0 + nt, off = t % BS;
    const int64_t run = std::min<int64_t>({KT - nt, BS - off, last + 1 - t});
    const int64_t slot = static_cast<int64_t>(table[t / BS]) * BS + off;
    const float* kb = kc + slot * stride + kh * D;
    const float* vb = vc + slot * stride + kh * D;
    for (int64_t i = 0; i < run; ++i) {
      for (int64_t c = 0; c < D; ++c) kt[c * KT + nt + i] = kb[i * stride + c];
      std::memcpy(vt + (nt + i) * D, vb + i * stride, D * sizeof(float));
    }
    nt += run;
  }
  for (int64_t i = nt; i < KT; ++i)
    for (int64_t c = 0; c < D; ++c) kt[c * KT + i] = 0.f;
  return nt;
}

// The scores of the RP rows qs [RP][D] (scaled queries at positions rowpos) against the nt keys
// of kt from position t0, SR rows at a time, masked to keys at or before each row's position;
// then the online-softmax update: p [RP][KT] the exponentials, m and l each row's running max
// and sum, alpha its rescale factor for this tile.
template <int D>
static inline __attribute__((always_inline)) void score_rows(
    const float* qs, const float* rowpos, const float* kt, int64_t t0, int64_t nt, int64_t RP,
    float* p, float* m, float* l, float* alpha) {
  using T = Tiling<D>;
  constexpr int64_t KT = T::KT;
  const vf lane = lanes();
  const vf kp0 = lane + static_cast<float>(t0), kp1 = kp0 + static_cast<float>(VW);
  const float nt_f = static_cast<float>(nt);
  for (int64_t rb = 0; rb < RP; rb += T::SR) {
    vf a0[T::SR] = {}, a1[T::SR] = {};
    const float* qr = qs + rb * D;
    for (int64_t c = 0; c < D; ++c) {
      const vf k0 = loadv(kt + c * KT), k1 = loadv(kt + c * KT + VW);
      for (int rr = 0; rr < T::SR; ++rr) {
        a0[rr] += qr[rr * D + c] * k0;
        a1[rr] += qr[rr * D + c] * k1;
      }
    }
    vf mold = {}, mnew = {}, sums = {};
    for (int rr = 0; rr < T::SR; ++rr) {
      const int64_t r = rb + rr;
      const float rp = rowpos[r];
      const vf s0 = (lane < nt_f) & (kp0 <= rp) ? a0[rr] : vf{} - FLT_MAX;
      const vf s1 = (lane + static_cast<float>(VW) < nt_f) & (kp1 <= rp) ? a1[rr]
                                                                        : vf{} - FLT_MAX;
      const float mx = std::max(m[r], hmax(vmax(s0, s1)));
      const vf e0 = vexp_neg(s0 - mx), e1 = vexp_neg(s1 - mx);
      mold[rr] = m[r];
      mnew[rr] = mx;
      sums[rr] = hsum(e0 + e1);
      m[r] = mx;
      storev(p + r * KT, e0);
      storev(p + r * KT + VW, e1);
    }
    const vf al = vexp_neg(mold - mnew);
    for (int rr = 0; rr < T::SR; ++rr) {
      alpha[rb + rr] = al[rr];
      l[rb + rr] = l[rb + rr] * al[rr] + sums[rr];
    }
  }
}

// o [RP][D] = o * alpha + P V over the tile's nt keys, PR rows and CB vectors of the head dim
// at a time, the accumulators in registers.
template <int D>
static inline __attribute__((always_inline)) void accumulate_pv(const float* p, const float* vt,
                                                                const float* alpha, int64_t nt,
                                                                int64_t RP, float* o) {
  using T = Tiling<D>;
  constexpr int PR = T::PR, CB = T::CB;
  for (int c0 = 0; c0 < T::NC; c0 += CB) {
    for (int64_t rb = 0; rb < RP; rb += PR) {
      vf acc[PR][CB];
      for (int rr = 0; rr < PR; ++rr)
        for (int c = 0; c < CB; ++c)
          acc[rr][c] = loadv(&o[(rb + rr) * D + VW * (c0 + c)]) * alpha[rb + rr];
      for (int64_t t = 0; t < nt; ++t) {
        vf vv[CB];
        for (int c = 0; c < CB; ++c) vv[c] = loadv(vt + t * D + VW * (c0 + c));
        for (int rr = 0; rr < PR; ++rr) {
          const float w = p[(rb + rr) * T::KT + t];
          for (int c = 0; c < CB; ++c) acc[rr][c] += w * vv[c];
        }
      }
      for (int rr = 0; rr < PR; ++rr)
        for (int c = 0; c < CB; ++c) storev(&o[(rb + rr) * D + VW * (c0 + c)], acc[rr][c]);
    }
  }
}

// One work item: the `npos` query positions starting at `pos0` (rows `q_first`.. of the query)
// of one sequence, for the G query heads of KV head `kh` (G * npos rows), over every key up to
// the last of them, KT keys at a time in the order of the sequence's blocks: gather_keys,
// score_rows, accumulate_pv. A row's arithmetic depends only on its own query, its position
// and the keys, never on the other rows of the tile: a token's result is the same however the
// prompt was chunked or batched.
template <int D>
static void attend_tile(const float* q, int64_t H, int64_t G, int64_t kh, int64_t q_first,
                        int64_t npos, int64_t pos0, const float* kc, const float* vc,
                        const int32_t* table, int64_t BS, int64_t KVH, float sc, float* out) {
  using T = Tiling<D>;
  const int64_t rows = npos * G, RP = (rows + T::RQ - 1) / T::RQ * T::RQ;
  std::vector<float> qs(RP * D, 0.f), o(RP * D, 0.f), p(RP * T::KT), m(RP, -FLT_MAX),
      l(RP, 0.f), alpha(RP), rowpos(RP, 0.f);
  alignas(64) float kt[D * T::KT];
  alignas(64) float vt[T::KT * D];
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + ((q_first + r / G) * H + kh * G + r % G) * D;
    for (int64_t c = 0; c < D; ++c) qs[r * D + c] = src[c] * sc;
    rowpos[r] = static_cast<float>(pos0 + r / G);
  }
  const int64_t last = pos0 + npos - 1;
  for (int64_t t0 = 0; t0 <= last;) {
    const int64_t nt = gather_keys<D>(t0, last, kc, vc, table, BS, KVH * D, kh, kt, vt);
    score_rows<D>(qs.data(), rowpos.data(), kt, t0, nt, RP, p.data(), m.data(), l.data(),
                  alpha.data());
    accumulate_pv<D>(p.data(), vt, alpha.data(), nt, RP, o.data());
    t0 += nt;
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* dst = out + ((q_first + r / G) * H + kh * G + r % G) * D;
    const float inv = 1.f / l[r];
    for (int64_t c = 0; c < D; ++c) dst[c] = o[r * D + c] * inv;
  }
}

// query [T, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB] i32; cu [B + 1] i32;
// lens [B] i32 (cache length including the chunk).
template <int D>
static torch::Tensor prefill(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                             torch::Tensor tables, torch::Tensor cu, torch::Tensor lens,
                             double scale) {
  const int64_t H = query.size(1), BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t B = lens.size(0), MAXB = tables.size(1);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* cq = cu.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  struct Item { int64_t b, kh, i0, n; };
  std::vector<Item> items;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = cq[b + 1] - cq[b];
    for (int64_t i0 = 0; i0 < qlen; i0 += kQueryTile)
      for (int64_t kh = 0; kh < KVH; ++kh)
        items.push_back({b, kh, i0, std::min<int64_t>(kQueryTile, qlen - i0)});
  }
  // Longest first (a causal tile's cost grows with its position), pulled by the threads one at
  // a time: a static split would leave one thread the late, expensive tiles of a long prompt.
  std::stable_sort(items.begin(), items.end(), [&](const Item& x, const Item& y) {
    return ln[x.b] - (cq[x.b + 1] - cq[x.b]) + x.i0 > ln[y.b] - (cq[y.b + 1] - cq[y.b]) + y.i0;
  });
  const float sc = static_cast<float>(scale);
  const int64_t N = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), N), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < N; i = next++) {
      const Item& it = items[i];
      const int64_t qlen = cq[it.b + 1] - cq[it.b];
      attend_tile<D>(q, H, G, it.kh, cq[it.b] + it.i0, it.n, ln[it.b] - qlen + it.i0, kc, vc,
                      tb + it.b * MAXB, BS, KVH, sc, o);
    }
  });
  return out;
}

torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor tables, torch::Tensor cu,
                                torch::Tensor lens, double scale) {
  switch (query.size(2)) {
    case 32: return prefill<32>(query, k_cache, v_cache, tables, cu, lens, scale);
    case 64: return prefill<64>(query, k_cache, v_cache, tables, cu, lens, scale);
    case 80: return prefill<80>(query, k_cache, v_cache, tables, cu, lens, scale);
    case 96: return prefill<96>(query, k_cache, v_cache, tables, cu, lens, scale);
    case 128: return prefill<128>(query, k_cache, v_cache, tables, cu, lens, scale);
  }
  TORCH_CHECK(false, "prefill_attention: unsupported head dim ", query.size(2));
}

}  // namespace cpu_prefill_attention
