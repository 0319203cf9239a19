"""The paged KV cache tensors. Owned by the ModelRunner; block ids come from the BlockPool.

Per layer one K and one V tensor [num_blocks, block_size, num_kv_heads, head_dim] in the cache
dtype; for int8 / fp8 also per-(token, head) float32 scales [num_blocks, block_size, kv_heads].
"""

from __future__ import annotations

import torch
from kvserve.shared.config import ModelConfig

KV_DTYPE_NAMES: dict[str, torch.dtype] = {
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_dtype == "auto" else KV_DTYPE_NAMES[kv_dtype]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V (and scales, when quantized) one token occupies across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * config.num_kv_heads * config.head_dim * elem
    if dtype in KV_DTYPE_NAMES.values():
        per_layer += 2 * config.num_kv_heads * 4
    return per_layer * config.num_layers


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_layers)]
        self.quantized = dtype in KV_DTYPE_NAMES.values()
        scale_shape = shape[:3]
        self.k_scale: list[torch.Tensor | None] = [
            torch.ones(scale_shape, dtype=torch.float32, device=device) if self.quantized else None
            for _ in range(config.num_layers)
        ]
        self.v_scale: list[torch.Tensor | None] = [
            torch.ones(scale_shape, dtype=torch.float32, device=device) if self.quantized else None
            for _ in range(config.num_layers)
        ]

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: make block `dst` hold what `src` holds, in every layer."""
        for layer in range(len(self.k)):
            self.k[layer][dst].copy_(self.k[layer][src])
            self.v[layer][dst].copy_(self.v[layer][src])
            ks, vs = self.k_scale[layer], self.v_scale[layer]
            if ks is not None and vs is not None:
                ks[dst].copy_(ks[src])
                vs[dst].copy_(vs[src])
