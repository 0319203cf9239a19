// The C++ kernels behind kernels/cpu_qlinear.py's 4-bit formats (see its docstring): 4-bit
// weights times int8 activations in integer dot products; bound through cpu_qlinear.h.
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

constexpr int QK = 32;     // weights per block along K
constexpr int BYTES = 20;  // per column and block: d, m (fp16), 16 bytes of quants
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
constexpr int64_t CHUNK = 2;  // panels a thread takes at a time

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

// acc (int32 lanes) += per lane the dot product of its 4 weight bytes (unsigned) with the 4
// activations x4 (signed). Without a VNNI instruction: pairs into int16 (at most 2 * 15 * 128, no
// saturation), then into int32.
static inline __attribute__((always_inline)) vq dot(vq acc, vq w, int32_t x4) {
#if VW == 16 && defined(__AVX512VNNI__)
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(x4));
#elif VW == 16
  const vq pairs = _mm512_maddubs_epi16(w, _mm512_set1_epi32(x4));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(acc, w, _mm256_set1_epi32(x4));
#else
  const vq pairs = _mm256_maddubs_epi16(w, _mm256_set1_epi32(x4));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

static inline __attribute__((always_inline)) vf to_float(vq v) {
#if VW == 16
  return (vf)_mm512_cvtepi32_ps(v);
#else
  return (vf)_mm256_cvtepi32_ps(v);
#endif
}

static inline __attribute__((always_inline)) vq shift8(vq v) {  // v * 256 per int32 lane
#if VW == 16
  return _mm512_slli_epi32(v, 8);
#else
  return _mm256_slli_epi32(v, 8);
#endif
}

static inline __attribute__((always_inline)) vq add32(vq a, vq b) {
#if VW == 16
  return _mm512_add_epi32(a, b);
#else
  return _mm256_add_epi32(a, b);
#endif
}

static inline __attribute__((always_inline)) vq zero() {
#if VW == 16
  return _mm512_setzero_si512();
#else
  return _mm256_setzero_si256();
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
  std::vector<float> d;   // [M, K / 32]
  std::vector<float> s;   // [M, K / 32]
};

static void quantize_rows(const float* x, int64_t M, int64_t K, QuantizedRows& out) {
  const int64_t nb = K / QK;
  out.q.resize(M * K);
  out.r.resize(M * K);
  out.d.resize(M * nb);
  out.s.resize(M * nb);
  at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * K + b * QK;
        float amax = 0.f;
        for (int k = 0; k < QK; ++k) amax = std::max(amax, std::fabs(xb[k]));
        const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
        int sum = 0;
        for (int k = 0; k < QK; ++k) {
          const float q = std::nearbyint(xb[k] * id);
          const float res = std::nearbyint((xb[k] - d * q) * id * 256.f);
          const int rq = static_cast<int>(std::clamp(res, -127.f, 127.f));
          out.q[r * K + b * QK + k] = static_cast<int8_t>(q);
          out.r[r * K + b * QK + k] = static_cast<int8_t>(rq);
          sum += 256 * static_cast<int>(q) + rq;
        }
        out.d[r * nb + b] = d;
        out.s[r * nb + b] = d / 256.f * static_cast<float>(sum);
      }
  });
}

// R rows times one panel into y (row stride ldy; `cols` valid columns). Per block and lane the
// integer sum 256 dot(q_w, q) + dot(q_w, r) is exact (|sum| < 2^24, so exact as a float too);
// then acc += float(sum) * (d_w * d_x / 256) and acc += m_w * s_x, in that order, the same for
// a row in any tile.
template <int R>
static __attribute__((noinline)) void tile(const QuantizedRows& xq, int64_t row, int64_t K,
                                           const uint8_t* panel, float* y, int64_t ldy,
                                           int64_t cols) {
  const int64_t nb = K / QK;
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* blk = panel + b * BYTES * NR;
    const uint8_t* quants = blk + 4 * NR;
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
      for (int v = 0; v < NV; ++v) dots[i][v] = add32(shift8(dots[i][v]), rdots[i][v]);
    for (int v = 0; v < NV; ++v) {
      const vf d = load_half(blk + 2 * v * VW), m = load_half(blk + 2 * (NR + v * VW));
      for (int i = 0; i < R; ++i) {
        acc[i][v] += to_float(dots[i][v]) * (d * (xq.d[(row + i) * nb + b] * (1.f / 256)));
        acc[i][v] += m * xq.s[(row + i) * nb + b];
      }
    }
  }
  for (int i = 0; i < R; ++i) store_row(y + i * ldy, acc[i], cols);
}

// x [M, K] contiguous f32; packed [P, K / 32, NR * 20] uint8 -> y [M, N]. Threads take runs of
// CHUNK panels from a shared counter (a thread that loses its core leaves the rest to others).
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  QuantizedRows xq;
  quantize_rows(x.data_ptr<float>(), M, K, xq);
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const int64_t panel_bytes = K / QK * BYTES * NR, chunks = (P + CHUNK - 1) / CHUNK;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;)
      for (int64_t p = c * CHUNK; p < std::min(P, (c + 1) * CHUNK); ++p) {
        const int64_t cols = std::min<int64_t>(NR, N - p * NR);
        for (int64_t m = 0; m < M; m += TR)
          with_rows<TR>(std::min<int64_t>(TR, M - m), [&]<int R>() {
            tile<R>(xq, m, K, wp + p * panel_bytes, yp + m * N + p * NR, N, cols);
          });
      }
  });
  return y;
}

}  // namespace cpu_q4i8
