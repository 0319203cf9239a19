"""Paged decode attention for the CPU: a small C++ kernel (built once with torch's
cpp_extension) that reads K/V in place from the paged cache. Same signature and semantics as
`reference.paged_decode_attention`, for float32 caches and head dims of 32, 64, 80, 96 or 128;
anything else (and a machine where the build fails) uses the reference. Each block is read in
address order, its dot products and accumulations in 16-float vectors.

Shared prefixes are read once (cascade attention, as FlashInfer and vLLM do it on GPUs):
sequences whose block tables start with the same physical blocks (prefix-cache hits, n > 1
samples, beams) form a group of up to 8, and the leading blocks full in every member are streamed
once for all the group's query rows; each member then walks its own remaining blocks. One work
item per group, parallel with at::parallel_for; each query row keeps its own block-wise online
softmax and sees its blocks in table order, so its result is bit-identical to running the
sequence alone.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from kvserve.kernels import cpp_build, reference

_SOURCE = (
    cpp_build.SIMD
    + r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <numeric>
#include <vector>

// Online-softmax state of the query rows of M sequences x H heads (row j * H + h), and the
// scores of the block being read (BS per row).
struct Rows {
  int64_t H, G, BS;
  std::vector<const float*> q;  // each row's query
  std::vector<float> acc, s, m, l;
  Rows(int64_t rows, int64_t h, int64_t g, int64_t d, int64_t bs)
      : H(h), G(g), BS(bs), q(rows), acc(rows * d, 0.f), s(rows * bs), m(rows, -FLT_MAX),
        l(rows, 0.f) {}
};

// The rows of sequences [j0, j1) attend to the n tokens of one block (K and V of token t at
// kb + t * stride, all KV heads), read in address order: the scores of every row against each
// K row, the block-wise online softmax, then each V row added into every row's accumulator.
// D = 16 * NC floats per head. Not inlined: every row is computed by the same instructions
// wherever it is called from and whatever rows share the call (batch independence).
template <int NC>
static __attribute__((noinline)) void attend_block(Rows& st, int64_t j0, int64_t j1,
                                                   const float* kb, const float* vb, int64_t n,
                                                   int64_t stride, float sc) {
  constexpr int64_t D = NC * 16;
  const int64_t H = st.H, G = st.G, BS = st.BS;
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = j0 * H; r < j1 * H; ++r) {
      const float* kt = kb + t * stride + (r % H / G) * D;
      const float* qr = st.q[r];
      v16 a = load16(qr) * load16(kt);
      for (int c = 1; c < NC; ++c) a += load16(qr + 16 * c) * load16(kt + 16 * c);
      st.s[r * BS + t] = hsum(a) * sc;
    }
  }
  for (int64_t r = j0 * H; r < j1 * H; ++r) {
    float* sr = st.s.data() + r * BS;
    float mx = st.m[r];
    for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sr[t]);
    const float alpha = std::exp(st.m[r] - mx);
    float sum = 0.f;
    for (int64_t t = 0; t < n; ++t) {
      sr[t] = std::exp(sr[t] - mx);
      sum += sr[t];
    }
    st.l[r] = st.l[r] * alpha + sum;
    st.m[r] = mx;
    float* ar = st.acc.data() + r * D;
    for (int c = 0; c < NC; ++c) store16(ar + 16 * c, load16(ar + 16 * c) * alpha);
  }
  for (int64_t t = 0; t < n; ++t) {
    for (int64_t r = j0 * H; r < j1 * H; ++r) {
      const float* vt = vb + t * stride + (r % H / G) * D;
      const float p = st.s[r * BS + t];
      float* ar = st.acc.data() + r * D;
      for (int c = 0; c < NC; ++c)
        store16(ar + 16 * c, load16(ar + 16 * c) + p * load16(vt + 16 * c));
    }
  }
}

// query [B, H, D] f32; k/v cache [NB, BS, KVH, D] f32; tables [B, MAXB] i32; lens [B] i32.
template <int NC>
static torch::Tensor decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                            torch::Tensor tables, torch::Tensor lens, double scale) {
  constexpr int64_t D = NC * 16;
  const int64_t B = query.size(0), H = query.size(1);
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

  // Groups: sequences whose tables start with the same physical block (a shared prefix), at
  // most kMaxGroup each so that a large group still spreads over threads. A group's `shared`
  // leading blocks, full in every member, are read once for all members.
  constexpr int64_t kMaxGroup = 8;
  std::vector<int64_t> order(B);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return tb[a * MAXB] < tb[b * MAXB]; });
  std::vector<int64_t> starts{0}, shared;
  for (int64_t i = 1; i <= B; ++i)
    if (i == B || tb[order[i] * MAXB] != tb[order[i - 1] * MAXB] ||
        i - starts.back() == kMaxGroup)
      starts.push_back(i);
  const int64_t NG = static_cast<int64_t>(starts.size()) - 1;
  for (int64_t g = 0; g < NG; ++g) {
    const int64_t first = order[starts[g]];
    int64_t full = ln[first] / BS;
    for (int64_t i = starts[g] + 1; i < starts[g + 1]; ++i) {
      const int64_t b = order[i];
      int64_t j = 0;
      const int64_t lim = std::min<int64_t>(full, ln[b] / BS);
      while (j < lim && tb[b * MAXB + j] == tb[first * MAXB + j]) ++j;
      full = j;
    }
    shared.push_back(starts[g + 1] - starts[g] > 1 ? full : 0);
  }

  at::parallel_for(0, NG, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t M = starts[g + 1] - starts[g];
      Rows st(M * H, H, G, D, BS);
      for (int64_t j = 0; j < M; ++j)
        for (int64_t h = 0; h < H; ++h) st.q[j * H + h] = q + (order[starts[g] + j] * H + h) * D;
      const int64_t b0 = order[starts[g]];
      for (int64_t blk = 0; blk < shared[g]; ++blk) {
        const int64_t id = tb[b0 * MAXB + blk];
        attend_block<NC>(st, 0, M, kc + id * blk_stride, vc + id * blk_stride, BS, tok_stride,
                         sc);
      }
      for (int64_t j = 0; j < M; ++j) {
        const int64_t b = order[starts[g] + j], L = ln[b];
        for (int64_t t0 = shared[g] * BS; t0 < L; t0 += BS) {
          const int64_t id = tb[b * MAXB + t0 / BS];
          attend_block<NC>(st, j, j + 1, kc + id * blk_stride, vc + id * blk_stride,
                           std::min(BS, L - t0), tok_stride, sc);
        }
        for (int64_t h = 0; h < H; ++h) {
          const int64_t r = j * H + h;
          float* orow = o + (b * H + h) * D;
          for (int64_t i = 0; i < D; ++i) orow[i] = st.acc[r * D + i] / st.l[r];
        }
      }
    }
  });
  return out;
}

torch::Tensor paged_decode(torch::Tensor query, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor tables, torch::Tensor lens, double scale) {
  switch (query.size(2)) {
    case 32: return decode<2>(query, k_cache, v_cache, tables, lens, scale);
    case 64: return decode<4>(query, k_cache, v_cache, tables, lens, scale);
    case 80: return decode<5>(query, k_cache, v_cache, tables, lens, scale);
    case 96: return decode<6>(query, k_cache, v_cache, tables, lens, scale);
    case 128: return decode<8>(query, k_cache, v_cache, tables, lens, scale);
  }
  TORCH_CHECK(false, "paged_decode: unsupported head dim ", query.size(2));
}
"""
)


HEAD_DIMS = (32, 64, 80, 96, 128)  # the kernel's instantiations; others use the reference


@functools.cache
def _extension() -> Any | None:
    """The compiled kernel, or None when it cannot be built here (logged once)."""
    return cpp_build.load("cpu_decode", _SOURCE, ["paged_decode"])


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
    supported = fp32 and query.shape[-1] in HEAD_DIMS and query.device.type == "cpu"
    if ext is None or not supported or k_scale is not None:
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
