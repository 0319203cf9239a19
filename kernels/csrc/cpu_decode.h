// The C++ kernels behind kernels/cpu_decode.py (see its docstring); bound in module.cpp.
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

namespace cpu_decode {

// Online-softmax state of the query rows of M sequences x H heads (row j * H + h).
struct Rows {
  int64_t H, G;
  std::vector<const float*> q;  // each row's query
  std::vector<float> acc, m, l;
  Rows(int64_t rows, int64_t h, int64_t g, int64_t d)
      : H(h), G(g), q(rows), acc(rows * d, 0.f), m(rows, -FLT_MAX), l(rows, 0.f) {}
};

// The rows of sequences [j0, j1) attend to the n tokens of one block (K and V of token t at
// kb + t * stride, all KV heads), VW tokens at a time: each row's VW scores as one vector, the
// online-softmax update, then the VW V rows added into the row's accumulator, all in
// registers. D floats per head. Not inlined: every row is computed by the same
// instructions wherever it is called from and whatever rows share the call (batch
// independence); rows never interact.
template <int D>
static __attribute__((noinline)) void attend_block(Rows& st, int64_t j0, int64_t j1,
                                                   const float* kb, const float* vb, int64_t n,
                                                   int64_t stride, float sc, const float* nk,
                                                   const float* nv, int64_t nlines) {
  constexpr int NC = D / VW;
  const int64_t H = st.H, G = st.G;
  const int64_t iters = (n + VW - 1) / VW * (j1 - j0) * H;
  int64_t it = 0;
  const vf lane = lanes();
  for (int64_t t0 = 0; t0 < n; t0 += VW) {
    const int64_t nt = std::min<int64_t>(VW, n - t0);
    const float* kc = kb + t0 * stride;
    const float* vc = vb + t0 * stride;
    for (int64_t j = j0; j < j1; ++j) {
      for (int64_t h = 0; h < H; ++h) {
        const int64_t r = j * H + h, off = h / G * D;
        if (nk != nullptr) {  // this row's share of the next block, towards L2
          for (int64_t i = it * nlines / iters; i < (it + 1) * nlines / iters; ++i) {
            __builtin_prefetch(nk + 16 * i, 0, 2);
            __builtin_prefetch(nv + 16 * i, 0, 2);
          }
          ++it;
        }
        const float* qr = st.q[r];
        vf a[VW];
        for (int t = 0; t < VW; ++t) {
          a[t] = vf{};
          if (t < nt) {
            const float* kt = kc + t * stride + off;
            for (int c = 0; c < NC; ++c) a[t] += loadv(qr + VW * c) * loadv(kt + VW * c);
          }
        }
        vf s = reducev(a) * sc;
        s = lane < static_cast<float>(nt) ? s : vf{} - FLT_MAX;  // -ffast-math: no infinities
        const float mx = std::max(st.m[r], hmax(s));
        const float alpha = std::exp(st.m[r] - mx);
        const vf p = vexp_neg(s - mx);
        st.l[r] = st.l[r] * alpha + hsum(p);
        st.m[r] = mx;
        float* ar = st.acc.data() + r * D;
        vf o[NC];
        for (int c = 0; c < NC; ++c) o[c] = loadv(ar + VW * c) * alpha;
        for (int t = 0; t < nt; ++t) {
          const float* vt = vc + t * stride + off;
          for (int c = 0; c < NC; ++c) o[c] += p[t] * loadv(vt + VW * c);
        }
        for (int c = 0; c < NC; ++c) storev(ar + VW * c, o[c]);
      }
    }
  }
}

// query [B, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB] i32; lens [B] i32.
template <int D>
static torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor tables, torch::Tensor lens, double scale) {
  const int64_t B = query.size(0), H = query.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MAXB = tables.size(1);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const float sc = static_cast<float>(scale);
  const int64_t nlines = blk_stride / 16;  // 64-byte lines in one block of K (or V)
  // The block to prefetch, or nullptr for none (id -1).
  const auto next_block = [&](const float* cache, int64_t id) {
    return id < 0 ? nullptr : cache + id * blk_stride;
  };

  // Groups: sequences whose tables start with the same physical block (a shared prefix), at
  // most kMaxGroup each so that a large group still spreads over threads. A group's `shared`
  // leading blocks, full in every member, are read once for all members.
  constexpr int64_t kMaxGroup = 8;
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tb[a * MAXB] < tb[b * MAXB]; });
  std::vector<int64_t> starts{0}, shared;
  for (int64_t i = 1; i <= B; ++i)
    if (i == B || tb[order[i] * MAXB] != tb[order[i - 1] * MAXB] ||
        i - starts.back() == kMaxGroup)
      starts.push_back(i);
  const int64_t NG = static_cast<int64_t>(starts.size()) - 1;
  for (int64_t g = 0; g < NG; ++g) {
    const int64_t first = order[starts[g]];
    int64_t full = ln[first] / BS;
    for (int64_t i = starts[g] + 1; i < starts[g + 1]; ++i) {
      const int64_t b = order[i];
      int64_t j = 0;
      const int64_t lim = std::min<int64_t>(full, ln[b] / BS);
      while (j < lim && tb[b * MAXB + j] == tb[first * MAXB + j]) ++j;
      full = j;
    }
    shared.push_back(starts[g + 1] - starts[g] > 1 ? full : 0);
  }

  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t M = starts[g + 1] - starts[g];
      Rows st(M * H, H, G, D);
      for (int64_t j = 0; j < M; ++j)
        for (int64_t h = 0; h < H; ++h) st.q[j * H + h] = q + (order[starts[g] + j] * H + h) * D;
      const int64_t b0 = order[starts[g]];
      for (int64_t blk = 0; blk < shared[g]; ++blk) {
        const int64_t id = tb[b0 * MAXB + blk];
        const int64_t nx = blk + 1 < shared[g] ? tb[b0 * MAXB + blk + 1] : -1;
        attend_block<D>(st, 0, M, kc + id * blk_stride, vc + id * blk_stride, BS, tok_stride,
                        sc, next_block(kc, nx), next_block(vc, nx), nlines);
      }
      for (int64_t j = 0; j < M; ++j) {
        const int64_t b = order[starts[g] + j], L = ln[b];
        for (int64_t t0 = shared[g] * BS; t0 < L; t0 += BS) {
          const int64_t id = tb[b * MAXB + t0 / BS];
          const int64_t nx = t0 + BS < L ? tb[b * MAXB + t0 / BS + 1] : -1;
          attend_block<D>(st, j, j + 1, kc + id * blk_stride, vc + id * blk_stride,
                          std::min(BS, L - t0), tok_stride, sc,
                          next_block(kc, nx), next_block(vc, nx), nlines);
        }
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = j * H + h;
          float* orow = o + (b * H + h) * D;
          for (int64_t i = 0; i < D; ++i) orow[i] = st.acc[r * D + i] / st.l[r];
        }
      }
    }
  });
  return out;
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  switch (query.size(2)) {
    case 32: return decode<32>(query, k_cache, v_cache, tables, lens, scale);
    case 64: return decode<64>(query, k_cache, v_cache, tables, lens, scale);
    case 80: return decode<80>(query, k_cache, v_cache, tables, lens, scale);
    case 96: return decode<96>(query, k_cache, v_cache, tables, lens, scale);
    case 128: return decode<128>(query, k_cache, v_cache, tables, lens, scale);
  }
  TORCH_CHECK(false, "paged_decode: unsupported head dim ", query.size(2));
}

}  // namespace cpu_decode
