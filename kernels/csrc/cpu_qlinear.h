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

// A panel's block: NR fp16 scales d, then 32 rows of NR int8 quants.
struct Block {
  const uint8_t* bytes = nullptr;
  vf d[NV];
  Block() = default;
  explicit Block(const uint8_t* blk) : bytes(blk) {
    for (int v = 0; v < NV; ++v) d[v] = load_half(blk + 2 * v * VW);
  }
  // The weights w[NV] of row k (0..31): d q. The product is exact in fp32 (an 11-bit by an
  // 8-bit integer): the same fp32 weight as the dequantized file.
  inline __attribute__((always_inline)) void weights(int k, vf* w) const {
    const uint8_t* q = bytes + 2 * NR + k * NR;
    for (int v = 0; v < NV; ++v) {
      w[v] = d[v] * __builtin_convertvector(load_i8(q + v * VW), vf);
      // The weight as a value of its own: -ffast-math would otherwise be free to reassociate
      // x (d q) into (x d) q, which rounds differently.
      asm("" : "+v"(w[v]));
    }
  }
};

// R rows of x times PN consecutive panels, dequantized in registers, into y (row stride ldy;
// `cols` valid columns in the last panel). Per lane the same sequential sum over k as
// cpu_linear's tiles, over the same fp32 weights: bit-identical to them.
template <int R, int PN>
static __attribute__((noinline)) void qtile(const float* x, int64_t ldx, const uint8_t* panel,
                                            int64_t panel_bytes, int64_t K, float* y,
                                            int64_t ldy, int64_t cols) {
  vf acc[PN][R][NV];
  for (int q = 0; q < PN; ++q)
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) acc[q][i][v] = vf{};
  for (int64_t b = 0; b < K / QK; ++b) {
    Block blk[PN];
    for (int q = 0; q < PN; ++q) blk[q] = Block(panel + q * panel_bytes + b * Q8_0 * NR);
    for (int k = 0; k < QK; ++k)
      for (int q = 0; q < PN; ++q) {
        vf w[NV];
        blk[q].weights(k, w);
        for (int i = 0; i < R; ++i) {
          const float xi = x[i * ldx + b * QK + k];
          for (int v = 0; v < NV; ++v) acc[q][i][v] += xi * w[v];
        }
      }
  }
  for (int q = 0; q < PN; ++q)
    for (int i = 0; i < R; ++i)
      store_row(y + i * ldy + q * NR, acc[q][i], q + 1 < PN ? NR : cols);
}

// One panel's fp32 weights [K][NR] into out, as cpu_linear's panels hold them.
static void dequantize_panel(const uint8_t* panel, int64_t K, float* out) {
  for (int64_t b = 0; b < K / QK; ++b) {
    const Block blk(panel + b * Q8_0 * NR);
    for (int k = 0; k < QK; ++k) {
      vf w[NV];
      blk.weights(k, w);
      for (int v = 0; v < NV; ++v) storev(out + (b * QK + k) * NR + v * VW, w[v]);
    }
  }
}

// Threads take runs of CHUNK panels from a shared counter rather than one fixed range each:
// on a machine whose cores also run the server's event loop, a thread that loses its core for a
// while leaves its remaining panels to the others instead of holding them all up at the end.
static void run(const float* xp, const uint8_t* wp, float* yp, int64_t M, int64_t N, int64_t K,
                int64_t P) {
  const int64_t panel_bytes = K / QK * Q8_0 * NR;
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
        qtile<1, ROW_PANELS>(xp, K, wp + p * panel_bytes, panel_bytes, K, yp + p * NR, N, NR);
        continue;
      }
      for (; p < p1; ++p) {
        const int64_t cols = std::min<int64_t>(NR, N - p * NR);
        const uint8_t* panel = wp + p * panel_bytes;
        if (M <= REG_ROWS) {
          with_rows<REG_ROWS>(M, [&]<int R>() {
            qtile<R, 1>(xp, K, panel, panel_bytes, K, yp + p * NR, N, cols);
          });
          continue;
        }
        dequantize_panel(panel, K, scratch.data());
        for (int64_t m = 0; m < M; m += MR)
          with_rows<MR>(std::min<int64_t>(MR, M - m), [&]<int R>() {
            cpu_linear::tile<R>(xp + m * K, K, scratch.data(), K, yp + m * N + p * NR, N, cols,
                                nullptr, 0);
          });
      }
    }
  });
}

// x [M, K] contiguous f32; packed [P, K / 32, NR * bytes] uint8 (kernels/cpu_qlinear.py) ->
// y [M, N]: Q8_0 here, the 4-bit formats in cpu_q4i8.
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N,
                     int64_t float_rows = cpu_q4i8::FLOAT_ROWS) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == torch::kUInt8 && packed.dim() == 3 &&
                  packed.size(1) * QK == K && (N + NR - 1) / NR == P &&
                  packed.size(2) % NR == 0,
              "qlinear: packed weight does not match x or N");
  const int64_t format = packed.size(2) / NR;
  if (format == cpu_q4i8::BYTES) return cpu_q4i8::linear(x, packed, N, float_rows);
  TORCH_CHECK(format == Q8_0, "qlinear: no format of ", format, " bytes per block");
  auto y = torch::empty({M, N}, x.options());
  if (M > 0)
    run(x.data_ptr<float>(), packed.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, K, P);
  return y;
}

// cpu_linear's panels for x [M, K] f32, or the quantized ones.
inline torch::Tensor any_linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  return packed.scalar_type() == torch::kUInt8 ? linear(x, packed, N)
                                               : cpu_linear::linear(x, packed, N);
}

}  // namespace cpu_qlinear
