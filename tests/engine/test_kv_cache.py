"""KVCache tensors: zero-filled, of the cache dtype, and on the CPU resident from the start."""

from __future__ import annotations

import gc
import sys

import pytest
import torch
from kvserve.shared.config import ModelConfig
from kvserve.shared.engine.kv_cache import KVCache, zeros

MIB = 1 << 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_zeros_is_a_zero_filled_writable_tensor(dtype: torch.dtype) -> None:
    t = zeros((5, 16, 2, 8), dtype, "cpu")
    assert (t.shape, t.dtype, t.is_contiguous()) == ((5, 16, 2, 8), dtype, True)
    assert torch.count_nonzero(t.float()) == 0
    t[3, 7] = 1
    assert torch.count_nonzero(t.float()) == 16


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_cpu_cache_is_resident_as_soon_as_it_exists() -> None:
    """Reserved at construction (no page fault in a decode step), and all zeros."""
    gc.collect()
    config = ModelConfig(
        vocab_size=32,
        hidden_size=64,
        intermediate_size=128,
        num_layers=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    )
    before = resident_bytes()
    cache = KVCache(config, num_blocks=4096, block_size=16, dtype=torch.float32)
    size = sum(t.numel() * 4 for t in cache.k + cache.v)  # 4 layers x 2 x 8 MiB
    assert size == 64 * MIB
    built = resident_bytes()
    for t in cache.k + cache.v:
        assert torch.count_nonzero(t) == 0
        t.fill_(1.0)
    written = resident_bytes()
    assert built - before >= size - 4 * MIB
    assert written - built < 4 * MIB
