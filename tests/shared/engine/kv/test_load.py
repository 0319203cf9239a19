"""BatchLoader (shared/engine/kv/load.py): a fetched batch's frames verified and written into
cache blocks; a frame whose checksum fails ends the batch's leading run, however the blocks
are written (the one-call C++ write, which checks the checksums it was left, or the staged
copies, before which the loader checks them itself)."""

from __future__ import annotations

import pytest
import torch
from kvserve.shared.engine.kv import cache as kv_cache
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.kv.load import BatchLoader, Chain, LoadJob
from kvserve.shared.store.codec import BlockMeta

from tests.shared.engine.kv.test_cache import _encoded, assert_same_blocks
from tests.shared.model_configs import model_config

CONFIG = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)


def _loader(cache: KVCache, meta: BlockMeta, root: bytes, one_call: bool) -> BatchLoader:
    # Without the one-call write the loader stages and copies layer by layer, as it does
    # where that kernel does not apply (another device, another pairing).
    direct = cache.write_frames if one_call else None
    return BatchLoader(meta, cache.dtype, root, cache.write_stacked, LoadJob(), "int8", direct)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
@pytest.mark.parametrize("one_call", [True, False], ids=["one-call", "staged"])
def test_a_bad_checksum_ends_the_leading_run_written(cache_dtype, one_call) -> None:  # type: ignore[no-untyped-def]
    from kvserve.kernels import cpu_ops

    if one_call and not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    kv_format = "float32" if cache_dtype == torch.float32 else "int8"
    meta = BlockMeta("m", kv_format, 4, 2, CONFIG.num_kv_heads, CONFIG.head_dim)
    root, frames, hashes = _encoded(4, meta, "int8", cache_dtype)
    intact = KVCache(CONFIG, 6, 4, cache_dtype, populate="lazy")
    got = _loader(intact, meta, root, one_call).load(hashes, frames, [1, 2, 3, 4])
    assert (got.written, got.miss, got.bad) == (4, None, None)

    frames[2][-40] ^= 0x01  # inside block 2's payload: only its checksum can tell
    cache = KVCache(CONFIG, 6, 4, cache_dtype, populate="lazy")
    got = _loader(cache, meta, root, one_call).load(hashes, frames, [1, 2, 3, 4])
    assert (got.written, got.miss, got.bad) == (2, "bad_checksum", hashes[2])
    raw = kv_cache.raw_view
    for a, b in zip(cache.read_blocks([1, 2]), intact.read_blocks([1, 2]), strict=True):
        assert torch.equal(raw(a.k), raw(b.k)) and torch.equal(raw(a.v), raw(b.v))
    assert all(not raw(b.k).any() and not raw(b.v).any() for b in cache.read_blocks([3, 4]))


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
def test_compressed_and_plain_frames_of_one_batch_go_in_one_call(cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """A zstd frame (decoded and checked on the loop) beside plain ones (checked in the write)
    still takes the one-call write, as the decoded block's bytes: the blocks equal the staged
    copies' bit for bit."""
    from kvserve.kernels import cpu_ops
    from kvserve.shared.store.block_data import BlockData
    from kvserve.shared.store.codec import encode_block
    from kvserve.shared.store.hashing import chain_hash, root_hash

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    kv_format = "float32" if cache_dtype == torch.float32 else "int8"
    meta = BlockMeta("m", kv_format, 4, 2, CONFIG.num_kv_heads, CONFIG.head_dim)
    g = torch.Generator().manual_seed(5)
    root = root_hash(meta.model_fp, "t", meta.kv_format, meta.block_size)
    frames, hashes, parent = [], [], root
    for j in range(3):
        tokens = [10 * j + t for t in range(meta.block_size)]
        k, v = (torch.randn(meta.block_shape, generator=g) for _ in range(2))
        q = BlockData.from_float(k, v, torch.int8)
        scales = (q.k_scale, q.v_scale)
        zstd = j == 1
        frame = encode_block(meta, tokens, q.k, q.v, "int8", parent, scales=scales, compress=zstd)
        frames.append(frame)
        parent = chain_hash(parent, tokens)
        hashes.append(parent)
    direct = KVCache(CONFIG, 5, 4, cache_dtype, populate="lazy")
    calls: list[int | None] = []

    def write_frames(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(direct.write_frames(*args, **kwargs))
        return calls[-1]

    loader = BatchLoader(
        meta, cache_dtype, root, direct.write_stacked, LoadJob(), "int8", write_frames
    )
    assert loader.load(hashes, frames, [1, 2, 3]).written == 3 and calls == [3]
    staged = KVCache(CONFIG, 5, 4, cache_dtype, populate="lazy")
    assert _loader(staged, meta, root, one_call=False).load(hashes, frames, [1, 2, 3]).written == 3
    assert_same_blocks(direct, staged)


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
def test_a_load_given_its_chain_reads_frames_against_their_writers_bytes(cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """With the blocks' tokens and parents, every frame after the first is read by its
    template (the first makes it): the blocks written equal those read_unchecked's reads
    write, a frame that differs from its template (here: the chain names other tokens) is
    still read, by read_unchecked, and a payload bit flipped under the template still ends
    the run at that block."""
    n = 5
    meta, root, frames, hashes, tokens, chain, plain = _a_chain(n, cache_dtype)
    dst = list(range(1, n + 1))

    monkey = pytest.MonkeyPatch()
    templated = template_reads(monkey)
    try:
        cache = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
        loader = _chained(cache, meta, root, chain)
        for part in (slice(0, 3), slice(3, n)):  # two batches, as a load fetches them
            got = loader.load(hashes[part], frames[part], dst[part], part.start)
            assert (got.written, got.miss) == (part.stop - part.start, None)
        assert templated == [True] * (n - 1)  # the first frame made the template
        assert_same_blocks(cache, plain)

        other = Chain([tokens[0], [7] * meta.block_size, *tokens[2:]], chain.parents)
        cache = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
        templated.clear()
        assert _chained(cache, meta, root, other).load(hashes, frames, dst).written == n
        assert templated == [False, True, True, True]  # blocks 1-4: 1 read by read_unchecked
        assert_same_blocks(cache, plain)

        frames[3][-40] ^= 0x01  # inside block 3's payload
        cache = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
        templated.clear()
        got = _chained(cache, meta, root, chain).load(hashes, frames, dst)
        assert (got.written, got.miss, got.bad) == (3, "bad_checksum", hashes[3])
        assert templated[2]  # block 3 went to the write by its template, which caught it
    finally:
        monkey.undo()


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float32])
def test_batches_after_the_template_are_checked_whole_by_the_write(cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """Once the first batch has made the template, a later batch's frames go to the write as
    they are (KVCache.write_templated checks each against the template, then its checksum):
    the blocks equal those read_unchecked's reads write. A frame laid out otherwise (the chain
    names other tokens) and the rest of its batch are read as before, by read_unchecked where
    the template does not take them; a payload bit flipped ends the run at that block."""
    n = 6
    meta, root, frames, hashes, tokens, chain, plain = _a_chain(n, cache_dtype)
    dst = list(range(1, n + 1))
    parts = (slice(0, 2), slice(2, n))

    def load(c: Chain, cache: KVCache) -> list[tuple[int, str | None, bytes | None]]:
        loader = _chained(cache, meta, root, c)
        out = []
        for part in parts:
            verified = loader.verify(hashes[part], frames[part], part.start)
            assert bool(verified.raw) == (part.start > 0)  # whole frames once templated
            got = loader.write(verified, dst[part])
            out.append((got.written, got.miss, got.bad))
        return out

    monkey = pytest.MonkeyPatch()
    templated = template_reads(monkey)
    try:
        cache = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
        assert load(chain, cache) == [(2, None, None), (4, None, None)]
        assert templated == [True] * (n - 1)
        assert_same_blocks(cache, plain)

        other = Chain([*tokens[:3], [7] * meta.block_size, *tokens[4:]], chain.parents)
        cache, templated[:] = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy"), []
        assert load(other, cache) == [(2, None, None), (4, None, None)]
        assert templated == [True, True, False, True, True]  # block 3 by read_unchecked
        assert_same_blocks(cache, plain)

        frames[4][-40] ^= 0x01  # inside block 4's payload
        cache, templated[:] = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy"), []
        assert load(chain, cache) == [(2, None, None), (2, "bad_checksum", hashes[4])]
        assert templated == [True] * 4  # blocks 1-4 by the template, 4 caught by the checksum
        frames[4][-40] ^= 0x01

        gone = [*frames[:4], None, frames[5]]
        cache = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
        loader = _chained(cache, meta, root, chain)
        loader.write(loader.verify(hashes[:2], frames[:2]), dst[:2])
        got = loader.write(loader.verify(hashes[2:], gone[2:], 2), dst[2:])
        assert (got.written, got.miss) == (2, "gone")  # blocks 2-3, then the missing one
    finally:
        monkey.undo()


WHOLE = [("int8", torch.int8), ("int8", torch.float32), ("fp8", torch.float8_e4m3fn),
         ("native", torch.float32)]  # fmt: skip


@pytest.mark.parametrize(("fmt", "cache_dtype"), WHOLE, ids=lambda x: str(x).replace("torch.", ""))
def test_the_write_takes_whole_frames_as_their_template_reads_them(fmt, cache_dtype) -> None:  # type: ignore[no-untyped-def]
    """KVCache.write_templated writes a frame's block only if FrameTemplate.read takes the
    frame and its checksum verifies: other tokens, another parent, a byte more or less, a
    compressed payload or a scale that is not finite leave it laid out otherwise (1, nothing
    written); for every single-bit flip the write refuses the frame, saying "laid out
    otherwise" exactly where the template does not read it and "bad checksum" elsewhere."""
    from kvserve.kernels import cpu_ops
    from kvserve.shared.store.block_data import BlockData
    from kvserve.shared.store.codec import FrameTemplate, encode_block, read_unchecked

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    kv_format = "float32" if cache_dtype == torch.float32 else fmt
    meta = BlockMeta("m", kv_format, 4, 2, CONFIG.num_kv_heads, CONFIG.head_dim)
    root, frames, hashes = _encoded(2, meta, fmt, cache_dtype)
    first = read_unchecked(frames[0], meta, hashes[0], root)
    assert first is not None
    template = FrameTemplate.of(meta, first)
    assert template is not None
    toks, parent, frame = [100 + t for t in range(meta.block_size)], hashes[0], frames[1]
    cache = KVCache(CONFIG, 3, 4, cache_dtype, populate="lazy")

    def write(data: bytes | bytearray, t: list[int] = toks, p: bytes = parent) -> tuple[int, int]:
        out = cache.write_templated([1], [data], template, template.heads([t], [p]))
        assert out is not None and (out[0] == 1) == (out == (1, 0))
        return out

    k, v = (torch.randn(meta.block_shape, generator=torch.Generator().manual_seed(9)),) * 2
    zstd_kw: dict = {"compress": True}
    if fmt != "native":
        q = BlockData.from_float(k, v, _QUANTIZED[fmt])
        assert q.k_scale is not None and q.v_scale is not None
        zstd_kw["scales"] = (q.k_scale, q.v_scale)
        k, v = q.k, q.v
        nan = q.k_scale.clone()
        nan.view(-1)[1] = float("nan")
        scales = (nan, q.v_scale)
        bad = encode_block(meta, toks, k, v, fmt, parent, scales=scales)
        assert template.read(bad, toks, parent, root) is None and write(bad) == (0, 1)
    zstd = encode_block(meta, toks, k, v, fmt, parent, **zstd_kw)
    others = [(frame, [7] * 4, parent), (frame, toks, root), (frame + b"\0", toks, parent),
              (frame[:-1], toks, parent), (zstd, toks, parent)]  # fmt: skip
    for data, t, p in others:
        assert template.read(data, t, p, root) is None and write(data, t, p) == (0, 1)
    assert not any(kv_cache.raw_view(b.k).any() for b in cache.read_blocks([1]))
    for bit in range(len(frame) * 8):
        flipped = bytearray(frame)
        flipped[bit // 8] ^= 1 << (bit % 8)
        read = template.read(flipped, toks, parent, root)
        assert write(flipped) == ((0, 1) if read is None else (0, 2)), bit
    assert write(frame) == (1, 0)
    want = KVCache(CONFIG, 3, 4, cache_dtype, populate="lazy")
    assert _loader(want, meta, root, one_call=True).load(hashes, frames, [0, 1]).written == 2
    raw = kv_cache.raw_view
    a, b = cache.read_blocks([1])[0], want.read_blocks([1])[0]
    assert torch.equal(raw(a.k), raw(b.k)) and torch.equal(raw(a.v), raw(b.v))


_QUANTIZED = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}


def _a_chain(n: int, cache_dtype: torch.dtype):  # type: ignore[no-untyped-def]
    """n chained int8 frames (an int8 cache's own), their blocks' Chain, and a cache holding
    them as read_unchecked's reads write them (blocks 1..n): what a templated load must equal.
    Skips without the C++ kernels."""
    from kvserve.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    kv_format = "float32" if cache_dtype == torch.float32 else "int8"
    meta = BlockMeta("m", kv_format, 4, 2, CONFIG.num_kv_heads, CONFIG.head_dim)
    root, frames, hashes = _encoded(n, meta, "int8", cache_dtype)
    tokens = [[100 * j + t for t in range(meta.block_size)] for j in range(n)]
    chain = Chain(tokens, [root, *hashes[:-1]])
    plain = KVCache(CONFIG, n + 1, 4, cache_dtype, populate="lazy")
    loaded = _loader(plain, meta, root, one_call=True).load(hashes, frames, list(range(1, n + 1)))
    assert loaded.written == n
    return meta, root, frames, hashes, tokens, chain, plain


def _chained(cache: KVCache, meta: BlockMeta, root: bytes, chain: Chain) -> BatchLoader:
    return BatchLoader(
        meta, cache.dtype, root, cache.write_stacked, LoadJob(), "int8", cache.write_frames, chain,
        cache.write_templated,
    )  # fmt: skip


def template_reads(monkey: pytest.MonkeyPatch) -> list[bool]:
    """From now until `monkey` is undone, whether each frame a template was tried on was read
    by it (True: by FrameTemplate.read, or checked whole against it by
    KVCache.write_templated) or left to read_unchecked (False), in call order."""
    from kvserve.shared.store import codec

    templated: list[bool] = []
    read = codec.FrameTemplate.read
    write = KVCache.write_templated

    def counted(self, *args):  # type: ignore[no-untyped-def]
        out = read(self, *args)
        templated.append(out is not None)
        return out

    def written(self, *args):  # type: ignore[no-untyped-def]
        out = write(self, *args)
        if out is not None:
            n, stop = out
            templated.extend([True] * (n + (stop == 2)))  # a bad checksum: taken, then caught
        return out

    monkey.setattr(codec.FrameTemplate, "read", counted)
    monkey.setattr(KVCache, "write_templated", written)
    return templated
