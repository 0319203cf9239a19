// The C++ kernels behind kernels/cpu_decode_attention.py (see its docstring); bound in module.cpp.
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

namespace cpu_decode_attention {

// Online-softmax state of the query rows of M sequences x H heads (row j * H + h).
struct Rows {
  int64_t H, G;
  std::vector<const float*> q;  // each row's query
  std::vector<float> acc, m, l;
  Rows(int64_t rows, int64_t h, int64_t g, int64_t d)
      : H(h), G(g), q(rows), acc(rows * d, 0.f), m(rows, -FLT_MAX), l(rows, 0.f) {}
};

// Share `it` of `iters` of the next block's `nlines` 64-byte lines of K and V, towards L2.
static inline __attribute__((always_inline)) void prefetch_share(const float* nk,
                                                                 const float* nv, int64_t it,
                                                                 int64_t iters, int64_t nlines) {
  for (int64_t i = it * nlines / iters; i < (it + 1) * nlines / iters; ++i) {
    __builtin_prefetch(nk + 16 * i, 0, 2);
    __builtin_prefetch(nv + 16 * i, 0, 2);
  }
}

// The rows of sequences [j0, j1) attend to the n tokens of one block (K and V of token t at
// kb + t * stride, all KV heads), VW tokens at a time: each row's VW scores as one vector, the
// online-softmax update, then the VW V rows added into the row's accumulator, all in
// registers. D floats per head. Not inlined: every row is computed by the same
// instructions wherever it is called from and whatever rows share the call (batch
// independence); rows never interact. One loop nest rather than steps, so that a row's
// scores, softmax state and output vectors stay in registers through it.
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
        if (nk != nullptr) prefetch_share(nk, nv, it++, iters, nlines);
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

// One call's operands: query [B, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB]
// i32; lens [B] i32; out [B, H, D] f32.
struct Paged {
  const float *q, *kc, *vc;
  const int32_t *tb, *ln;
  float* o;
  int64_t H, G, BS, MAXB, tok_stride, blk_stride, nlines;  // nlines: 64-byte lines in a block
  float sc;
  // Block `id` of K (or V) to prefetch, or nullptr for none (id -1).
  const float* block(const float* cache, int64_t id) const {
    return id < 0 ? nullptr : cache + id * blk_stride;
  }
};

// Sequences grouped by their first physical block (a shared prefix), at most kMaxGroup each so
// that a large group still spreads over threads: group g is order[starts[g] .. starts[g + 1]),
// and its shared[g] leading blocks, full in every member (0 for a group of one), are read once
// for all its members.
struct Groups {
  static constexpr int64_t kMaxGroup = 8;
  std::vector<int64_t> order, starts{0}, shared;
  int64_t size() const { return static_cast<int64_t>(starts.size()) - 1; }
};

static Groups group_by_prefix(const Paged& pc, int64_t B) {
  const int32_t *tb = pc.tb, *ln = pc.ln;
  const int64_t MAXB = pc.MAXB, BS = pc.BS;
  Groups gs;
  gs.order.resize(B);
  std::iota(gs.order.begin(), gs.order.end(), 0);
  std::stable_sort(gs.order.begin(), gs.order.end(),
                   [&](int64_t a, int64_t b) { return tb[a * MAXB] < tb[b * MAXB]; });
  const auto& order = gs.order;
  for (int64_t i = 1; i <= B; ++i)
    if (i == B || tb[order[i] * MAXB] != tb[order[i - 1] * MAXB] ||
        i - gs.starts.back() == Groups::kMaxGroup)
      gs.starts.push_back(i);
  for (int64_t g = 0; g < gs.size(); ++g) {
    const int64_t first = order[gs.starts[g]];
    int64_t full = ln[first] / BS;
    for (int64_t i = gs.starts[g] + 1; i < gs.starts[g + 1]; ++i) {
      const int64_t b = order[i];
      int64_t j = 0;
      const int64_t lim = std::min<int64_t>(full, ln[b] / BS);
      while (j < lim && tb[b * MAXB + j] == tb[first * MAXB + j]) ++j;
      full = j;
    }
    gs.shared.push_back(gs.starts[g + 1] - gs.starts[g] > 1 ? full : 0);
  }
  return gs;
}

// Group g's query rows: its shared blocks once for all members, then each member's own blocks
// in table order, prefetching the next block; then each row's output, normalized.
template <int D>
static void attend_group(const Paged& pc, const Groups& gs, int64_t g) {
  const int64_t H = pc.H, BS = pc.BS, MAXB = pc.MAXB, stride = pc.blk_stride;
  const int64_t first = gs.starts[g], M = gs.starts[g + 1] - first, shared = gs.shared[g];
  Rows st(M * H, H, pc.G, D);
  for (int64_t j = 0; j < M; ++j)
    for (int64_t h = 0; h < H; ++h) st.q[j * H + h] = pc.q + (gs.order[first + j] * H + h) * D;
  const int32_t* lead = pc.tb + gs.order[first] * MAXB;  // the shared blocks' table
  for (int64_t blk = 0; blk < shared; ++blk) {
    const int64_t id = lead[blk], nx = blk + 1 < shared ? lead[blk + 1] : -1;
    attend_block<D>(st, 0, M, pc.kc + id * stride, pc.vc + id * stride, BS, pc.tok_stride, pc.sc,
                    pc.block(pc.kc, nx), pc.block(pc.vc, nx), pc.nlines);
  }
  for (int64_t j = 0; j < M; ++j) {
    const int64_t b = gs.order[first + j], L = pc.ln[b];
    const int32_t* table = pc.tb + b * MAXB;
    for (int64_t t0 = shared * BS; t0 < L; t0 += BS) {
      const int64_t id = table[t0 / BS], nx = t0 + BS < L ? table[t0 / BS + 1] : -1;
      attend_block<D>(st, j, j + 1, pc.kc + id * stride, pc.vc + id * stride, std::min(BS, L - t0),
                      pc.tok_stride, pc.sc, pc.block(pc.kc, nx), pc.block(pc.vc, nx),
                      pc.nlines);
    }
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = j * H + h;
      float* orow = pc.o + (b * H + h) * D;
      for (int64_t i = 0; i < D; ++i) orow[i] = st.acc[r * D + i] / st.l[r];
    }
  }
}

// query [B, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB] i32; lens [B] i32.
// One work item per group of sequences (group_by_prefix), parallel over the groups.
template <int D>
static torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor tables, torch::Tensor lens, double scale) {
  const int64_t B = query.size(0), H = query.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  auto out = torch::empty_like(query);
  const Paged pc{query.data_ptr<float>(), k_cache.data_ptr<float>(), v_cache.data_ptr<float>(),
                 tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(), out.data_ptr<float>(),
                 H, H / KVH, BS, tables.size(1), KVH * D, BS * KVH * D, BS * KVH * D / 16,
                 static_cast<float>(scale)};
  const Groups gs = group_by_prefix(pc, B);
  at::parallel_for(0, gs.size(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) attend_group<D>(pc, gs, g);
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

}  // namespace cpu_decode_attention
