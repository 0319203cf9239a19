// The C++ kernels behind kernels/cpu_prefill_attention.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <type_traits>
#include <vector>

#include "cpu_ops.h"
#include "simd.h"

namespace cpu_prefill_attention {

constexpr int64_t kQueryTile = 32;  // query positions per work item
// Keys are attended in spans of kKeySpan at fixed positions (0, kKeySpan, ...), each span a work
// item of its own whose partial softmax is merged with the others' in span order: a short chunk
// over a long cached prefix (a question after a system prompt) is then more than one work item
// per KV head. Fixed positions keep a token's arithmetic independent of its chunk and batch.
constexpr int64_t kKeySpan = 512;

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

// A paged cache of elements T: fp32, or int8 / e4m3 codes (uint8_t bits) with an fp32 scale
// per (slot, KV head), read as code x scale in fp32: the reference's dequantized values
// exactly (`reference.dequantize_kv`), widened while a tile is gathered, never written out.
template <class T>
struct Cache {
  const T *k, *v;
  const float *ks, *vs;  // scales [slots, KVH]; null for fp32
  const float* fp8;      // every e4m3 code's value (cpu_ops::fp8_values), for uint8_t
  float value(T x) const {
    if constexpr (std::is_same_v<T, uint8_t>) return fp8[x];
    else return static_cast<float>(x);
  }
};

// VW rows of VW floats (row j at src + j * ld) transposed: column c to dst + c * ldd. Three
// rounds of shuffles (32-bit pairs, 64-bit pairs, 128-bit lanes), no scalar moves.
static inline __attribute__((always_inline)) void transpose_block(const float* src, int64_t ld,
                                                                  float* dst, int64_t ldd) {
#if VW == 16
  __m512 r[16], t[16];
  for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_ps(src + j * ld);
  for (int i = 0; i < 8; ++i) {  // t[2i] lane L: r2i[4L], r2i+1[4L], r2i[4L+1], r2i+1[4L+1]
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 4; ++i) {  // r[4i + k] lane L: column 4L + k of rows 4i .. 4i + 3
    r[4 * i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4 + k], r[8 + k], r[12 + k]
    const __m512 x = _mm512_shuffle_f32x4(r[k], r[4 + k], 0x88);  // lanes 0, 2 of each
    const __m512 y = _mm512_shuffle_f32x4(r[k], r[4 + k], 0xDD);  // lanes 1, 3
    const __m512 x2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0x88);
    const __m512 y2 = _mm512_shuffle_f32x4(r[8 + k], r[12 + k], 0xDD);
    _mm512_storeu_ps(dst + k * ldd, _mm512_shuffle_f32x4(x, x2, 0x88));
    _mm512_storeu_ps(dst + (4 + k) * ldd, _mm512_shuffle_f32x4(y, y2, 0x88));
    _mm512_storeu_ps(dst + (8 + k) * ldd, _mm512_shuffle_f32x4(x, x2, 0xDD));
    _mm512_storeu_ps(dst + (12 + k) * ldd, _mm512_shuffle_f32x4(y, y2, 0xDD));
  }
#else
  __m256 r[8], t[8];
  for (int j = 0; j < 8; ++j) r[j] = _mm256_loadu_ps(src + j * ld);
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  auto pd = [](__m256 x) { return _mm256_castps_pd(x); };
  for (int i = 0; i < 2; ++i) {
    r[4 * i] = _mm256_castpd_ps(_mm256_unpacklo_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 1] = _mm256_castpd_ps(_mm256_unpackhi_pd(pd(t[4 * i]), pd(t[4 * i + 2])));
    r[4 * i + 2] = _mm256_castpd_ps(_mm256_unpacklo_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
    r[4 * i + 3] = _mm256_castpd_ps(_mm256_unpackhi_pd(pd(t[4 * i + 1]), pd(t[4 * i + 3])));
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of r[k], r[4 + k]
    _mm256_storeu_ps(dst + k * ldd, _mm256_permute2f128_ps(r[k], r[4 + k], 0x20));
    _mm256_storeu_ps(dst + (4 + k) * ldd, _mm256_permute2f128_ps(r[k], r[4 + k], 0x31));
  }
#endif
}

// The keys t0 .. (at most KT of them, up to `last`) of KV head `kh`, possibly from two blocks,
// into kt [D][KT] (transposed, zero past the last key) and vt [KT][D]; returns their number.
template <int D, class T>
static inline __attribute__((always_inline)) int64_t gather_keys(
    int64_t t0, int64_t last, const Cache<T>& cache, const int32_t* table, int64_t BS,
    int64_t KVH, int64_t kh, float* kt, float* vt) {
  constexpr int64_t KT = Tiling<D>::KT;
  const int64_t stride = KVH * D;
  int64_t nt = 0;
  while (nt < KT && t0 + nt <= last) {
    const int64_t t = t0 + nt, off = t % BS;
    const int64_t run = std::min<int64_t>({KT - nt, BS - off, last + 1 - t});
    const int64_t slot = static_cast<int64_t>(table[t / BS]) * BS + off;
    const T* kb = cache.k + slot * stride + kh * D;
    const T* vb = cache.v + slot * stride + kh * D;
    int64_t done = 0;  // keys transposed VW at a time; the rest one by one
    alignas(64) float rows[VW * D];  // VW keys dequantized row by row as below (int8, fp8)
    for (; done + VW <= run; done += VW) {
      const float* src = rows;  // the VW keys as fp32 rows, `ld` apart
      int64_t ld = D;
      if constexpr (std::is_same_v<T, float>) {
        src = kb + done * stride;
        ld = stride;
      } else {
        for (int64_t i = 0; i < VW; ++i) {
          const float sk = cache.ks[(slot + done + i) * KVH + kh];
          for (int64_t c = 0; c < D; ++c)
            rows[i * D + c] = cache.value(kb[(done + i) * stride + c]) * sk;
        }
      }
      for (int64_t c0 = 0; c0 < D; c0 += VW)
        transpose_block(src + c0, ld, kt + c0 * KT + nt + done, KT);
    }
    for (int64_t i = 0; i < run; ++i) {
      if constexpr (std::is_same_v<T, float>) {
        if (i >= done)
          for (int64_t c = 0; c < D; ++c) kt[c * KT + nt + i] = kb[i * stride + c];
        std::memcpy(vt + (nt + i) * D, vb + i * stride, D * sizeof(float));
      } else {
        const float sk = cache.ks[(slot + i) * KVH + kh], sv = cache.vs[(slot + i) * KVH + kh];
        if (i >= done)
          for (int64_t c = 0; c < D; ++c)
            kt[c * KT + nt + i] = cache.value(kb[i * stride + c]) * sk;
        for (int64_t c = 0; c < D; ++c) vt[(nt + i) * D + c] = cache.value(vb[i * stride + c]) * sv;
      }
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

// A row's partial result over one span of keys: its running max, its sum of exponentials and
// its unnormalized output, D floats.
constexpr int64_t kPartHead = 2;

// One work item: the `npos` query positions starting at `pos0` (rows `q_first`.. of the query)
// of one sequence, for the G query heads of KV head `kh` (G * npos rows), over the keys k0 ..
// k1 - 1 (k1 at most one past the last position), KT keys at a time in the order of the
// sequence's blocks: gather_keys, score_rows, accumulate_pv. Rows at positions before k0 have
// no key there and are left out. With `part` null the keys are all of the rows' keys and the
// rows' outputs go to `out`; otherwise each row's partial result goes to `part` (kPartHead + D
// floats a row; m = -FLT_MAX, l = 0 for a row left out). A row's arithmetic depends only on its
// own query, its position and the keys, never on the other rows of the tile: a token's result
// is the same however the prompt was chunked or batched.
template <int D, class E>
static void attend_tile(const float* q, int64_t H, int64_t G, int64_t kh, int64_t q_first,
                        int64_t npos, int64_t pos0, int64_t k0, int64_t k1,
                        const Cache<E>& cache, const int32_t* table, int64_t BS, int64_t KVH,
                        float sc, float* out, float* part) {
  using T = Tiling<D>;
  const int64_t skip = std::max<int64_t>(0, k0 - pos0) * G;  // rows before k0
  const int64_t rows = npos * G - skip, RP = (rows + T::RQ - 1) / T::RQ * T::RQ;
  std::vector<float> qs(RP * D, 0.f), o(RP * D, 0.f), p(RP * T::KT), m(RP, -FLT_MAX),
      l(RP, 0.f), alpha(RP), rowpos(RP, 0.f);
  alignas(64) float kt[D * T::KT];
  alignas(64) float vt[T::KT * D];
  auto row_of = [&](int64_t r) { return ((q_first + r / G) * H + kh * G + r % G) * D; };
  for (int64_t r = 0; r < rows; ++r) {
    const float* src = q + row_of(skip + r);
    for (int64_t c = 0; c < D; ++c) qs[r * D + c] = src[c] * sc;
    rowpos[r] = static_cast<float>(pos0 + (skip + r) / G);
  }
  for (int64_t t0 = k0; t0 < k1;) {
    const int64_t nt = gather_keys<D>(t0, k1 - 1, cache, table, BS, KVH, kh, kt, vt);
    score_rows<D>(qs.data(), rowpos.data(), kt, t0, nt, RP, p.data(), m.data(), l.data(),
                  alpha.data());
    accumulate_pv<D>(p.data(), vt, alpha.data(), nt, RP, o.data());
    t0 += nt;
  }
  if (part == nullptr) {
    for (int64_t r = 0; r < rows; ++r) {
      float* dst = out + row_of(skip + r);
      const float inv = 1.f / l[r];
      for (int64_t c = 0; c < D; ++c) dst[c] = o[r * D + c] * inv;
    }
    return;
  }
  for (int64_t r = 0; r < skip + rows; ++r) {
    float* dst = part + r * (kPartHead + D);
    const bool in = r >= skip;
    dst[0] = in ? m[r - skip] : -FLT_MAX;
    dst[1] = in ? l[r - skip] : 0.f;
    for (int64_t c = 0; c < D; ++c) dst[kPartHead + c] = in ? o[(r - skip) * D + c] : 0.f;
  }
}

// A tile's `spans` partial results (attend_tile's `part`, span after span, `rows` rows each)
// merged row by row in span order into its output rows: the max of the maxima, each span's
// sum and output rescaled to it, the output divided by the sum. Spans a row has no key in add
// nothing (their sum is 0 and their max no larger than the others').
template <int D>
static void merge_spans(const float* part, int64_t spans, int64_t rows, int64_t G, int64_t H,
                        int64_t kh, int64_t q_first, float* out) {
  constexpr int64_t W = kPartHead + D;
  for (int64_t r = 0; r < rows; ++r) {
    float mx = -FLT_MAX;
    for (int64_t s = 0; s < spans; ++s) mx = std::max(mx, part[(s * rows + r) * W]);
    float l = 0.f, acc[D] = {};
    for (int64_t s = 0; s < spans; ++s) {
      const float* ps = part + (s * rows + r) * W;
      if (ps[1] == 0.f) continue;
      const float w = std::exp(ps[0] - mx);
      l += ps[1] * w;
      for (int64_t c = 0; c < D; ++c) acc[c] += ps[kPartHead + c] * w;
    }
    float* dst = out + ((q_first + r / G) * H + kh * G + r % G) * D;
    const float inv = 1.f / l;
    for (int64_t c = 0; c < D; ++c) dst[c] = acc[c] * inv;
  }
}

// query [T, H, D] f32; k/v cache [NB, BS, KVH, D] of E (`cache`); tables [B, MAXB] i32;
// cu [B + 1] i32; lens [B] i32 (cache length including the chunk).
template <int D, class E>
static torch::Tensor prefill(torch::Tensor query, torch::Tensor k_cache, const Cache<E>& cache,
                             torch::Tensor tables, torch::Tensor cu, torch::Tensor lens,
                             double scale) {
  const int64_t H = query.size(1), BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t B = lens.size(0), MAXB = tables.size(1);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* cq = cu.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  // A tile: query positions i0 .. i0 + n - 1 of sequence b for KV head kh, its keys in
  // `spans` spans (more than one: their partial results from `part` on).
  struct Tile { int64_t b, kh, i0, n, spans, part; };
  struct Item { int64_t tile, k0, k1; };
  std::vector<Tile> tiles;
  std::vector<Item> items;
  int64_t part_floats = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t qlen = cq[b + 1] - cq[b];
    for (int64_t i0 = 0; i0 < qlen; i0 += kQueryTile)
      for (int64_t kh = 0; kh < KVH; ++kh) {
        const int64_t n = std::min<int64_t>(kQueryTile, qlen - i0);
        const int64_t keys = ln[b] - qlen + i0 + n;  // up to the tile's last position
        const int64_t spans = (keys + kKeySpan - 1) / kKeySpan;
        const int64_t t = static_cast<int64_t>(tiles.size());
        tiles.push_back({b, kh, i0, n, spans, spans > 1 ? part_floats : -1});
        if (spans > 1) part_floats += spans * n * G * (kPartHead + D);
        for (int64_t s = 0; s < spans; ++s)
          items.push_back({t, s * kKeySpan, std::min(keys, (s + 1) * kKeySpan)});
      }
  }
  // Most keys first, pulled by the threads one at a time: a static split would leave one
  // thread the late, expensive tiles of a long prompt.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& x, const Item& y) { return x.k1 - x.k0 > y.k1 - y.k0; });
  // Grown, never shrunk or cleared: every float of it that is read was written by this call
  // (a fresh zeroed buffer was a page fault per 4 KiB of it, every layer, every chunk).
  // The calling thread's (the lambdas below run on others: they take the pointer).
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(part_floats)) scratch.resize(part_floats);
  float* const part = scratch.data();
  const float sc = static_cast<float>(scale);
  const int64_t N = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), N), 1, [&](int64_t, int64_t) {
    for (int64_t i = next++; i < N; i = next++) {
      const Item& it = items[i];
      const Tile& tl = tiles[it.tile];
      const int64_t qlen = cq[tl.b + 1] - cq[tl.b];
      float* dst = nullptr;
      if (tl.spans > 1)
        dst = part + tl.part + it.k0 / kKeySpan * tl.n * G * (kPartHead + D);
      attend_tile<D, E>(q, H, G, tl.kh, cq[tl.b] + tl.i0, tl.n, ln[tl.b] - qlen + tl.i0, it.k0,
                        it.k1, cache, tb + tl.b * MAXB, BS, KVH, sc, o, dst);
    }
  });
  const int64_t T = static_cast<int64_t>(tiles.size());
  if (part_floats == 0) return out;  // every tile's keys in one span: written out already
  at::parallel_for(0, T, 8, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const Tile& tl = tiles[t];
      if (tl.spans > 1)
        merge_spans<D>(part + tl.part, tl.spans, tl.n * G, G, H, tl.kh, cq[tl.b] + tl.i0,
                       o);
    }
  });
  return out;
}

template <int D, class T>
static torch::Tensor prefill_as(torch::Tensor query, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor tables, torch::Tensor cu,
                                torch::Tensor lens, double scale, const float* ks,
                                const float* vs) {
  const Cache<T> cache{static_cast<const T*>(k_cache.data_ptr()),
                       static_cast<const T*>(v_cache.data_ptr()), ks, vs,
                       cpu_ops::fp8_values().data()};
  return prefill<D, T>(query, k_cache, cache, tables, cu, lens, scale);
}

// An fp32 cache, or an int8 / fp8 one with its fp32 scales [NB, BS, KVH].
template <int D>
static torch::Tensor prefill_any(torch::Tensor query, torch::Tensor k_cache,
                                 torch::Tensor v_cache, torch::Tensor tables, torch::Tensor cu,
                                 torch::Tensor lens, double scale,
                                 const std::optional<torch::Tensor>& k_scale,
                                 const std::optional<torch::Tensor>& v_scale) {
  const auto type = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == type, "prefill_attention: K and V caches of one dtype");
  if (type == torch::kFloat)
    return prefill_as<D, float>(query, k_cache, v_cache, tables, cu, lens, scale, nullptr,
                                nullptr);
  TORCH_CHECK(cpu_ops::scaled_cache(k_cache, v_cache, k_scale, v_scale),
              "prefill_attention: an fp32 cache, or an int8 / fp8 one with fp32 scales "
              "[NB, BS, KVH]");
  const float *ks = k_scale->data_ptr<float>(), *vs = v_scale->data_ptr<float>();
  if (type == torch::kChar)
    return prefill_as<D, int8_t>(query, k_cache, v_cache, tables, cu, lens, scale, ks, vs);
  return prefill_as<D, uint8_t>(query, k_cache, v_cache, tables, cu, lens, scale, ks, vs);
}

torch::Tensor prefill_attention(torch::Tensor query, torch::Tensor k_cache,
                                torch::Tensor v_cache, torch::Tensor tables, torch::Tensor cu,
                                torch::Tensor lens, double scale,
                                std::optional<torch::Tensor> k_scale = std::nullopt,
                                std::optional<torch::Tensor> v_scale = std::nullopt) {
  switch (query.size(2)) {
    case 32: return prefill_any<32>(query, k_cache, v_cache, tables, cu, lens, scale, k_scale, v_scale);
    case 64: return prefill_any<64>(query, k_cache, v_cache, tables, cu, lens, scale, k_scale, v_scale);
    case 80: return prefill_any<80>(query, k_cache, v_cache, tables, cu, lens, scale, k_scale, v_scale);
    case 96: return prefill_any<96>(query, k_cache, v_cache, tables, cu, lens, scale, k_scale, v_scale);
    case 128:
      return prefill_any<128>(query, k_cache, v_cache, tables, cu, lens, scale, k_scale, v_scale);
  }
  TORCH_CHECK(false, "prefill_attention: unsupported head dim ", query.size(2));
}

}  // namespace cpu_prefill_attention
