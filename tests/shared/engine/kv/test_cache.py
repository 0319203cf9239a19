"""KVCache tensors: zero-filled, of the cache dtype, and on the CPU resident from the start."""

from __future__ import annotations

import gc
import os
import sys
import threading
import weakref

import pytest
import torch
from kvserve.shared.engine.kv import cache as kv_cache
from kvserve.shared.engine.kv.cache import KVCache, zeros
from kvserve.shared.store.codec import BlockMeta

from tests.shared.model_configs import model_config

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


CONFIG = model_config(num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16)
SIZE = 64 * MIB  # 4096 blocks of 16 tokens x 2 heads x 16 floats: 4 layers x 2 x 8 MiB
linux_only = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/self/statm"
)


def cache_of(populate: str) -> KVCache:
    cache = KVCache(CONFIG, 4096, 16, torch.float32, populate=populate)
    assert sum(t.numel() * 4 for t in cache.k + cache.v) == SIZE
    return cache


@linux_only
def test_an_eager_cache_is_resident_as_soon_as_it_exists() -> None:
    """Reserved at construction (no page fault in a decode step), and all zeros."""
    gc.collect()
    before = resident_bytes()
    cache = cache_of("eager")
    built = resident_bytes()
    for t in cache.k + cache.v:
        assert torch.count_nonzero(t) == 0
        t.fill_(1.0)
    written = resident_bytes()
    assert built - before >= SIZE - 4 * MIB
    assert written - built < 4 * MIB


@linux_only
def test_a_lazy_cache_becomes_resident_as_blocks_are_written() -> None:
    gc.collect()
    before = resident_bytes()
    cache = cache_of("lazy")
    assert resident_bytes() - before < 4 * MIB
    cache.k[0][:16].fill_(1.0)  # 16 blocks of one layer: 32 KiB
    assert resident_bytes() - before < 8 * MIB
    assert torch.count_nonzero(cache.k[0]) == 16 * 16 * 2 * 16
    assert torch.count_nonzero(cache.v[3]) == 0


@linux_only
def test_a_background_cache_keeps_what_is_written_while_it_populates() -> None:
    """The engine writes blocks while the thread faults the pages in: population never
    changes a value, and once it is done the whole cache is resident."""
    gc.collect()
    before = resident_bytes()
    cache = cache_of("background")
    for layer, t in enumerate(cache.k + cache.v):
        t[layer * 7 : layer * 7 + 3].fill_(float(layer + 1))
    assert cache._populating is not None
    cache._populating.join()
    assert resident_bytes() - before >= SIZE - 4 * MIB
    for layer, t in enumerate(cache.k + cache.v):
        assert torch.count_nonzero(t) == 3 * 16 * 2 * 16
        assert bool((t[layer * 7 : layer * 7 + 3] == layer + 1).all())


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="no SCHED_IDLE on this platform")
def test_a_background_population_runs_on_idle_cpu_time_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The population thread takes only CPU time no other thread wants (its page faults
    slowed a serving engine's first requests); the thread that made the cache keeps its own
    policy."""
    seen: list[int] = []

    def record(tensors: object, stop: object = None) -> bool:
        seen.append(os.sched_getscheduler(0))
        return True

    monkeypatch.setattr(kv_cache, "make_resident", record)
    before = os.sched_getscheduler(0)
    cache = cache_of("background")
    cache.close()
    assert seen == [os.SCHED_IDLE]
    assert os.sched_getscheduler(0) == before != os.SCHED_IDLE


def test_close_stops_a_background_population() -> None:
    cache = cache_of("background")
    cache.close()
    assert cache._populating is not None and not cache._populating.is_alive()
    cache.k[0].fill_(2.0)  # the tensors stay valid
    assert bool((cache.k[0] == 2.0).all())


def test_exit_stops_every_background_population(monkeypatch: pytest.MonkeyPatch) -> None:
    """A thread still faulting pages in when the interpreter finalizes aborts the process
    (`terminate called without an active exception`): the exit hook stops and joins them."""

    def until_stopped(tensors: object, stop: threading.Event) -> bool:
        return stop.wait(10)

    monkeypatch.setattr(kv_cache, "make_resident", until_stopped)
    caches = [cache_of("background") for _ in range(2)]
    threads = [c._populating for c in caches]
    assert all(t is not None and t in kv_cache._populating for t in threads)
    kv_cache._stop_populating()
    assert all(t is not None and not t.is_alive() for t in threads)
    assert not set(threads) & set(kv_cache._populating)  # each took itself off the list


def test_a_dropped_cache_is_freed_while_its_population_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The population thread does not keep its cache alive (it ran at idle priority, and a
    busy machine kept a dropped engine's cache for as long as it waited): the cache is freed
    at once, and its finalizer stops the thread."""
    started, release = threading.Event(), threading.Event()
    stopped: list[bool] = []

    def slow(tensors: object, stop: threading.Event) -> bool:
        started.set()
        release.wait(10)
        stopped.append(stop.is_set())
        return True

    monkeypatch.setattr(kv_cache, "make_resident", slow)
    cache = cache_of("background")
    thread = cache._populating
    assert thread is not None and started.wait(10)
    ref = weakref.ref(cache)
    gc.disable()
    try:
        del cache
        assert ref() is None
    finally:
        gc.enable()
    release.set()
    thread.join(10)
    assert not thread.is_alive() and thread not in kv_cache._populating
    assert stopped == [True]  # set by the dropped cache's finalizer


def test_an_unknown_populate_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="populate must be one of"):
        KVCache(CONFIG, 4, 16, torch.float32, populate="soon")


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("blocks", [[3, 4, 5], [6, 1, 4]], ids=["consecutive", "scattered"])
def test_a_float_cache_dequantizes_stacked_blocks_into_place(qdtype, blocks) -> None:  # type: ignore[no-untyped-def]
    """write_stacked of int8 / fp8 K/V with scales: each block holds exactly
    dequantize_kv of its own, and no other block changes."""
    from kvserve.kernels.reference import dequantize_kv

    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    cache = KVCache(config, num_blocks=8, block_size=4, dtype=torch.float32, populate="lazy")
    g = torch.Generator().manual_seed(0)
    shape = (2, len(blocks), 4, config.num_kv_heads, config.head_dim)
    k, v = (torch.randn(shape, generator=g).mul(50).to(qdtype) for _ in range(2))
    ks, vs = (torch.rand(shape[:-1], generator=g) for _ in range(2))
    cache.write_stacked(blocks, k, v, ks, vs)
    got = cache.read_blocks(blocks)
    for j, block in enumerate(got):
        assert torch.equal(block.k, dequantize_kv(k[:, j], ks[:, j], torch.float32))
        assert torch.equal(block.v, dequantize_kv(v[:, j], vs[:, j], torch.float32))
    others = [b for b in range(8) if b not in blocks]
    assert all(not b.k.any() and not b.v.any() for b in cache.read_blocks(others))


def _frames(n: int, layers: int, config, dtype: torch.dtype, g: torch.Generator):  # type: ignore[no-untyped-def]
    """n blocks as store frames hold them: K, V [layers, 4, kvh, d] of `dtype` (int8 / fp8
    with their scales [2, layers, 4, kvh]), each its own tensor."""
    shape = (layers, 4, config.num_kv_heads, config.head_dim)
    k = [torch.randn(shape, generator=g).mul(50).to(dtype) for _ in range(n)]
    v = [torch.randn(shape, generator=g).mul(50).to(dtype) for _ in range(n)]
    quantized = dtype in (torch.int8, torch.float8_e4m3fn)
    scales = [torch.rand((2, *shape[:-1]), generator=g) for _ in range(n)] if quantized else None
    return k, v, scales


def assert_same_blocks(a_cache: KVCache, b_cache: KVCache) -> None:
    """Every block of the two caches holds the same bytes, scales included."""
    raw = kv_cache.raw_view
    blocks = range(a_cache.num_blocks)
    for a, b in zip(a_cache.read_blocks(blocks), b_cache.read_blocks(blocks), strict=True):
        assert torch.equal(raw(a.k), raw(b.k)) and torch.equal(raw(a.v), raw(b.v))
        assert (a.k_scale is None) == (b.k_scale is None)
        if a.k_scale is not None:
            assert torch.equal(a.k_scale, b.k_scale) and torch.equal(a.v_scale, b.v_scale)


def _as_bytes(k, v, scales):  # type: ignore[no-untyped-def]
    """The blocks' K, V and scales as the bytes a frame holds."""

    def raw(t: torch.Tensor) -> bytes:
        return t.contiguous().view(torch.uint8).numpy().tobytes()

    return (
        [raw(t) for t in k],
        [raw(t) for t in v],
        None if scales is None else [raw(s) for s in scales],
    )


PAIRS = [(torch.int8, torch.int8), (torch.float8_e4m3fn, torch.float8_e4m3fn),
         (torch.int8, torch.float32), (torch.float8_e4m3fn, torch.float32),
         (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("stored", "cache_dtype"), PAIRS, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("blocks", [[3, 4, 5], [6, 1, 4]], ids=["consecutive", "scattered"])
@pytest.mark.parametrize("head_dim", [8, 12], ids=["d8", "d12"])
def test_write_frames_writes_what_write_stacked_writes(
    stored, cache_dtype, blocks, head_dim
) -> None:  # type: ignore[no-untyped-def]
    """The one-call write of a store load's frames (C++) leaves every block bit for bit as the
    staged per-layer copies do: a byte copy in the cache's own format (scales too), int8 / fp8
    dequantized into an fp32 cache (int8 rows of a multiple of 8 with streaming stores, others
    element by element); no other block changes."""
    from kvserve.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=head_dim)
    k, v, scales = _frames(len(blocks), 2, config, stored, torch.Generator().manual_seed(1))
    direct, staged = (KVCache(config, 8, 4, cache_dtype, populate="lazy") for _ in range(2))
    assert direct.write_frames(blocks, *_as_bytes(k, v, scales), stored) == len(blocks)
    ks = vs = None
    if scales is not None:
        ks, vs = (torch.stack([s[i] for s in scales], 1) for i in (0, 1))
    staged.write_stacked(blocks, torch.stack(k, 1), torch.stack(v, 1), ks, vs)
    assert_same_blocks(direct, staged)
    raw = kv_cache.raw_view
    assert any(raw(b.k).any() for b in direct.read_blocks(blocks))
    assert all(not raw(b.k).any() for b in direct.read_blocks([0, 2, 7]))


DECLINED = [(torch.int8, torch.float8_e4m3fn), (torch.float32, torch.int8),
            (torch.float32, torch.bfloat16), (torch.int8, torch.bfloat16)]  # fmt: skip


@pytest.mark.parametrize(("stored", "cache_dtype"), DECLINED, ids=lambda d: str(d)[6:])
def test_write_frames_declines_other_pairings_and_writes_nothing(stored, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """Pairings the kernel does not take (another quantized type, a float frame into a
    quantized or another float cache) are left to write_stacked: None, nothing written."""
    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    k, v, scales = _frames(2, 2, config, stored, torch.Generator().manual_seed(2))
    cache = KVCache(config, 4, 4, cache_dtype, populate="lazy")
    assert cache.write_frames([1, 2], *_as_bytes(k, v, scales), stored) is None
    assert all(not kv_cache.raw_view(b.k).any() for b in cache.read_blocks(range(4)))


def test_write_frames_refuses_a_block_outside_the_cache_before_writing() -> None:
    from kvserve.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    k, v, scales = _frames(2, 2, config, torch.int8, torch.Generator().manual_seed(3))
    cache = KVCache(config, 4, 4, torch.int8, populate="lazy")
    with pytest.raises(RuntimeError, match="write_frames: block 4"):
        cache.write_frames([1, 4], *_as_bytes(k, v, scales), torch.int8)
    assert all(not b.k.any() for b in cache.read_blocks(range(4)))


def _encoded(n: int, meta: BlockMeta, fmt: str, cache_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """n chained frames in `fmt` (an int8 cache's own bytes and scales for int8) and their
    hashes, under a root of their own."""
    from kvserve.shared.store.block_data import BlockData
    from kvserve.shared.store.codec import encode_block
    from kvserve.shared.store.hashing import chain_hash, root_hash

    g = torch.Generator().manual_seed(4)
    root = root_hash(meta.model_fp, "t", meta.kv_format, meta.block_size)
    frames, hashes, parent = [], [], root
    for j in range(n):
        tokens = [100 * j + t for t in range(meta.block_size)]
        k, v = (torch.randn(meta.block_shape, generator=g) for _ in range(2))
        kw = {}
        if fmt in ("int8", "fp8"):
            q = BlockData.from_float(k, v, torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
            k, v, kw["scales"] = q.k, q.v, (q.k_scale, q.v_scale)
        frames.append(bytearray(encode_block(meta, tokens, k, v, fmt, parent, **kw)))
        parent = chain_hash(parent, tokens)
        hashes.append(parent)
    return root, frames, hashes


@pytest.mark.parametrize(
    ("fmt", "cache_dtype"),
    [
        ("int8", torch.int8),
        ("int8", torch.float32),
        ("fp8", torch.float8_e4m3fn),
        ("fp8", torch.float32),
        ("native", torch.float32),
    ],
)
def test_write_frames_checks_each_checksum_before_writing_its_block(fmt, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """Checksums left to the write (codec.read_unchecked) are checked in C++ just before
    each block is written: intact frames are all written, exactly as without the check; a
    flipped payload byte in the second frame stops the write there, the first block written,
    the second and third not touched."""
    from kvserve.kernels import cpu_ops
    from kvserve.shared.store.codec import read_unchecked

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    kv_format = {torch.float32: "float32", torch.int8: "int8"}.get(cache_dtype, "fp8")
    meta = BlockMeta("m", kv_format, 4, 2, config.num_kv_heads, config.head_dim)
    root, frames, hashes = _encoded(3, meta, fmt, cache_dtype)

    def write(cache: KVCache, frames: list[bytearray], checked: bool) -> int | None:
        got = [read_unchecked(f, meta, h, root) for f, h in zip(frames, hashes, strict=True)]
        read = [g for g in got if g is not None]
        assert len(read) == len(frames)
        sums = [g.checksum for g in read]
        scales = [g.scales for g in read] if fmt != "native" else None
        checks = ([c.head for c in sums], [c.digest for c in sums]) if checked else None
        halves = [len(g.payload) // 2 for g in read]
        k = [g.payload[:h] for g, h in zip(read, halves, strict=True)]
        v = [g.payload[h:] for g, h in zip(read, halves, strict=True)]
        return cache.write_frames([1, 2, 3], k, v, scales, read[0].stored, checks)

    plain, checked = (KVCache(config, 5, 4, cache_dtype, populate="lazy") for _ in range(2))
    assert write(plain, frames, False) == 3 and write(checked, frames, True) == 3
    raw = kv_cache.raw_view
    for a, b in zip(plain.read_blocks(range(5)), checked.read_blocks(range(5)), strict=True):
        assert torch.equal(raw(a.k), raw(b.k)) and torch.equal(raw(a.v), raw(b.v))

    frames[1][-40] ^= 0x01  # inside the payload (before the checksum field, 27 bytes)
    corrupt = KVCache(config, 5, 4, cache_dtype, populate="lazy")
    assert write(corrupt, frames, True) == 1
    (first,) = corrupt.read_blocks([1])
    (expected,) = plain.read_blocks([1])
    assert torch.equal(raw(first.k), raw(expected.k))
    assert all(not raw(b.k).any() and not raw(b.v).any() for b in corrupt.read_blocks([2, 3]))
