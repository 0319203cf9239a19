"""KVCache tensors: zero-filled, of the cache dtype, and on the CPU not resident until used."""

from __future__ import annotations

import gc

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


def test_a_cpu_cache_is_not_resident_until_its_blocks_are_written() -> None:
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
    cache = KVCache(config, num_blocks=4096, block_size=16, dtype=torch.float32)
    size = sum(t.numel() * 4 for t in cache.k + cache.v)  # 4 layers x 2 x 8 MiB
    assert size == 64 * MIB
    before = resident_bytes()
    for t in cache.k + cache.v:  # reading maps the kernel's shared zero page, nothing more
        assert torch.count_nonzero(t) == 0
    read = resident_bytes()
    for t in cache.k:
        t.fill_(1.0)  # every page of K is now this process's memory
    written = resident_bytes()
    assert read - before < size // 4
    assert written - read >= size // 2 - 4 * MIB
    assert torch.count_nonzero(cache.v[0]) == 0
