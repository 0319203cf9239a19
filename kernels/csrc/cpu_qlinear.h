// The C++ kernels behind kernels/cpu_qlinear.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "simd.h"
#include "cpu_linear.h"
#include "cpu_q4i8.h"

namespace cpu_qlinear {

using cpu_linear::NR;
using cpu_linear::NV;

constexpr int QK = 32;  // weights per block along K
// A packed format is named by its bytes per column and packed block: the 8-bit ones run here,
// the 4-bit ones in cpu_q4i8, on the layouts cpu_q4i8 defines.
using Q8Block = cpu_q4i8::PerBlock<32, false>;  // Q8_0, and Q5_0 with its quants less 16
using Q8Offset = cpu_q4i8::PerBlock<32, true>;  // Q5_1
using Q5Super = cpu_q4i8::SuperBlock<32>;       // Q5_K
// Q6_K (w = d sc (q - 32) per sub-block of 16): per block of 256 the file's fp16 d and its 16
// int8 sc, then the quants less 32 as int8: 274 bytes per column (the file's 210 with the
// 6-bit quants widened to bytes). A sub-block's scale is d sc, an exact fp32 product.
struct Q6Super {
  static constexpr bool OFFSET = false;
  static constexpr int64_t BYTES = 2 + 16 + 256;
  static constexpr int64_t K = 8 * QK;
  static constexpr int SUBS = 2;
  static const uint8_t* quants(const uint8_t* panel, int64_t b) {
    return panel + (b / 8) * BYTES * NR + 18 * NR + (b % 8) * 32 * NR;
  }
  static vf scale(const uint8_t* panel, int64_t b, int s, int v) {
    const uint8_t* sb = panel + (b / 8) * BYTES * NR;
    return load_half(sb + 2 * v * VW) *
           cpu_q4i8::load_bytes<true>(sb + (2 + 2 * (b % 8) + s) * NR + v * VW);
  }
  static vf offset(const uint8_t*, int64_t, int) { return vf{}; }
};
using cpu_q4i8::QuantizedRows;
using cpu_q4i8::vq;
constexpr int TR = cpu_q4i8::TR;

// VW columns' two quants each (rows 2p and 2p + 1 of a block) as 2 VW int16 lanes.
static inline __attribute__((always_inline)) vq load_pairs(const uint8_t* p) {
#if VW == 16
  return _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// acc (int32 lanes) += per lane its two int16 weights times the two int16 activations x2.
static inline __attribute__((always_inline)) vq dot_pairs(vq acc, vq w, int32_t x2) {
#if VW == 16 && defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(acc, w, _mm512_set1_epi32(x2));
#elif VW == 16
  return _mm512_add_epi32(acc, _mm512_madd_epi16(w, _mm512_set1_epi32(x2)));
#elif defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(acc, w, _mm256_set1_epi32(x2));
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(w, _mm256_set1_epi32(x2)));
#endif
}

// R rows times one panel into y (row stride ldy; `cols` valid columns). A block's 16 pairs of
// rows: NR columns x 2 quants each. Per sub-block and lane the integer sum of q_w (256 q + r)
// is exact in int32 (|sum| <= 32 * 128 * 32,639); then acc += float(sum) (d_w d_x / 256), sub-
// block by sub-block, the same for a row in any tile.
template <class L, int R>
static __attribute__((noinline)) void q8_tile(const QuantizedRows& xq, int64_t row, int64_t K,
                                           const uint8_t* panel, float* y, int64_t ldy,
                                           int64_t cols) {
  const int64_t nb = K / QK;
  const int16_t* X = xq.X16.data();
  vf acc[R][NV];
  for (int i = 0; i < R; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
  for (int64_t b = 0; b < nb; ++b) {
    constexpr int S = L::SUBS;
    constexpr int64_t AVG = L::BYTES * NR * QK / L::K;  // bytes per block of 32, on average
    const uint8_t* quants = L::quants(panel, b);
    cpu_q4i8::prefetch(quants + cpu_q4i8::PREFETCH * AVG, AVG);
    vq sums[S][R][NV];
    for (int s = 0; s < S; ++s)
      for (int i = 0; i < R; ++i)
        for (int v = 0; v < NV; ++v) sums[s][i][v] = cpu_q4i8::zero();
    for (int s = 0; s < S; ++s)
      for (int p = s * QK / 2 / S; p < (s + 1) * QK / 2 / S; ++p)
        for (int v = 0; v < NV; ++v) {
          const vq w = load_pairs(quants + (p * NR + v * VW) * 2);
          for (int i = 0; i < R; ++i) {
            int32_t x2;
            std::memcpy(&x2, X + (row + i) * K + b * QK + 2 * p, 4);
            sums[s][i][v] = dot_pairs(sums[s][i][v], w, x2);
          }
        }
    for (int v = 0; v < NV; ++v)
      for (int s = 0; s < S; ++s) {
        const vf d = L::scale(panel, b, s, v);
        const vf m = L::offset(panel, b, v);
        for (int i = 0; i < R; ++i)
          acc[i][v] = cpu_q4i8::flush(acc[i][v], cpu_q4i8::to_float(sums[s][i][v]), d, m,
                                      xq.dx[(row + i) * nb + b],
                                      L::OFFSET ? xq.s[(row + i) * nb + b] : 0.f);
      }
  }
  for (int i = 0; i < R; ++i) store_row(y + i * ldy, acc[i], cols);
}

template <class L>
static void run(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t N, int64_t K,
                int64_t P) {
  QuantizedRows& xq = cpu_q4i8::callers_rows();
  cpu_q4i8::quantize_rows(xp, M, K, xq, false, true);
  const int64_t panel_bytes = K / L::K * L::BYTES * NR;
  cpu_q4i8::each_panel(P, [&](int64_t p) {
    const int64_t cols = std::min<int64_t>(NR, N - p * NR);
    for (int64_t m = 0; m < M; m += TR)
      with_rows<TR>(std::min<int64_t>(TR, M - m), [&]<int R>() {
        q8_tile<L, R>(xq, m, K, wp + p * panel_bytes, yp + m * N + p * NR, N, cols);
      });
  });
}

// Weights per packed block of a format (by its bytes per column and block), or 0: unknown.
static int64_t block_weights(int64_t format) {
  for (int64_t f : {cpu_q4i8::Q4Block::BYTES, Q8Block::BYTES, Q8Offset::BYTES})
    if (format == f) return QK;
  for (int64_t f : {cpu_q4i8::Q4Super::BYTES, Q6Super::BYTES, Q5Super::BYTES})
    if (format == f) return 8 * QK;
  return 0;
}

// x [M, K] contiguous f32; packed [P, K / block weights, NR * bytes] uint8
// (kernels/cpu_qlinear.py) -> y [M, N]: the 8-bit layouts here, the 4-bit ones in cpu_q4i8.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                     int64_t float_rows = cpu_q4i8::FLOAT_ROWS) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 &&
                  (N + NR - 1) / NR == P && packed.size(2) % NR == 0,
              "qlinear: packed weight does not match N");
  const int64_t format = packed.size(2) / NR;
  TORCH_CHECK(block_weights(format) > 0, "qlinear: no format of ", format, " bytes per block");
  TORCH_CHECK(packed.size(1) * block_weights(format) == K, "qlinear: packed weight does not match x");
  if (format == cpu_q4i8::Q4Block::BYTES)
    return cpu_q4i8::linear<cpu_q4i8::Q4Block>(x, packed, N, float_rows);
  if (format == cpu_q4i8::Q4Super::BYTES)
    return cpu_q4i8::linear<cpu_q4i8::Q4Super>(x, packed, N, float_rows);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  if (format == Q8Block::BYTES)
    run<Q8Block>(xp, wp, yp, M, N, K, P);
  else if (format == Q8Offset::BYTES)
    run<Q8Offset>(xp, wp, yp, M, N, K, P);
  else if (format == Q6Super::BYTES)
    run<Q6Super>(xp, wp, yp, M, N, K, P);
  else
    run<Q5Super>(xp, wp, yp, M, N, K, P);
  return y;
}

// cpu_linear's panels for x [M, K] f32, or the quantized ones.
inline torch::Tensor any_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed.scalar_type() == torch::kUInt8 ? linear(x, packed, N)
                                               : cpu_linear::linear(x, packed, N);
}

}  // namespace cpu_qlinear
