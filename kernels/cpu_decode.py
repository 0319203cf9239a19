"""Paged decode attention for the CPU: a small C++ kernel (built once with torch's
cpp_extension) that reads K/V in place from the paged cache, so a decode step moves each
cached byte once. Same signature and semantics as `reference.paged_decode_attention`, for
float32 caches; anything else (and a machine where the build fails) uses the reference.

Per sequence: all heads walk the sequence's blocks together (each block's K and V read once,
contiguously), with a block-wise online softmax (one rescale per block of `block_size`
tokens). Parallel over sequences with at::parallel_for. Each sequence is computed alone,
so its result does not depend on what it is batched with.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from typing import Any

import torch
from kvserve.kernels import reference

log = logging.getLogger(__name__)

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <limits>
#include <vector>

// query [B, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB] i32; lens [B] i32.
torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  const int64_t B = query.size(0), H = query.size(1), D = query.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), G = H / KVH;
  const int64_t MAXB = tables.size(1);
  auto out = torch::empty_like(query);
  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int32_t* tb = tables.data_ptr<int32_t>();
  const int32_t* ln = lens.data_ptr<int32_t>();
  float* o = out.data_ptr<float>();
  const int64_t tok_stride = KVH * D, blk_stride = BS * KVH * D;
  const float sc = static_cast<float>(scale);
  // One work item per sequence: each block's K and V (contiguous) are read once for all heads.
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(H * D), s(H * BS), m(H), l(H);
    for (int64_t b = begin; b < end; ++b) {
      const float* qb = q + b * H * D;
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.f);
      const int64_t L = ln[b];
      for (int64_t t0 = 0; t0 < L; t0 += BS) {
        const int64_t n = std::min(BS, L - t0);
        const int64_t blk = tb[b * MAXB + t0 / BS];
        const float* kb = kc + blk * blk_stride;
        const float* vb = vc + blk * blk_stride;
        for (int64_t t = 0; t < n; ++t) {  // scores s[h][t]
          for (int64_t h = 0; h < H; ++h) {
            const float* kt = kb + t * tok_stride + (h / G) * D;
            const float* qh = qb + h * D;
            float dot = 0.f;
            for (int64_t i = 0; i < D; ++i) dot += qh[i] * kt[i];
            s[h * BS + t] = dot * sc;
          }
        }
        for (int64_t h = 0; h < H; ++h) {  // block-wise online softmax
          float* sh = s.data() + h * BS;
          float mx = m[h];
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sh[t]);
          const float alpha = std::exp(m[h] - mx);
          float sum = 0.f;
          for (int64_t t = 0; t < n; ++t) {
            sh[t] = std::exp(sh[t] - mx);
            sum += sh[t];
          }
          float* ah = acc.data() + h * D;
          for (int64_t i = 0; i < D; ++i) ah[i] *= alpha;
          l[h] = l[h] * alpha + sum;
          m[h] = mx;
        }
        for (int64_t t = 0; t < n; ++t) {  // acc[h] += p[h][t] * v[t]
          for (int64_t h = 0; h < H; ++h) {
            const float* vt = vb + t * tok_stride + (h / G) * D;
            const float p = s[h * BS + t];
            float* ah = acc.data() + h * D;
            for (int64_t i = 0; i < D; ++i) ah[i] += p * vt[i];
          }
        }
      }
      float* ob = o + b * H * D;
      for (int64_t h = 0; h < H; ++h)
        for (int64_t i = 0; i < D; ++i) ob[h * D + i] = acc[h * D + i] / l[h];
    }
  });
  return out;
}
"""


def _cpu_tag() -> str:
    """Binaries are built with -march=native: key them by this CPU's identity."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((platform.machine() + flags + _SOURCE).encode()).hexdigest()[:12]


@functools.cache
def _extension() -> Any | None:
    """The compiled kernel, or None when it cannot be built here (logged once)."""
    from torch.utils.cpp_extension import load_inline

    name = f"kvserve_cpu_decode_{_cpu_tag()}"  # built under torch's extensions directory
    try:
        return load_inline(
            name=name,
            cpp_sources=[_SOURCE],
            functions=["paged_decode"],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, ...: fall back to the reference
        log.warning("CPU decode kernel unavailable (%s); using the torch reference", e)
        return None


def available() -> bool:
    return _extension() is not None


def paged_decode_attention(
    query: torch.Tensor,  # [B, h, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    context_lens: torch.Tensor,  # [B] int32, >= 1
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    ext = _extension()
    fp32 = query.dtype == k_cache.dtype == v_cache.dtype == torch.float32
    if ext is None or not fp32 or k_scale is not None or query.device.type != "cpu":
        return reference.paged_decode_attention(
            query, k_cache, v_cache, block_tables, context_lens, scale, k_scale, v_scale
        )
    assert query.shape[1] % k_cache.shape[2] == 0
    assert block_tables.dtype == torch.int32 and context_lens.dtype == torch.int32
    out: torch.Tensor = ext.paged_decode(
        query.contiguous(),
        k_cache.contiguous(),
        v_cache.contiguous(),
        block_tables.contiguous(),
        context_lens.contiguous(),
        float(scale),
    )
    return out
