// The C++ kernels behind kernels/cpu_qlinear.py's 4-bit formats (see its docstring): 4-bit
// weights times two-term int8 activations in integer dot products, or without VNNI for many
// rows the same sums by FMAs; the activations' quantization is Q8_0's too (cpu_qlinear.h).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "simd.h"
#include "cpu_linear.h"

namespace cpu_q4i8 {

using cpu_linear::NR;
using cpu_linear::NV;

constexpr int QK = 32;  // weights per block along K
// VW bytes, unsigned or (SIGNED) int8, as floats.
template <bool SIGNED = false>
static inline __attribute__((always_inline)) vf load_bytes(const uint8_t* p) {
#if VW == 16
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  return (vf)_mm512_cvtepi32_ps(SIGNED ? _mm512_cvtepi8_epi32(b) : _mm512_cvtepu8_epi32(b));
#else
  const __m128i b = _mm_loadl_epi64((const __m128i*)p);
  return (vf)_mm256_cvtepi32_ps(SIGNED ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
#endif
}

// The packed layouts, shared by this kernel (QB = 16 bytes of 4-bit quants per block of 32)
// and the 8-bit one (QB = 32, cpu_qlinear.h). Each gives, per panel, block b's QB NR bytes of
// quants, the scale d of its sub-block s (of SUBS) and, with OFFSET, its offset m (w = d q +
// m), VW columns at a time as floats.
// Per block of 32: fp16 d (and m), then the quants. Q4_0 and Q4_1 (20 bytes per column), Q8_0
// and Q5_0 (34), Q5_1 (36).
template <int QB, bool HAS_OFFSET>
struct PerBlock {
  static constexpr bool OFFSET = HAS_OFFSET;
  static constexpr int64_t HEAD = OFFSET ? 4 : 2;
  static constexpr int64_t BYTES = HEAD + QB;  // per column and block
  static constexpr int64_t K = QK;              // weights per packed block
  static constexpr int SUBS = 1;
  static const uint8_t* quants(const uint8_t* panel, int64_t b) {
    return panel + b * BYTES * NR + HEAD * NR;
  }
  static vf scale(const uint8_t* panel, int64_t b, int, int v) {
    return load_half(panel + b * BYTES * NR + 2 * v * VW);
  }
  static vf offset(const uint8_t* panel, int64_t b, int v) {
    if constexpr (!OFFSET) return vf{};
    return load_half(panel + b * BYTES * NR + 2 * (NR + v * VW));
  }
};
// Per block of 256 (Q4_K: 148 bytes per column, the file's 144 with sc and mn unpacked; Q5_K:
// 276): the file's fp16 d and dmin, its 8 sub-blocks' 6-bit sc and mn as bytes, then their
// quants. d sc and -(dmin mn) are exact fp32 products, as gguf and llama.cpp compute them.
template <int QB>
struct SuperBlock {
  static constexpr bool OFFSET = true;
  static constexpr int64_t BYTES = 4 + 16 + 8 * QB;
  static constexpr int64_t K = 8 * QK;
  static constexpr int SUBS = 1;
  static const uint8_t* quants(const uint8_t* panel, int64_t b) {
    return panel + (b / 8) * BYTES * NR + 20 * NR + (b % 8) * QB * NR;
  }
  static vf scale(const uint8_t* panel, int64_t b, int, int v) {
    const uint8_t* sb = panel + (b / 8) * BYTES * NR;
    return load_half(sb + 2 * v * VW) * load_bytes(sb + (4 + b % 8) * NR + v * VW);
  }
  static vf offset(const uint8_t* panel, int64_t b, int v) {
    const uint8_t* sb = panel + (b / 8) * BYTES * NR;
    return -(load_half(sb + 2 * (NR + v * VW)) * load_bytes(sb + (12 + b % 8) * NR + v * VW));
  }
};
using Q4Block = PerBlock<16, true>;
using Q4Super = SuperBlock<16>;

#if VW == 16
#ifndef __AVX512BW__
#error "the 4-bit kernel needs AVX512BW with AVX512F"
#endif
typedef __m512i vq;
constexpr int TR = 2;  // rows per tile: 3 TR NV int and float accumulators in registers
#else
typedef __m256i vq;
constexpr int TR = 2;
#endif
// The weights stream from memory once a step: each block asks for the block PREFETCH blocks on
// into L2 (prefetcht1). With the hardware's prefetcher alone one-row calls ran at ~60% of the
// speed of asking 8 blocks on into L1, and that at ~80% of this: L1 holds too few misses in
// flight to cover memory's latency that far ahead.
constexpr int64_t PREFETCH = 16;
static inline __attribute__((always_inline)) void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64)
    _mm_prefetch(reinterpret_cast<const char*>(p) + o, _MM_HINT_T1);
}

static inline __attribute__((always_inline)) vq loadq(const uint8_t* p) {
#if VW == 16
  return _mm512_loadu_si512(p);
#else
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
#endif
}

// Low and high nibbles of every byte, each as a byte 0..15.
static inline __attribute__((always_inline)) void nibbles(vq raw, vq& lo, vq& hi) {
#if VW == 16
  const vq mask = _mm512_set1_epi8(0x0F);
  lo = _mm512_and_si512(raw, mask);
  hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
#else
  const vq mask = _mm256_set1_epi8(0x0F);
  lo = _mm256_and_si256(raw, mask);
  hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
#endif
}

// The integer dot products of a block. With a VNNI instruction (dpbusd), acc holds int32 lanes:
// acc += per lane the dot product of its 4 weight bytes (unsigned) with the 4 activations x4
// (signed). Without one, acc holds int16 lanes, each the sum of pairs (maddubs: at most
// 2 * 15 * 127): 8 of them per lane over a block of 32 stay within 30,480, so the pairs are
// added as int16 and widened to int32 once per block (`combine`), instead of a madd and an add
// per dot product.
#if defined(__AVX512VNNI__) || (VW == 8 && defined(__AVXVNNI__))
constexpr bool VNNI = true;
#else
constexpr bool VNNI = false;
#endif

static inline __attribute__((always_inline)) vq dot(vq acc, vq w, int32_t x4) {
#if VW == 16 && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
#elif VW == 16
  return _mm512_add_epi16(acc, _mm512_maddubs_epi16(w, _mm512_set1_epi32(x4)));
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x4));
#else
  return _mm256_add_epi16(acc, _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4)));
#endif
}

static inline __attribute__((always_inline)) vf to_float(vq v) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(v);
#else
  return (vf)_mm256_cvtepi32_ps(v);
#endif
}

static inline __attribute__((always_inline)) vq zero() {
#if VW == 16
  return _mm512_setzero_si512();
#else
  return _mm256_setzero_si256();
#endif
}

// A block's two accumulated sums (`dot` with q, with r) as int32 lanes 256 sum_q + sum_r
// (exact: |256 sum_q + sum_r| < 2^24).
static inline __attribute__((always_inline)) vq combine(vq q, vq r) {
#if VW == 16
  if constexpr (VNNI) return _mm512_add_epi32(_mm512_slli_epi32(q, 8), r);
  return _mm512_add_epi32(_mm512_madd_epi16(q, _mm512_set1_epi16(256)),
                          _mm512_madd_epi16(r, _mm512_set1_epi16(1)));
#else
  if constexpr (VNNI) return _mm256_add_epi32(_mm256_slli_epi32(q, 8), r);
  return _mm256_add_epi32(_mm256_madd_epi16(q, _mm256_set1_epi16(256)),
                          _mm256_madd_epi16(r, _mm256_set1_epi16(1)));
#endif
}

// acc + sum (d_w d_x / 256) + m_w s_x: one block's part of a row's result, from its exact
// integer sum (as a float) and `dx` = d_x / 256. Fenced and fused by hand, so that the integer
// and the float kernels round the same way whatever -ffast-math would do with the expression.
static inline __attribute__((always_inline)) vf flush(vf acc, vf sum, vf dw, vf m, float dx,
                                                      float sx) {
  asm("" : "+v"(dw));  // a product itself (a super-block's d sc): not reassociated with dx
  vf f = dw * dx;
  asm("" : "+v"(f), "+v"(sum), "+v"(acc));
#if VW == 16
  acc = (vf)_mm512_fmadd_ps((__m512)sum, (__m512)f, (__m512)acc);
  return (vf)_mm512_fmadd_ps((__m512)m, _mm512_set1_ps(sx), (__m512)acc);
#else
  acc = (vf)_mm256_fmadd_ps((__m256)sum, (__m256)f, (__m256)acc);
  return (vf)_mm256_fmadd_ps((__m256)m, _mm256_set1_ps(sx), (__m256)acc);
#endif
}

// Rows of x [M, K] as two int8 terms per block of 32, x ~ d (q + r / 256): d = max |x| / 127,
// q = round(x / d) and r = round((x - d q) / (d / 256)), clamped to +-127 (to nearest even). The
// residual term makes the activations ~15-bit (their rounding error 1/256 of int8's), at a
// second dot product per weight, while the weights stay bytes; s = d (sum(q) + sum(r) / 256).
// The same for a row whatever rows share the call.
struct QuantizedRows {
  std::vector<int8_t> q;  // [M, K]
  std::vector<int8_t> r;  // [M, K]
  std::vector<float> dx;  // [M, K / 32]: d / 256
  std::vector<float> s;   // [M, K / 32]
  std::vector<float> X;   // [M, K]: 256 q + r (exact), for the float path only
  std::vector<int16_t> X16;  // [M, K]: 256 q + r, for 8-bit weights only
};

// The calling thread's QuantizedRows, reused by its every call (no allocation a call; a call
// never nests in another on one thread). Taken as a reference before a parallel region: its
// threads must read the caller's, not their own thread_local ones.
static inline QuantizedRows& callers_rows() {
  thread_local QuantizedRows rows;
  return rows;
}

// VW int32 lanes, each within int16's range, as VW int16.
static inline __attribute__((always_inline)) void store_words(int16_t* p, vi v) {
#if VW == 16
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)v));
#else
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packs_epi32(_mm256_castsi256_si128((__m256i)v),
                                   _mm256_extracti128_si256((__m256i)v, 1)));
#endif
}

// The sum of v's lanes (exact: integers).
static inline __attribute__((always_inline)) int hsum_int(vi v) {
#if VW == 16
  const __m256i a = _mm256_add_epi32(_mm512_castsi512_si256((__m512i)v),
                                     _mm512_extracti64x4_epi64((__m512i)v, 1));
#else
  const __m256i a = (__m256i)v;
#endif
  __m128i b = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, _MM_SHUFFLE(1, 0, 3, 2)));
  b = _mm_add_epi32(b, _mm_shuffle_epi32(b, _MM_SHUFFLE(2, 3, 0, 1)));
  return _mm_cvtsi128_si32(b);
}

static void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out,
                          bool floats, bool words = false) {
  constexpr int BV = QK / VW;  // vectors per block
  const int64_t nb = K / QK;
  out.q.resize(M * K);
  out.r.resize(M * K);
  out.dx.resize(M * nb);
  out.s.resize(M * nb);
  out.X.resize(floats ? M * K : 0);
  out.X16.resize(words ? M * K : 0);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0 * K; i < r1 * K; i += QK) {
      vf xv[BV], amax{};
      for (int v = 0; v < BV; ++v) {
        xv[v] = loadv(x + i + v * VW);
        const vf a = (vf)((vi)xv[v] & 0x7fffffff);
        amax = amax > a ? amax : a;
      }
      const float am = hmax(amax);
      const float d = am / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      vi sum{};
      for (int v = 0; v < BV; ++v) {
        const vf q = round_even(xv[v] * id);
        vf res = round_even((xv[v] - d * q) * (id * 256.f));
        res = res < -127.f ? -127.f : res;
        res = res > 127.f ? 127.f : res;
        const vi qi = __builtin_convertvector(q, vi), ri = __builtin_convertvector(res, vi);
        store_bytes(out.q.data() + i + v * VW, qi);
        store_bytes(out.r.data() + i + v * VW, ri);
        sum += 256 * qi + ri;
        if (floats) storev(out.X.data() + i + v * VW, 256.f * q + res);
        if (words) store_words(out.X16.data() + i + v * VW, 256 * qi + ri);
      }
      out.dx[i / QK] = d / 256.f;
      out.s[i / QK] = d / 256.f * static_cast<float>(hsum_int(sum));
    }
  });
}

// R rows times one panel into y (row stride ldy; `cols` valid columns). Per block and lane the
// integer sum 256 dot(q_w, q) + dot(q_w, r) is exact (|sum| < 2^24, so exact as a float too);
// then acc += float(sum) * (d_w * d_x / 256) and acc += m_w * s_x, in that order, the same for
// a row in any tile.
template <class L, int R>
static __attribute__((noinline)) void tile(const QuantizedRows& xq, int64_t row, int64_t K,
                                           const uint8_t* panel, float* y, int64_t ldy,
                                           int64_t cols) {
  const int64_t nb = K / QK;
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* quants = L::quants(panel, b);
    prefetch(quants + PREFETCH * L::BYTES * NR * QK / L::K, L::BYTES * NR * QK / L::K);
    vq dots[R][NV], rdots[R][NV];  // with q, with r
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) dots[i][v] = rdots[i][v] = zero();
    const int8_t* xs = xq.q.data() + row * K + b * QK;
    const int8_t* rs = xq.r.data() + row * K + b * QK;
    for (int g = 0; g < 4; ++g)  // byte (c, j) of group g: rows 4g + j (low), 16 + 4g + j
      for (int v = 0; v < NV; ++v) {
        vq lo, hi;
        nibbles(loadq(quants + (g * NR + v * VW) * 4), lo, hi);
        for (int i = 0; i < R; ++i) {
          int32_t xl, xh, rl, rh;
          std::memcpy(&xl, xs + i * K + 4 * g, 4);
          std::memcpy(&xh, xs + i * K + 16 + 4 * g, 4);
          std::memcpy(&rl, rs + i * K + 4 * g, 4);
          std::memcpy(&rh, rs + i * K + 16 + 4 * g, 4);
          dots[i][v] = dot(dot(dots[i][v], lo, xl), hi, xh);
          rdots[i][v] = dot(dot(rdots[i][v], lo, rl), hi, rh);
        }
      }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) dots[i][v] = combine(dots[i][v], rdots[i][v]);
    for (int v = 0; v < NV; ++v) {
      const vf d = L::scale(panel, b, 0, v), m = L::offset(panel, b, v);
      for (int i = 0; i < R; ++i)
        acc[i][v] = flush(acc[i][v], to_float(dots[i][v]), d, m, xq.dx[(row + i) * nb + b],
                          xq.s[(row + i) * nb + b]);
    }
  }
  for (int i = 0; i < R; ++i) store_row(y + i * ldy, acc[i], cols);
}

// The float path, for many rows on a machine without VNNI (whose maddubs runs at half its
// FMA's rate): the same block sums, computed by FMAs on exact integer-valued floats. A panel's
// quants as floats 0..15 ([K][NR], a thread's scratch) times X = 256 q + r per activation:
// every product (< 2^19) and partial sum (< 2^24) of a block is an integer below 2^24, exact
// in fp32 in any order, and the block's flush is the integer kernel's. Bit-identical results.
#if VW == 16
constexpr int FR = 4;  // rows per float tile: 2 FR NV accumulators in registers
#else
constexpr int FR = 6;
#endif

static inline __attribute__((always_inline)) vf low_nibble(vq raw, int shift) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(
      _mm512_and_si512(_mm512_srli_epi32(raw, shift), _mm512_set1_epi32(0x0F)));
#else
  return (vf)_mm256_cvtepi32_ps(
      _mm256_and_si256(_mm256_srli_epi32(raw, shift), _mm256_set1_epi32(0x0F)));
#endif
}

// A panel's quants as floats [K][NR]: per group g and column, byte j's nibbles are rows 4g + j
// (low) and 16 + 4g + j (high) of the block.
template <class L>
static void panel_quants(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* quants = L::quants(panel, b);
    float* rows = out + b * QK * NR;
    for (int g = 0; g < 4; ++g)
      for (int v = 0; v < NV; ++v) {
        const vq raw = loadq(quants + (g * NR + v * VW) * 4);  // lane: a column's 4 bytes
        for (int j = 0; j < 4; ++j) {
          storev(rows + (4 * g + j) * NR + v * VW, low_nibble(raw, 8 * j));
          storev(rows + (16 + 4 * g + j) * NR + v * VW, low_nibble(raw, 8 * j + 4));
        }
      }
  }
}

// R rows of X [., K] (see above) times one panel, its quants as floats in wq.
template <class L, int R>
static __attribute__((noinline)) void float_tile(const QuantizedRows& xq,
                                                 int64_t row, int64_t K, const uint8_t* panel,
                                                 const float* wq, float* y, int64_t ldy,
                                                 int64_t cols) {
  const int64_t nb = K / QK;
  const float* X = xq.X.data();
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    vf sums[R][NV];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) sums[i][v] = vf{};
    for (int64_t k = b * QK; k < (b + 1) * QK; ++k) {
      vf w[NV];
      for (int v = 0; v < NV; ++v) w[v] = loadv(wq + k * NR + v * VW);
      for (int i = 0; i < R; ++i) {
        const float xi = X[(row + i) * K + k];
        for (int v = 0; v < NV; ++v) sums[i][v] += xi * w[v];
      }
    }
    for (int v = 0; v < NV; ++v) {
      const vf d = L::scale(panel, b, 0, v), m = L::offset(panel, b, v);
      for (int i = 0; i < R; ++i)
        acc[i][v] = flush(acc[i][v], sums[i][v], d, m, xq.dx[(row + i) * nb + b],
                          xq.s[(row + i) * nb + b]);
    }
  }
  for (int i = 0; i < R; ++i) store_row(y + i * ldy, acc[i], cols);
}

// Rows from which `linear` takes the float path (-1: never; with VNNI, dpbusd's 4 products
// per lane beat FMAs).
constexpr int64_t FLOAT_ROWS = VNNI ? -1 : 16;

// A range of panels [front, back) that its owner takes from the front and others from the
// back, both ends in one word (front in the low 32 bits).
struct alignas(64) PanelRange {
  std::atomic<uint64_t> ends{0};
};
static inline uint64_t range_of(uint64_t front, uint64_t back) { return front | back << 32; }
// A panel from r's front (FRONT) or back, or -1: none left.
template <bool FRONT>
static inline int64_t take_panel(PanelRange& r) {
  uint64_t cur = r.ends.load(std::memory_order_relaxed);
  for (;;) {
    const uint64_t front = cur & 0xffffffffu, back = cur >> 32;
    if (front >= back) return -1;
    const uint64_t next = FRONT ? range_of(front + 1, back) : range_of(front, back - 1);
    if (r.ends.compare_exchange_weak(cur, next, std::memory_order_relaxed))
      return static_cast<int64_t>(FRONT ? front : back - 1);
  }
}

// fn(p) for every panel p < P. Each thread streams one contiguous range of panels, so that the
// weights come from memory as one sequential run per thread (where threads took runs of two
// panels in turn, a decode step's one-row calls took 25-30% longer); a thread done with its own
// takes panels from the back of the others' (a thread that loses its core leaves the rest).
template <class F>
static void each_panel(int64_t P, F&& fn) {
  const int64_t T = std::min<int64_t>(at::get_num_threads(), P);
  constexpr int64_t ON_STACK = 16;  // a call's range words: on the stack for up to 16 threads
  PanelRange stack[ON_STACK];
  std::vector<PanelRange> heap(T > ON_STACK ? T : 0);
  PanelRange* ranges = T > ON_STACK ? heap.data() : stack;
  for (int64_t t = 0; t < T; ++t) ranges[t].ends.store(range_of(t * P / T, (t + 1) * P / T));
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      for (int64_t p; (p = take_panel<true>(ranges[t])) >= 0;) fn(p);
      for (int64_t u = 1; u < T; ++u)
        for (int64_t p; (p = take_panel<false>(ranges[(t + u) % T])) >= 0;) fn(p);
    }
  });
}

// x [M, K] contiguous f32; packed [P, K / L::K, NR * L::BYTES] uint8 -> y [M, N]: the integer
// kernel, or from `float_rows` rows on (-1: never) the float path.
template <class L>
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N, int64_t float_rows) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const bool floats = float_rows >= 0 && M >= float_rows;
  QuantizedRows& xq = callers_rows();
  quantize_rows(x.data_ptr<float>(), M, K, xq, floats);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = K / L::K * L::BYTES * NR;
  each_panel(P, [&](int64_t p) {
    const int64_t cols = std::min<int64_t>(NR, N - p * NR);
    const uint8_t* panel = wp + p * panel_bytes;
    if (!floats) {
      for (int64_t m = 0; m < M; m += TR)
        with_rows<TR>(std::min<int64_t>(TR, M - m), [&]<int R>() {
          tile<L, R>(xq, m, K, panel, yp + m * N + p * NR, N, cols);
        });
      return;
    }
    thread_local std::vector<float> scratch;  // a panel's quants as floats (fully rewritten)
    if (scratch.size() < static_cast<size_t>(K * NR)) scratch.resize(K * NR);
    panel_quants<L>(panel, K, scratch.data());
    for (int64_t m = 0; m < M; m += FR)
      with_rows<FR>(std::min<int64_t>(FR, M - m), [&]<int R>() {
        float_tile<L, R>(xq, m, K, panel, scratch.data(), yp + m * N + p * NR, N, cols);
      });
  });
  return y;
}

}  // namespace cpu_q4i8
