// The C++ kernels behind kernels/cpu_linear.py (see its docstring); bound in module.cpp.
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

namespace cpu_linear {

#if VW == 16
constexpr int NV = 3, MR = 8;
constexpr int64_t MAX_ROWS = -1;  // any number
constexpr int64_t KC = 0;         // K summed in one run
#else
constexpr int NV = 2, MR = 6;
constexpr int64_t MAX_ROWS = 64;
// K summed in runs of KC, the runs' sums then added in order: oneDNN's order (AVX2), which
// takes the calls of more than MAX_ROWS rows, so that a row's result is the same whichever
// of the two computed it (shared/model/linear.py checks each weight's sums agree).
constexpr int64_t KC = 1024;
#endif
// The runs of k: [k0, run_end(k0, K)), from k0 = 0 in steps of KC.
static inline int64_t run_end(int64_t k0, int64_t K) {
  return KC == 0 ? K : std::min(K, k0 + KC);
}
constexpr int NR = NV * VW;  // output columns per panel
constexpr int ROW_PANELS = 4;

// One row of x times PN whole consecutive panels (more independent loads in flight than one
// panel gives a single row); the same per-lane arithmetic as `tile`.
template <int PN>
static __attribute__((noinline)) void row_panels(const float* x, const float* panel, int64_t K,
                                                 float* y) {
  vf sum[PN][NV];
  for (int64_t k0 = 0; k0 < K; k0 = run_end(k0, K)) {
    vf acc[PN][NV];
    for (int q = 0; q < PN; ++q)
      for (int v = 0; v < NV; ++v) acc[q][v] = vf{};
    for (int64_t k = k0; k < run_end(k0, K); ++k) {
      const float xk = x[k];
      for (int q = 0; q < PN; ++q)
        for (int v = 0; v < NV; ++v) acc[q][v] += xk * loadv(panel + (q * K + k) * NR + v * VW);
    }
    for (int q = 0; q < PN; ++q)
      for (int v = 0; v < NV; ++v) sum[q][v] = k0 == 0 ? acc[q][v] : sum[q][v] + acc[q][v];
  }
  for (int q = 0; q < PN; ++q)
    for (int v = 0; v < NV; ++v) storev(y + q * NR + v * VW, sum[q][v]);
}

// R rows of x (row stride ldx) times one panel [K][NR] into y (row stride ldy, `cols` <= NR
// valid columns); meanwhile `nlines` 64-byte lines from `pf` are prefetched, spread over k.
// Not inlined: every tile height runs the same per-lane arithmetic.
template <int R>
static __attribute__((noinline)) void tile(const float* x, int64_t ldx, const float* panel,
                                           int64_t K, float* y, int64_t ldy, int64_t cols,
                                           const float* pf, int64_t nlines) {
  vf sum[R][NV];
  const int64_t per_k = (nlines + K - 1) / K;
  for (int64_t k0 = 0; k0 < K; k0 = run_end(k0, K)) {
    vf acc[R][NV];
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) acc[i][v] = vf{};
    for (int64_t k = k0; k < run_end(k0, K); ++k) {
      vf w[NV];
      for (int v = 0; v < NV; ++v) w[v] = loadv(panel + k * NR + v * VW);
      for (int64_t j = k * per_k; j < (k + 1) * per_k && j < nlines; ++j)
        __builtin_prefetch(pf + 16 * j, 0, 2);
      for (int i = 0; i < R; ++i) {
        const float xi = x[i * ldx + k];
        for (int v = 0; v < NV; ++v) acc[i][v] += xi * w[v];
      }
    }
    for (int i = 0; i < R; ++i)
      for (int v = 0; v < NV; ++v) sum[i][v] = k0 == 0 ? acc[i][v] : sum[i][v] + acc[i][v];
  }
  for (int i = 0; i < R; ++i) store_row(y + i * ldy, sum[i], cols);
}

// x [M, K] contiguous f32; packed [P, K, NR] f32 -> y [M, N].
torch::Tensor linear(torch::Tensor x, torch::Tensor packed, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1), P = packed.size(0);
  TORCH_CHECK(packed.size(1) == K && packed.size(2) == NR && (N + NR - 1) / NR == P,
              "linear: packed weight does not match x or N");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (M + MR - 1) / MR, lines = K * NR / 16;
  const int64_t per_tile = (lines + tiles - 1) / tiles;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    int64_t p = p0;
    if (M == 1)
      for (; p + ROW_PANELS <= p1 && (p + ROW_PANELS) * NR <= N; p += ROW_PANELS)
        row_panels<ROW_PANELS>(xp, wp + p * K * NR, K, yp + p * NR);
    for (; p < p1; ++p) {
      const int64_t cols = std::min<int64_t>(NR, N - p * NR);
      const float* next = p + 1 < p1 && tiles > 1 ? wp + (p + 1) * K * NR : nullptr;
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m = t * MR, l0 = std::min(lines, t * per_tile);
        const int64_t l1 = next == nullptr ? l0 : std::min(lines, l0 + per_tile);
        const float* pf = next == nullptr ? nullptr : next + 16 * l0;
        with_rows<MR>(std::min<int64_t>(MR, M - m), [&]<int R>() {
          tile<R>(xp + m * K, K, wp + p * K * NR, K, yp + m * N + p * NR, N, cols, pf, l1 - l0);
        });
      }
    }
  });
  return y;
}

std::vector<int64_t> geometry() { return {NR, MR, MAX_ROWS}; }

}  // namespace cpu_linear
