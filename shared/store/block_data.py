"""One block's K/V across all layers, as a paged KV cache holds it: what the engine reads out of
its cache and writes into it, and what the host tier and the store codec carry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from kvserve.kernels.reference import dequantize_kv, quantize_kv

QUANTIZED_KV_DTYPES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}


@dataclass(frozen=True)
class BlockData:
    """One block's K/V across all layers, as the cache holds it: k, v [num_layers, block_size,
    num_kv_heads, head_dim] in the cache dtype; for int8 / fp8 caches also the per-(token, head)
    scales [num_layers, block_size, num_kv_heads]. Always a copy, never a view of the cache."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None = None
    v_scale: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        n = 2 * self.k.numel() * self.k.element_size()
        return n + (2 * self.k_scale.numel() * 4 if self.k_scale is not None else 0)

    def to_float(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V in a float dtype the store codec takes (dequantized for int8 / fp8)."""
        if self.k_scale is None or self.v_scale is None:
            return self.k, self.v
        return (
            dequantize_kv(self.k, self.k_scale, torch.float32),
            dequantize_kv(self.v, self.v_scale, torch.float32),
        )

    @classmethod
    def from_float(cls, k: torch.Tensor, v: torch.Tensor, dtype: torch.dtype) -> BlockData:
        """The block as a cache of `dtype` holds it (quantized with fresh scales if int8/fp8)."""
        if dtype in QUANTIZED_KV_DTYPES.values():
            kq, ks = quantize_kv(k, dtype)
            vq, vs = quantize_kv(v, dtype)
            return cls(kq, vq, ks, vs)
        return cls(k.to(dtype), v.to(dtype))


@dataclass(frozen=True)
class KVTail:
    """The last, partial block of a prompt's computed KV: its tokens and the block (positions
    past len(token_ids) hold nothing meaningful). Prefill hands it to decode through the store
    under a per-request key (`hashing.tail_hash`)."""

    token_ids: list[int]
    data: BlockData
