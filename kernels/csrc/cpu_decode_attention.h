// The C++ kernels behind kernels/cpu_decode_attention.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <optional>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "simd.h"

namespace cpu_decode_attention {

// Online-softmax state of the query rows of M sequences x H heads h0 .. h0 + H - 1 (row
// j * H + h for head h0 + h).
struct Rows {
  int64_t H;
  std::vector<const float*> q;  // each row's query
  std::vector<int64_t> kvh;     // each row's KV head (G query heads share one)
  std::vector<float> acc, m, l;
  Rows(int64_t rows, int64_t h, int64_t g, int64_t d, int64_t first)
      : H(h), q(rows), kvh(rows), acc(rows * d, 0.f), m(rows, -FLT_MAX), l(rows, 0.f) {
    for (int64_t r = 0; r < rows; ++r) kvh[r] = (first + r % h) / g;
  }
};

// VW cached values as floats: fp32 as they are, int8 widened (their row's scale applies after).
static inline __attribute__((always_inline)) vf load_kv(const float* p) { return loadv(p); }
static inline __attribute__((always_inline)) vf load_kv(const int8_t* p) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
#else
  return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
#endif
}

// An fp8 (e4m3fn) cache element: 1 sign, 4 exponent (bias 7) and 3 mantissa bits.
struct E4M3 {
  uint8_t bits;
};
// VW e4m3 values as floats, exactly: a normal one's exponent and mantissa bits moved into
// fp32's and the exponent rebiased (+120), a subnormal one (exponent 0) as mantissa * 2^-9;
// then the sign. No fp32 denormal is formed on the way. NaN (0x7F) is never stored.
static inline __attribute__((always_inline)) vf load_kv(const E4M3* p) {
#if VW == 16
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i mag = _mm512_and_si512(b, _mm512_set1_epi32(0x7F));
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512i normal = _mm512_add_epi32(_mm512_slli_epi32(mag, 20), _mm512_set1_epi32(120 << 23));
  const __m512 sub = _mm512_mul_ps(_mm512_cvtepi32_ps(mag), _mm512_set1_ps(1.f / 512));
  const __mmask16 is_sub = _mm512_cmplt_epi32_mask(mag, _mm512_set1_epi32(8));
  const __m512i v = _mm512_mask_blend_epi32(is_sub, normal, _mm512_castps_si512(sub));
  return (vf)_mm512_castsi512_ps(_mm512_or_si512(v, sign));
#else
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i mag = _mm256_and_si256(b, _mm256_set1_epi32(0x7F));
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256i normal = _mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.f / 512));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  const __m256i v = _mm256_blendv_epi8(normal, _mm256_castps_si256(sub), is_sub);
  return (vf)_mm256_castsi256_ps(_mm256_or_si256(v, sign));
#endif
}

// Prefetches of the lines [next, next + per) of a block's `nlines`, K's and V's, towards L2;
// `next` moves on.
static inline __attribute__((always_inline)) void prefetch_next(const void* nk, const void* nv,
                                                                int64_t& next, int64_t per,
                                                                int64_t nlines) {
  const int64_t end = std::min(next + per, nlines);
  for (int64_t i = next; i < end; ++i) {
    __builtin_prefetch(static_cast<const char*>(nk) + 64 * i, 0, 2);
    __builtin_prefetch(static_cast<const char*>(nv) + 64 * i, 0, 2);
  }
  next = end;
}

// Row r of st attends to the chunk's nt tokens from t0 (kc, vc: their K and V, all KV heads):
// its VW scores as one vector, the online-softmax update, then the VW V rows added into the
// row's accumulator, all in registers. FULL: nt == VW, the loops' bounds known to the compiler
// (unrolled, the scores' vectors in registers); the same operations either way.
template <int D, class T, bool FULL>
static inline __attribute__((always_inline)) void attend_row(Rows& st, int64_t r, const T* kc,
                                                             const T* vc, const float* ksb,
                                                             const float* vsb, int64_t t0,
                                                             int64_t nt_, int64_t stride,
                                                             int64_t KVH, float sc, vf lane) {
  constexpr int NC = D / VW;
  constexpr bool SCALED = !std::is_same_v<T, float>;
  const int64_t nt = FULL ? VW : nt_;
  const int64_t kvh = st.kvh[r], off = kvh * D;
  const float* qr = st.q[r];
  vf a[VW];
#pragma GCC unroll 16
  for (int t = 0; t < VW; ++t) {
    a[t] = vf{};
    if (t < nt) {
      const T* kt = kc + t * stride + off;
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) a[t] = fmadd(loadv(qr + VW * c), load_kv(kt + VW * c), a[t]);
    }
  }
  vf s = reducev(a) * sc;
  vf vscale{};
  if constexpr (SCALED) {
    vf kscale{};
    for (int t = 0; t < nt; ++t) {
      kscale[t] = ksb[(t0 + t) * KVH + kvh];
      vscale[t] = vsb[(t0 + t) * KVH + kvh];
    }
    s *= kscale;
  }
  if constexpr (!FULL) s = lane < static_cast<float>(nt) ? s : vf{} - FLT_MAX;  // no infinities
  const float mx = std::max(st.m[r], hmax(s));
  const float alpha = std::exp(st.m[r] - mx);
  const vf p = vexp_neg(s - mx);
  st.l[r] = st.l[r] * alpha + hsum(p);
  st.m[r] = mx;
  const vf pv = SCALED ? p * vscale : p;
  float* ar = st.acc.data() + r * D;
  vf o[NC];
  for (int c = 0; c < NC; ++c) o[c] = loadv(ar + VW * c) * alpha;
#pragma GCC unroll 16
  for (int t = 0; t < nt; ++t) {
    const T* vt = vc + t * stride + off;
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) o[c] = fmadd(vf{} + pv[t], load_kv(vt + VW * c), o[c]);
  }
  for (int c = 0; c < NC; ++c) storev(ar + VW * c, o[c]);
}

// The rows of sequences [j0, j1) attend to the n tokens of one block (K and V of token t at
// kb + t * stride, all KV heads; an int8 cache's scales of token t at ksb + t * KVH, one per KV
// head, fp32 caches none), VW tokens at a time (attend_row), while the next block (nk, nv:
// nlines 64-byte lines each, none for nullptr) is prefetched a share per row. An int8 row's
// dot products are scaled by its K scale, and its softmax weights by the V scales before V is
// added: the reference's dequantized products, factored. Not inlined: every row is computed by
// the same instructions wherever it is called from and whatever rows share the call (batch
// independence); rows never interact.
template <int D, class T>
static __attribute__((noinline)) void attend_block(Rows& st, int64_t j0, int64_t j1,
                                                   const T* kb, const T* vb, const float* ksb,
                                                   const float* vsb, int64_t n, int64_t stride,
                                                   int64_t KVH, float sc, const T* nk,
                                                   const T* nv, int64_t nlines) {
  const int64_t H = st.H;
  const int64_t iters = (n + VW - 1) / VW * (j1 - j0) * H;
  const int64_t per = (nlines + iters - 1) / iters;  // lines to prefetch a row
  int64_t next = 0;
  const vf lane = lanes();
  for (int64_t t0 = 0; t0 < n; t0 += VW) {
    const int64_t nt = std::min<int64_t>(VW, n - t0);
    const T* kc = kb + t0 * stride;
    const T* vc = vb + t0 * stride;
    for (int64_t r = j0 * H; r < j1 * H; ++r) {
      if (nk != nullptr) prefetch_next(nk, nv, next, per, nlines);
      if (nt == VW)
        attend_row<D, T, true>(st, r, kc, vc, ksb, vsb, t0, nt, stride, KVH, sc, lane);
      else
        attend_row<D, T, false>(st, r, kc, vc, ksb, vsb, t0, nt, stride, KVH, sc, lane);
    }
  }
}

// One call's operands: query [B, H, D] f32; k/v cache [NB, BS, KVH, D] of T (fp32, or int8
// with scales [NB, BS, KVH] f32); tables [B, MAXB] i32; lens [B] i32; out [B, H, D] f32.
template <class T>
struct Paged {
  const float* q;
  const T *kc, *vc;
  const float *ks, *vs;  // nullptr for fp32
  const int32_t *tb, *ln;
  float* o;
  int64_t H, G, KVH, BS, MAXB, tok_stride, blk_stride, nlines;  // nlines: 64-byte lines a block
  float sc;
  // Block `id` of K (or V) to prefetch, or nullptr for none (id -1).
  const T* block(const T* cache, int64_t id) const {
    return id < 0 ? nullptr : cache + id * blk_stride;
  }
  // Block `id`'s scales (nullptr for fp32).
  const float* scales(const float* s, int64_t id) const {
    return s == nullptr ? nullptr : s + id * BS * KVH;
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

template <class T>
static Groups group_by_prefix(const Paged<T>& pc, int64_t B) {
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

// Group g's query rows of heads [h0, h1): its shared blocks once for all members, then each
// member's own blocks in table order, prefetching the next block; then each row's output,
// normalized.
template <int D, class T>
static void attend_group(const Paged<T>& pc, const Groups& gs, int64_t g, int64_t h0,
                         int64_t h1) {
  const int64_t H = h1 - h0, BS = pc.BS, MAXB = pc.MAXB, stride = pc.blk_stride;
  const int64_t first = gs.starts[g], M = gs.starts[g + 1] - first, shared = gs.shared[g];
  Rows st(M * H, H, pc.G, D, h0);
  for (int64_t j = 0; j < M; ++j)
    for (int64_t h = 0; h < H; ++h)
      st.q[j * H + h] = pc.q + (gs.order[first + j] * pc.H + h0 + h) * D;
  auto block = [&](int64_t j0, int64_t j1, int64_t id, int64_t n, int64_t nx) {
    attend_block<D, T>(st, j0, j1, pc.kc + id * stride, pc.vc + id * stride,
                       pc.scales(pc.ks, id), pc.scales(pc.vs, id), n, pc.tok_stride, pc.KVH,
                       pc.sc, pc.block(pc.kc, nx), pc.block(pc.vc, nx), pc.nlines);
  };
  const int32_t* lead = pc.tb + gs.order[first] * MAXB;  // the shared blocks' table
  for (int64_t blk = 0; blk < shared; ++blk)
    block(0, M, lead[blk], BS, blk + 1 < shared ? lead[blk + 1] : -1);
  for (int64_t j = 0; j < M; ++j) {
    const int64_t b = gs.order[first + j], L = pc.ln[b];
    const int32_t* table = pc.tb + b * MAXB;
    for (int64_t t0 = shared * BS; t0 < L; t0 += BS)
      block(j, j + 1, table[t0 / BS], std::min(BS, L - t0), t0 + BS < L ? table[t0 / BS + 1] : -1);
    for (int64_t h = 0; h < H; ++h) {
      const int64_t r = j * H + h;
      float* orow = pc.o + (b * pc.H + h0 + h) * D;
      for (int64_t i = 0; i < D; ++i) orow[i] = st.acc[r * D + i] / st.l[r];
    }
  }
}

// query [B, H, D] f32; k/v cache [NB, BS, KVH, D] of T (with scales [NB, BS, KVH] f32 for
// int8); tables [B, MAXB] i32; lens [B] i32. One work item per group of sequences
// (group_by_prefix), parallel over the groups; with fewer groups than threads (one sequence
// at batch 1) each group's heads are split into as many runs as keep every thread busy.
template <int D, class T>
static torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor tables, torch::Tensor lens, double scale,
                            const float* ks, const float* vs) {
  const int64_t B = query.size(0), H = query.size(1);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2);
  auto out = torch::empty_like(query);
  const int64_t block_bytes = BS * KVH * D * static_cast<int64_t>(sizeof(T));
  const Paged<T> pc{query.data_ptr<float>(), static_cast<const T*>(k_cache.data_ptr()),
                    static_cast<const T*>(v_cache.data_ptr()),
                    ks, vs, tables.data_ptr<int32_t>(), lens.data_ptr<int32_t>(),
                    out.data_ptr<float>(), H, H / KVH, KVH, BS, tables.size(1), KVH * D,
                    BS * KVH * D, block_bytes / 64, static_cast<float>(scale)};
  const Groups gs = group_by_prefix(pc, B);
  const int64_t groups = gs.size(), threads = at::get_num_threads();
  const int64_t runs = groups >= threads ? 1 : std::min(H, (threads + groups - 1) / groups);
  const int64_t per = (H + runs - 1) / runs;  // heads a run
  at::parallel_for(0, groups * runs, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h0 = i % runs * per, h1 = std::min(H, h0 + per);
      if (h0 < h1) attend_group<D, T>(pc, gs, i / runs, h0, h1);
    }
  });
  return out;
}

template <int D>
static torch::Tensor decode_any(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                                torch::Tensor tables, torch::Tensor lens, double scale,
                                const std::optional<torch::Tensor>& k_scale,
                                const std::optional<torch::Tensor>& v_scale) {
  if (k_cache.scalar_type() == torch::kFloat)
    return decode<D, float>(query, k_cache, v_cache, tables, lens, scale, nullptr, nullptr);
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(cpu_ops::scaled_cache(k_cache, v_cache, k_scale, v_scale),
              "paged_decode: an fp32 cache, or an int8 / fp8 one with fp32 scales [NB, BS, KVH]");
  if (type == torch::kChar)
    return decode<D, int8_t>(query, k_cache, v_cache, tables, lens, scale,
                             k_scale->data_ptr<float>(), v_scale->data_ptr<float>());
  return decode<D, E4M3>(query, k_cache, v_cache, tables, lens, scale, k_scale->data_ptr<float>(),
                         v_scale->data_ptr<float>());
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale,
                           std::optional<torch::Tensor> k_scale = std::nullopt,
                           std::optional<torch::Tensor> v_scale = std::nullopt) {
  switch (query.size(2)) {
    case 32: return decode_any<32>(query, k_cache, v_cache, tables, lens, scale, k_scale, v_scale);
    case 64: return decode_any<64>(query, k_cache, v_cache, tables, lens, scale, k_scale, v_scale);
    case 80: return decode_any<80>(query, k_cache, v_cache, tables, lens, scale, k_scale, v_scale);
    case 96: return decode_any<96>(query, k_cache, v_cache, tables, lens, scale, k_scale, v_scale);
    case 128:
      return decode_any<128>(query, k_cache, v_cache, tables, lens, scale, k_scale, v_scale);
  }
  TORCH_CHECK(false, "paged_decode: unsupported head dim ", query.size(2));
}

}  // namespace cpu_decode_attention
