"""Fused elementwise kernels for the CPU forward pass, fp32: RMSNorm (with the residual add
folded in), RoPE applied in place, and SiLU(gate) * up, as vLLM's CPU backend fuses them; the
K/V write into the paged cache in one call; and the sampler's argmax + logsumexp.

Each replaces several torch ops (and their temporaries) with one pass over the rows, which
matters both at batch 1, where a decode step is ~25 small ops per layer, and in prefill, where
the unfused SiLU * up alone read and wrote 3 MB strided tensors at a few GB/s. Every row is
computed on its own, the same way whatever else shares the call (batch independence). The
arithmetic is Hugging Face's (fp32 throughout, the same formulas); only the order of the
reduction in RMSNorm and fused multiply-adds differ, by a few ulps.

Each function returns None (or False) where the kernel cannot be built or does not apply
(not fp32 on the CPU): the model then uses its torch code.
"""

from __future__ import annotations

from typing import Any

import torch
from kvserve.kernels import cpp_build, reference

SOURCE = r"""
// Rows per parallel_for task: about 32k floats of work, so that a decode step's few rows run
// inline on the calling thread.
static int64_t grain(int64_t row) {
  return std::max<int64_t>(1, 32768 / std::max<int64_t>(row, 1));
}

static inline void norm_row(const float* x, const float* w, float* o, int64_t n, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < n; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  for (int64_t i = 0; i < n; ++i) o[i] = w[i] * (x[i] * r);
}

// w * (x * rsqrt(mean(x^2) + eps)) for each row of x [T, n].
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) norm_row(xp + t * n, wp, op + t * n, n, eps);
  });
  return out;
}

// residual += x (in place), then rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  const int64_t T = x.size(0), n = x.size(1);
  auto out = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* rp = residual.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(n), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* r = rp + t * n;
      const float* a = xp + t * n;
      for (int64_t i = 0; i < n; ++i) r[i] += a[i];
      norm_row(r, wp, op + t * n, n, eps);
    }
  });
  return out;
}

// Rotate heads [0, nrot) of qkv [T, heads, d] (rows contiguous) in place by the rows pos[t] of
// the cos / sin tables [P, d] (rotate-half convention: x * cos + rotate_half(x) * sin).
void rope_(torch::Tensor qkv, int64_t nrot, torch::Tensor pos, torch::Tensor cos_t,
           torch::Tensor sin_t) {
  const int64_t T = qkv.size(0), d = qkv.size(2), half = d / 2;
  const int64_t row = qkv.stride(0);
  float* xp = qkv.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cos_t.data_ptr<float>();
  const float* sp = sin_t.data_ptr<float>();
  at::parallel_for(0, T, grain(nrot * d), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* c = cp + pp[t] * d;
      const float* s = sp + pp[t] * d;
      for (int64_t h = 0; h < nrot; ++h) {
        float* x = xp + t * row + h * d;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = x[i], x2 = x[i + half];
          x[i] = x1 * c[i] - x2 * s[i];
          x[i + half] = x2 * c[i + half] + x1 * s[i + half];
        }
      }
    }
  });
}

// silu(gu[:, :I]) * gu[:, I:] for gu [T, 2I].
torch::Tensor silu_mul(torch::Tensor gu) {
  const int64_t T = gu.size(0), I = gu.size(1) / 2;
  auto out = torch::empty({T, I}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, grain(2 * I), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const float* g = gp + t * 2 * I;
      const float* u = g + I;
      float* o = op + t * I;
      for (int64_t i = 0; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// K and V of T tokens ([T, KVH, D] each, a token's heads contiguous) into the paged caches
// [NB, BS, KVH, D] at flat slots[t] = block * BS + offset.
void store_kv(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
              torch::Tensor v_cache, torch::Tensor slots) {
  const int64_t T = key.size(0), row = key.size(1) * key.size(2);
  const int64_t ks = key.stride(0), vs = value.stride(0);
  const float* kp = key.data_ptr<float>();
  const float* vp = value.data_ptr<float>();
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  const int64_t* sp = slots.data_ptr<int64_t>();
  at::parallel_for(0, T, grain(2 * row), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      std::memcpy(kc + sp[t] * row, kp + t * ks, row * sizeof(float));
      std::memcpy(vc + sp[t] * row, vp + t * vs, row * sizeof(float));
    }
  });
}

// Per row of logits [N, V]: the index of the (first) largest value and log(sum(exp(row))),
// the max subtracted first. Two passes over the row; the second reads it from cache.
std::vector<torch::Tensor> argmax_logsumexp(torch::Tensor logits) {
  const int64_t N = logits.size(0), V = logits.size(1);
  auto ids = torch::empty({N}, logits.options().dtype(torch::kLong));
  auto lse = torch::empty({N}, logits.options());
  const float* lp = logits.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  float* sp = lse.data_ptr<float>();
  at::parallel_for(0, N, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* x = lp + r * V;
      float mx = x[0];
      for (int64_t i = 1; i < V; ++i) mx = std::max(mx, x[i]);
      float sum = 0.f;
      for (int64_t i = 0; i < V; ++i) sum += std::exp(x[i] - mx);
      int64_t at = 0;
      while (x[at] != mx) ++at;
      ip[r] = at;
      sp[r] = mx + std::log(sum);
    }
  });
  return {ids, lse};
}
"""
FUNCTIONS = ["rms_norm", "add_rms_norm", "rope_", "silu_mul", "argmax_logsumexp", "store_kv"]


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _applies(*tensors: torch.Tensor) -> bool:
    # A loop, not all() over a generator: this runs ~150 times in a batch-1 decode step.
    for t in tensors:  # noqa: SIM110
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of x [T, n], or None."""
    ext = _extension()
    if ext is None or not _applies(x, weight):
        return None
    out: torch.Tensor = ext.rms_norm(x.contiguous(), weight.contiguous(), eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """residual += x in place and return rms_norm(residual); None (residual untouched) where
    the kernel does not apply. `residual` must be contiguous."""
    ext = _extension()
    if ext is None or not _applies(x, residual, weight) or not residual.is_contiguous():
        return None
    out: torch.Tensor = ext.add_rms_norm(x.contiguous(), residual, weight.contiguous(), eps)
    return out


def rope_(
    qkv: torch.Tensor,
    num_rotated: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Rotate heads [0, num_rotated) of qkv [T, heads, d] in place by the rows `positions` of
    the tables cos / sin [P, d]. False (nothing done) where the kernel does not apply."""
    ext = _extension()
    if (
        ext is None
        or not _applies(qkv, cos, sin)
        or qkv.stride(2) != 1
        or qkv.stride(1) != qkv.shape[2]
        or positions.dtype != torch.int64
    ):
        return False
    ext.rope_(qkv, num_rotated, positions.contiguous(), cos.contiguous(), sin.contiguous())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up], or None."""
    ext = _extension()
    if ext is None or not _applies(gate_up):
        return None
    out: torch.Tensor = ext.silu_mul(gate_up.contiguous())
    return out


def store_kv(
    key: torch.Tensor,  # [T, kvh, d]
    value: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`reference.store_kv` in one call for fp32 caches (each token's K and V rows copied to
    their slots); quantized and other caches go to the reference."""
    ext = _extension()
    rows_contiguous = (
        key.stride(2) == 1
        and key.stride(1) == key.shape[2]
        and value.stride(2) == 1
        and value.stride(1) == value.shape[2]
    )
    if (
        ext is None
        or not _applies(key, value, k_cache, v_cache)
        or not (rows_contiguous and k_cache.is_contiguous() and v_cache.is_contiguous())
        or slot_mapping.dtype != torch.int64
    ):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    ext.store_kv(key, value, k_cache, v_cache, slot_mapping.contiguous())


def argmax_logsumexp(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Per row of logits [N, V]: the argmax (the first, as torch.argmax) and logsumexp, in one
    call reading each row twice; or None."""
    ext = _extension()
    if ext is None or not _applies(logits) or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    ids, lse = ext.argmax_logsumexp(logits.contiguous())
    return ids, lse
