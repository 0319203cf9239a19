// The C++ kernels behind kernels/cpu_qlinear.py (see its docstring); bound in module.cpp.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "simd.h"
#include "cpu_linear.h"
#include "cpu_q4i8.h"

namespace cpu_qlinear {

using cpu_linear::MR;
using cpu_linear::NR;
using cpu_linear::NV;

constexpr int QK = 32;  // weights per block along K
// A packed format is named by its bytes per column and block of 32 weights: Q8_0's blocks run
// here; the 4-bit ones (Q4_0 and Q4_1, both packed as d, m and 16 bytes) in cpu_q4i8.
constexpr int Q8_0 = 34;
// Rows of x up to which the weights are dequantized in registers (each weight once per tile of
// rows); above, a panel is dequantized once into a thread's scratch and cpu_linear's tiles run
// over it.
constexpr int REG_ROWS = 4;
constexpr int ROW_PANELS = 2;

// VW bytes widened to VW int32 lanes (vpmovsxbd: GCC's generic conversion of a byte vector is
// scalar code).
static inline __attribute__((always_inline)) vi load_i8(const uint8_t* p) {
#if VW == 16
  return (vi)_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return (vi)_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#endif
}

static inline __attribute__((always_inline)) vf load_half(const uint8_t* p) {
#if VW == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#else
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#endif
}

// One block's scales of one panel, per output column.
template <int F>
struct Scales {
  vf d[NV];
  void load(const uint8_t* blk) {
    for (int v = 0; v < NV; ++v) d[v] = load_half(blk + 2 * v * VW);
  }
};

// The weights w[NV] of row k (0..31) of a panel's block: d q. The product is exact in fp32 (an
// 11-bit by an 8-bit integer): the same fp32 weight as the dequantized file.
template <int F>
static inline __attribute__((always_inline)) void weights(const uint8_t* blk, const Scales<F>& s,
                                                          int k, vf* w) {
  const uint8_t* q = blk + 2 * NR;
  for (int v = 0; v < NV; ++v) {
    w[v] = s.d[v] * __builtin_convertvector(load_i8(q + k * NR + v * VW), vf);
    // The weight as a value of its own: -ffast-math would otherwise be free to reassociate
    // x (d q) into (x d) q, which rounds differently.
    asm("" : "+v"(w[v]));
  }
}

// R rows of x times PN consecutive panels, dequantized in registers, into y (row stride ldy;
// `cols` valid columns in the last panel). Per lane the same sequential sum over k as
// cpu_linear's tiles, over the same fp32 weights: bit-identical to them.
template <int F, int R, int PN>
static __attribute__((noinline)) void qtile(const float* x, int64_t ldx, const uint8_t* panel,
                                            int64_t panel_bytes, int64_t K, float* y,
                                            int64_t ldy, int64_t cols) {
  vf acc[PN][R][NV];
  for (int q = 0; q < PN; ++q)
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) acc[q][i][v] = vf{};
  const int64_t blocks = K / QK;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* blk[PN];
    for (int q = 0; q < PN; ++q) blk[q] = panel + q * panel_bytes + b * F * NR;
    Scales<F> s[PN];
    for (int q = 0; q < PN; ++q) s[q].load(blk[q]);
    for (int k = 0; k < QK; ++k) {
      for (int q = 0; q < PN; ++q) {
        vf w[NV];
        weights<F>(blk[q], s[q], k, w);
        for (int i = 0; i < R; ++i) {
          const float xi = x[i * ldx + b * QK + k];
          for (int v = 0; v < NV; ++v) acc[q][i][v] += xi * w[v];
        }
      }
    }
  }
  for (int q = 0; q < PN; ++q)
    for (int i = 0; i < R; ++i) {
      const int64_t c_end = q + 1 < PN ? NR : cols;
      if (c_end == NR) {
        for (int v = 0; v < NV; ++v) storev(y + i * ldy + q * NR + v * VW, acc[q][i][v]);
      } else {
        for (int64_t c = 0; c < c_end; ++c) y[i * ldy + q * NR + c] = acc[q][i][c / VW][c % VW];
      }
    }
}

template <int F, int R>
static void qtile_of(int64_t rows, const float* x, int64_t ldx, const uint8_t* panel,
                     int64_t panel_bytes, int64_t K, float* y, int64_t ldy, int64_t cols) {
  if constexpr (R > 0) {
    if (rows == R) return qtile<F, R, 1>(x, ldx, panel, panel_bytes, K, y, ldy, cols);
    qtile_of<F, R - 1>(rows, x, ldx, panel, panel_bytes, K, y, ldy, cols);
  }
}

// One panel's fp32 weights [K][NR] into out, as cpu_linear's panels hold them.
template <int F>
static void dequantize_panel(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const uint8_t* blk = panel + b * F * NR;
    Scales<F> s;
    s.load(blk);
    for (int k = 0; k < QK; ++k) {
      vf w[NV];
      weights<F>(blk, s, k, w);
      for (int v = 0; v < NV; ++v) storev(out + (b * QK + k) * NR + v * VW, w[v]);
    }
  }
}

// Threads take runs of CHUNK panels from a shared counter rather than one fixed range each:
// on a machine whose cores also run the server's event loop, a thread that loses its core for a
// while leaves its remaining panels to the others instead of holding them all up at the end.
template <int F>
static void run(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t N, int64_t K,
                int64_t P) {
  const int64_t panel_bytes = K / QK * F * NR;
  constexpr int64_t CHUNK = ROW_PANELS;
  const int64_t chunks = (P + CHUNK - 1) / CHUNK;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), chunks), 1, [&](int64_t, int64_t) {
    // One panel's fp32 weights per thread, reused across calls (not zeroed: fully written).
    thread_local std::vector<float> scratch;
    if (M > REG_ROWS && scratch.size() < static_cast<size_t>(K * NR)) scratch.resize(K * NR);
    for (int64_t c; (c = next.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
      int64_t p = c * CHUNK;
      const int64_t p1 = std::min(P, p + CHUNK);
      if (M == 1 && p1 - p == ROW_PANELS && p1 * NR <= N) {
        qtile<F, 1, ROW_PANELS>(xp, K, wp + p * panel_bytes, panel_bytes, K, yp + p * NR, N, NR);
        continue;
      }
      for (; p < p1; ++p) {
        const int64_t cols = std::min<int64_t>(NR, N - p * NR);
        if (M <= REG_ROWS) {
          qtile_of<F, REG_ROWS>(M, xp, K, wp + p * panel_bytes, panel_bytes, K, yp + p * NR, N,
                                cols);
          continue;
        }
        dequantize_panel<F>(wp + p * panel_bytes, K, scratch.data());
        for (int64_t m = 0; m < M; m += MR)
          cpu_linear::tile_of<MR>(std::min<int64_t>(MR, M - m), xp + m * K, K, scratch.data(),
                                  K, yp + m * N + p * NR, N, cols, nullptr, 0);
      }
    }
  });
}

// x [M, K] contiguous f32; packed [P, K / 32, NR * F] uint8 (kernels/cpu_qlinear.py) -> y [M, N].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 &&
                  packed.size(1) * QK == K && (N + NR - 1) / NR == P &&
                  packed.size(2) % NR == 0,
              "qlinear: packed weight does not match x or N");
  const int64_t format = packed.size(2) / NR;
  if (format == cpu_q4i8::BYTES) return cpu_q4i8::linear(x, packed, N);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const uint8_t* wp = packed.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  switch (format) {
    case Q8_0: run<Q8_0>(xp, wp, yp, M, N, K, P); break;
    default: TORCH_CHECK(false, "qlinear: no format of ", format, " bytes per block");
  }
  return y;
}

// cpu_linear's panels for x [M, K] f32, or the quantized ones.
inline torch::Tensor any_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed.scalar_type() == torch::kUInt8 ? linear(x, packed, N)
                                               : cpu_linear::linear(x, packed, N);
}

}  // namespace cpu_qlinear
