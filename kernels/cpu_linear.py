"""y = x @ W.T for up to three rows of x (a decode step of 1-3 sequences), fp32 on the CPU.

At that size a linear layer only streams its weight from memory, and oneDNN's prepacked path
does that at one half (AVX2 EPYC) to two thirds (AVX-512 EPYC) of the machine's read
bandwidth. This kernel walks the weight rows once in order, the two threads each streaming half
of them, in four independent vector accumulators (the hardware prefetcher follows the
stream; a software prefetch a few rows ahead made it 20% slower on the AVX-512 machine); each x
row's dot products are computed the same way whatever the other rows are, so a sequence's
result does not depend on whether it shares the step. `gemv` returns None where
the kernel cannot be built or the input is not fp32 on the CPU: the caller uses oneDNN.
"""

from __future__ import annotations

from typing import Any

import torch
from kvserve.kernels import cpp_build

# Measured on the model's 121 layers (2-core AVX-512 EPYC): 1.3-1.6x oneDNN's time at 1-3 rows,
# even at 4, 0.6x at 8, where oneDNN's GEMM reuses each weight load across rows.
MAX_ROWS = 3

SOURCE = r"""
// w . x over K floats in four independent vector accumulators. Not inlined, so that every row
// of x is computed by the same instructions whatever the number of rows (-ffast-math would
// otherwise let the compiler reorder the sums differently per call site).
static __attribute__((noinline)) float dot(const float* w, const float* x, int64_t K) {
  vf a0 = {}, a1 = {}, a2 = {}, a3 = {};
  int64_t k = 0;
  for (; k + 4 * VW <= K; k += 4 * VW) {
    a0 += loadv(w + k) * loadv(x + k);
    a1 += loadv(w + k + VW) * loadv(x + k + VW);
    a2 += loadv(w + k + 2 * VW) * loadv(x + k + 2 * VW);
    a3 += loadv(w + k + 3 * VW) * loadv(x + k + 3 * VW);
  }
  for (; k + VW <= K; k += VW) a0 += loadv(w + k) * loadv(x + k);
  float s = hsum((a0 + a1) + (a2 + a3));
  for (; k < K; ++k) s += w[k] * x[k];
  return s;
}

torch::Tensor gemv(torch::Tensor x, torch::Tensor w) {
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(M >= 1 && M <= 3, "gemv takes 1 to 3 rows");
  auto out = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // Each weight row is streamed from memory once; the other rows of x reread it from L1.
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) op[m * N + n] = dot(wp + n * K, xp + m * K, K);
  });
  return out;
}
"""
FUNCTIONS = ["gemv"]


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
    """x [M, K] @ weight [N, K].T for M <= MAX_ROWS, or None (not for this input or machine)."""
    if (
        x.shape[0] > MAX_ROWS
        or x.dtype != torch.float32
        or weight.dtype != torch.float32
        or x.device.type != "cpu"
    ):
        return None
    ext = _extension()
    if ext is None:
        return None
    out: torch.Tensor = ext.gemv(x.contiguous(), weight)
    return out
