from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvserve.shared.store import codec
from kvserve.shared.store.block_data import BlockData
from kvserve.shared.store.codec import (
    FORMATS,
    FRAME_VERSION,
    MAX_FRAME_BYTES,
    MISS_REASONS,
    BlockMeta,
    DecodedBlock,
    FrameTemplate,
    Miss,
    decode_block,
    decode_unchecked,
    encode_block,
    frame_checksum,
    read_unchecked,
)
from kvserve.shared.store.hashing import BlockHash, chain_hash, root_hash
from kvserve.shared.store.msgpack_view import unpack

# The default model's shape: 30 layers, 3 KV heads, head_dim 64; block 16.
META = BlockMeta(
    model_fp="model-a",
    kv_format="float32",
    block_size=16,
    num_layers=30,
    num_kv_heads=3,
    head_dim=64,
)
ROOT = root_hash(META.model_fp, "tok-a", META.kv_format, META.block_size)
TOKENS = [1000 + 7 * i for i in range(META.block_size)]
KEY = chain_hash(ROOT, TOKENS)
RAW_FP16_BYTES_PER_TOKEN = 2 * 30 * 3 * 64 * 2  # K and V, all layers: 23,040

# A tiny shape for exhaustive bit flips over the whole frame.
SMALL = BlockMeta("m", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=8)
SMALL_ROOT = root_hash("m", "t", "float32", 4)
SMALL_TOKENS = [1, 2, 3, 4]
SMALL_KEY = chain_hash(SMALL_ROOT, SMALL_TOKENS)


def _kv(meta: BlockMeta, dtype: torch.dtype = torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(meta.block_shape, generator=g).to(dtype)
    v = torch.randn(meta.block_shape, generator=g).to(dtype)
    return k, v


K, V = _kv(META)
FRAMES = {fmt: encode_block(META, TOKENS, K, V, fmt, ROOT) for fmt in FORMATS}


def _resign(frame: bytes, **changes: Any) -> bytes:
    """The frame with some fields replaced and a valid checksum: a well-formed frame that is
    still not the block the reader wants."""
    fields = msgpack.unpackb(frame, raw=False)
    fields.update(changes)
    fields["checksum"] = frame_checksum(fields)
    return msgpack.packb(fields, use_bin_type=True)


def _miss(result: object, reason: str) -> None:
    assert isinstance(result, Miss), result
    assert result.reason == reason


# --- round trips ---------------------------------------------------------------------------


def test_native_round_trip_is_bit_exact() -> None:
    out = decode_block(FRAMES["native"], META, KEY, ROOT)
    assert isinstance(out, DecodedBlock)
    assert out.token_ids == TOKENS and out.parent == ROOT and out.is_first
    assert out.k.dtype == torch.float32 and out.k.shape == META.block_shape
    assert torch.equal(out.k, K) and torch.equal(out.v, V)


def test_native_bf16_round_trip_is_bit_exact() -> None:
    meta = BlockMeta("model-a", "bfloat16", 16, 30, 3, 64)
    root = root_hash("model-a", "tok-a", "bfloat16", 16)
    k, v = _kv(meta, torch.bfloat16, seed=1)
    frame = encode_block(meta, TOKENS, k, v, "native", root)
    out = decode_block(frame, meta, chain_hash(root, TOKENS), root)
    assert isinstance(out, DecodedBlock)
    assert torch.equal(out.k.to(torch.bfloat16), k) and torch.equal(out.v.to(torch.bfloat16), v)
    assert torch.equal(out.k, k.float())


@pytest.mark.parametrize(
    ("fmt", "rtol"),
    [("bf16", 2**-8), ("fp16", 2**-11), ("int8", None), ("fp8", None)],
)
def test_lossy_round_trip_within_precision(fmt: str, rtol: float | None) -> None:
    out = decode_block(FRAMES[fmt], META, KEY, ROOT)
    assert isinstance(out, DecodedBlock) and out.fmt == fmt
    for got, want in ((out.k, K), (out.v, V)):
        assert got.dtype == torch.float32 and got.shape == META.block_shape
        err = (got - want).abs()
        if rtol is not None:  # round-to-nearest float: relative error <= half an ulp
            assert bool((err <= rtol * want.abs() + 2**-24).all())  # + fp16 subnormals
        else:  # per-(token, head) scale = amax / qmax
            amax = want.abs().amax(dim=-1, keepdim=True)
            bound = amax / 127.0 * 0.5 if fmt == "int8" else amax * 2**-4  # e4m3: 3 mantissa bits
            assert bool((err <= bound * 1.001 + 1e-7).all())


def test_a_later_block_chains_from_its_parent() -> None:
    nxt = list(range(16))
    key = chain_hash(KEY, nxt)
    frame = encode_block(META, nxt, K, V, "int8", KEY)
    out = decode_block(frame, META, key, ROOT)
    assert isinstance(out, DecodedBlock) and out.parent == KEY and not out.is_first


def test_bytes_per_token(capsys: pytest.CaptureFixture[str]) -> None:
    """Encoded size per token vs raw fp16 (random tensors: real K/V may compress better)."""
    with capsys.disabled():
        print(f"\nraw fp16: {RAW_FP16_BYTES_PER_TOKEN} B/token")
        for fmt, frame in FRAMES.items():
            per_tok = len(frame) / META.block_size
            print(
                f"{fmt:>6} (float32 in): {per_tok:9.1f} B/token "
                f"= {per_tok / RAW_FP16_BYTES_PER_TOKEN:.3f} x raw fp16"
            )
    assert len(FRAMES["int8"]) < len(FRAMES["fp16"]) < len(FRAMES["native"])


# --- misses --------------------------------------------------------------------------------


def test_truncated_frames_miss() -> None:
    frame = FRAMES["int8"]
    for n in (0, 1, 10, 100, len(frame) // 2, len(frame) - 1):
        assert isinstance(decode_block(frame[:n], META, KEY, ROOT), Miss)
    _miss(decode_block(frame[:-1], META, KEY, ROOT), "not_msgpack")


def test_trailing_bytes_miss() -> None:
    _miss(decode_block(FRAMES["fp8"] + b"\x00", META, KEY, ROOT), "not_msgpack")


def test_random_bytes_miss() -> None:
    rng = torch.Generator().manual_seed(0)
    for n in (1, 5, 64, 4096, 100_000):
        data = bytes(torch.randint(0, 256, (n,), generator=rng, dtype=torch.uint8).tolist())
        out = decode_block(data, META, KEY, ROOT)
        assert isinstance(out, Miss) and out.reason in MISS_REASONS
    assert isinstance(decode_block(os.urandom(1000), META, KEY, ROOT), Miss)


def test_oversized_misses() -> None:
    _miss(decode_block(b"\x00" * (MAX_FRAME_BYTES + 1), META, KEY, ROOT), "too_large")


@pytest.mark.parametrize(
    "obj",
    [
        None,
        42,
        "frame",
        [1, 2, 3],
        {},
        {"v": 1},
        {"v": 1, "payload": {"nested": [1, 2, 3]}},
    ],
)
def test_msgpack_of_the_wrong_type_misses(obj: object) -> None:
    _miss(decode_block(msgpack.packb(obj), META, KEY, ROOT), "bad_schema")


def test_non_bytes_input_misses() -> None:
    _miss(decode_block("a string", META, KEY, ROOT), "not_msgpack")
    _miss(decode_block(None, META, KEY, ROOT), "not_msgpack")
    _miss(decode_block(msgpack.packb({1: 2}), META, KEY, ROOT), "not_msgpack")  # strict keys


def test_another_frame_version_misses() -> None:
    """Version 1 frames (SHA-256 over a re-pack of every field) are misses, not misreads."""
    assert msgpack.unpackb(FRAMES["native"], raw=False)["v"] == FRAME_VERSION == 3
    _miss(decode_block(_resign(FRAMES["native"], v=1), META, KEY, ROOT), "bad_schema")
    _miss(decode_block(_resign(FRAMES["native"], v=4), META, KEY, ROOT), "bad_schema")
    _miss(decode_block(_resign(FRAMES["native"], v=3.0), META, KEY, ROOT), "bad_schema")


def _version_2(frame: bytes) -> bytes:
    """The frame as version 2 wrote it: no `comp` field, the payload always zstd."""
    fields = msgpack.unpackb(frame, raw=False)
    if fields.pop("comp") == "none":
        cctx = zstandard.ZstdCompressor(level=3, write_content_size=True)
        fields["payload"] = cctx.compress(fields["payload"])
    fields["v"] = 2
    fields["checksum"] = frame_checksum(fields)
    return msgpack.packb(fields, use_bin_type=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_version_2_frames_still_read(fmt: str) -> None:
    new = decode_block(FRAMES[fmt], META, KEY, ROOT)
    old = decode_block(_version_2(FRAMES[fmt]), META, KEY, ROOT)
    assert isinstance(new, DecodedBlock) and isinstance(old, DecodedBlock)
    assert torch.equal(new.k, old.k) and torch.equal(new.v, old.v)
    # A version-2 frame with a `comp` field is not a version-2 frame.
    fields = msgpack.unpackb(_version_2(FRAMES[fmt]), raw=False)
    fields["comp"] = "zstd"
    _miss(decode_block(msgpack.packb(fields, use_bin_type=True), META, KEY, ROOT), "bad_schema")


@pytest.mark.parametrize("fmt", ["native", "fp16", "int8", "fp8"])
def test_compressed_and_plain_payloads_decode_the_same(fmt: str) -> None:
    frames = [encode_block(META, TOKENS, K, V, fmt, ROOT, compress=c) for c in (True, False)]
    comps = [msgpack.unpackb(f, raw=False)["comp"] for f in frames]
    assert comps == ["zstd", "none"]
    a, b = (decode_block(f, META, KEY, ROOT) for f in frames)
    assert isinstance(a, DecodedBlock) and isinstance(b, DecodedBlock)
    assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_comp_must_match_the_payload() -> None:
    plain = encode_block(META, TOKENS, K, V, "int8", ROOT, compress=False)
    packed = encode_block(META, TOKENS, K, V, "int8", ROOT, compress=True)
    _miss(decode_block(_resign(plain, comp="zstd"), META, KEY, ROOT), "bad_payload")
    _miss(decode_block(_resign(packed, comp="none"), META, KEY, ROOT), "bad_payload")
    _miss(decode_block(_resign(plain, comp="lz4"), META, KEY, ROOT), "bad_schema")
    _miss(decode_block(_resign(plain, comp=1), META, KEY, ROOT), "bad_schema")
    with pytest.raises(ValueError, match="compact"):
        encode_block(META, TOKENS, K, V, "compact", ROOT, compress=False)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_a_quantized_cache_block_round_trips_bit_exactly(fmt: str) -> None:
    """An int8 / fp8 cache's own bytes and scales go into the frame as they are and come back
    as they were: no widening, no requantization."""
    qdtype = torch.int8 if fmt == "int8" else torch.float8_e4m3fn
    g = torch.Generator().manual_seed(3)
    q = [torch.randint(-127, 128, META.block_shape, generator=g, dtype=torch.int8)] * 2
    if fmt == "fp8":
        q = [torch.randn(META.block_shape, generator=g).to(qdtype) for _ in range(2)]
    scales = tuple(torch.rand(META.block_shape[:3], generator=g) for _ in range(2))
    frame = encode_block(META, TOKENS, q[0], q[1], fmt, ROOT, scales=scales)
    out = decode_block(frame, META, KEY, ROOT, dequantize=False)
    assert isinstance(out, DecodedBlock) and out.scales is not None
    assert out.k.dtype == qdtype
    assert torch.equal(out.k.view(torch.uint8), q[0].view(torch.uint8))
    assert torch.equal(out.v.view(torch.uint8), q[1].view(torch.uint8))
    assert torch.equal(out.scales[0], scales[0]) and torch.equal(out.scales[1], scales[1])
    with pytest.raises(ValueError, match="element type"):
        encode_block(META, TOKENS, K, V, fmt, ROOT, scales=scales)


def test_extra_or_missing_field_misses() -> None:
    fields = msgpack.unpackb(FRAMES["fp16"], raw=False)
    extra = msgpack.packb({**fields, "x": 1}, use_bin_type=True)
    _miss(decode_block(extra, META, KEY, ROOT), "not_msgpack")  # over max_map_len
    del fields["scales"]
    _miss(decode_block(msgpack.packb(fields, use_bin_type=True), META, KEY, ROOT), "bad_schema")


def test_wrong_field_type_misses() -> None:
    for change in (
        {"block_size": "16"},
        {"block_size": True},
        {"token_ids": [*TOKENS[:-1], -1]},
        {"token_ids": [*TOKENS[:-1], 2**32]},
        {"token_ids": TOKENS[:-1]},
        {"parent": ROOT[:31]},
        {"fmt": "int4"},
        {"dtype": "float64"},
        {"payload": "text"},
    ):
        _miss(decode_block(_resign(FRAMES["fp16"], **change), META, KEY, ROOT), "bad_schema")


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("model_fp", "model-b", "wrong_model"),
        ("kv_format", "bfloat16", "wrong_format"),
        ("block_size", 32, "wrong_block_size"),
        ("num_layers", 29, "wrong_shape"),
        ("num_kv_heads", 4, "wrong_shape"),
        ("head_dim", 128, "wrong_shape"),
    ],
)
def test_header_mismatch_misses(field: str, value: object, reason: str) -> None:
    """A genuine frame written under another meta is refused by this reader."""
    other = BlockMeta(**{**META.__dict__, field: value})
    k, v = _kv(other)
    toks = list(range(other.block_size))
    frame = encode_block(other, toks, k, v, "fp8", ROOT)
    assert isinstance(decode_block(frame, other, chain_hash(ROOT, toks), ROOT), DecodedBlock)
    _miss(decode_block(frame, META, KEY, ROOT), reason)


def test_tokens_that_do_not_hash_to_the_key_miss() -> None:
    other = [*TOKENS[:-1], TOKENS[-1] + 1]
    frame = encode_block(META, other, K, V, "native", ROOT)
    _miss(decode_block(frame, META, KEY, ROOT), "hash_mismatch")
    wrong_parent = encode_block(META, TOKENS, K, V, "native", BlockHash(b"\x01" * 32))
    _miss(decode_block(wrong_parent, META, KEY, ROOT), "hash_mismatch")


def test_bad_payload_misses() -> None:
    good = encode_block(META, TOKENS, K, V, "int8", ROOT, compress=True)
    fields = msgpack.unpackb(good, raw=False)
    raw = zstandard.ZstdDecompressor().decompress(fields["payload"])
    cctx = zstandard.ZstdCompressor()
    for change in (
        {"payload": b"not zstd at all"},
        {"payload": cctx.compress(raw[:-1])},  # one byte short
        {"payload": cctx.compress(raw + b"\x00")},  # one byte long
        {"payload": cctx.compress(raw * 4)},  # decompresses past the shape
        {"payload": zstandard.ZstdCompressor(write_content_size=False).compress(raw)},
        {"scales": fields["scales"][:-4]},
        {"scales": b""},
        {"scales": b"\x00\x00\xc0\x7f" * (len(fields["scales"]) // 4)},  # NaN scales
        {"fmt": "fp16"},  # payload size no longer matches the format
    ):
        _miss(decode_block(_resign(good, **change), META, KEY, ROOT), "bad_payload")
    _miss(decode_block(_resign(FRAMES["fp16"], scales=b"\x00" * 4), META, KEY, ROOT), "bad_payload")
    plain = FRAMES["int8"]
    payload = msgpack.unpackb(plain, raw=False)["payload"]
    for bad in (payload[:-1], payload + b"\x00", b""):
        _miss(decode_block(_resign(plain, payload=bad), META, KEY, ROOT), "bad_payload")


# --- decompression bombs ----------------------------------------------------------------------
# zstd frames written by hand, so that a payload of a few KB can expand to 1 GiB: RLE blocks
# (a 3-byte header and the one byte to repeat) of up to 128 KiB each. Each frame carries a
# valid checksum (the frame checksum is no secret), so it reaches the decompressor.

GIB = 1 << 30
RLE_MAX = 128 * 1024  # zstd's largest block
INT8_RAW = 2 * 30 * 16 * 3 * 64  # the int8 payload of META, decompressed: K and V, 1 byte each


def _rle_frame(expands_to: int, declared: int | None, window_log: int = 17) -> bytes:
    """A zstd frame of `expands_to` zero bytes whose header declares `declared` bytes of content
    (an 8-byte Frame_Content_Size field; None: no content size in the header)."""
    descriptor = 0x00 if declared is None else 0xC0  # bits 7-6: Frame_Content_Size_flag
    header = b"\x28\xb5\x2f\xfd" + bytes([descriptor, (window_log - 10) << 3])
    if declared is not None:
        header += declared.to_bytes(8, "little")
    sizes = [RLE_MAX] * (expands_to // RLE_MAX) + (
        [expands_to % RLE_MAX] if expands_to % RLE_MAX else []
    )
    blocks = [
        (int(i == len(sizes) - 1) | 1 << 1 | size << 3).to_bytes(3, "little") + b"\x00"
        for i, size in enumerate(sizes)
    ]  # Last_Block bit, Block_Type 1 (RLE), Block_Size
    return header + b"".join(blocks)


ZSTD_INT8 = encode_block(META, TOKENS, K, V, "int8", ROOT, compress=True)


def _int8_frame_with(payload: bytes) -> bytes:
    """META's int8 frame with a zstd payload of our own."""
    return _resign(ZSTD_INT8, payload=payload)


def bomb_frames() -> dict[str, bytes]:
    """zstd payloads for META's int8 frame: ones that decode past the 180 KiB it needs (most to
    1 GiB), and an honest one of zeros (`exact`)."""
    good = msgpack.unpackb(ZSTD_INT8, raw=False)["payload"]
    return {
        "declares_its_size_then_expands_further": _rle_frame(GIB, INT8_RAW),
        "declares_no_size": _rle_frame(GIB, None),
        "declares_a_gib": _rle_frame(GIB, GIB),
        "a_second_frame_after_a_good_one": good + _rle_frame(GIB, None),
        "a_second_frame_with_a_128_mib_window": good + _rle_frame(GIB, None, window_log=27),
        "a_second_frame_with_a_2_gib_window": good + _rle_frame(RLE_MAX, None, window_log=31),
        "exact": _rle_frame(INT8_RAW, INT8_RAW),
    }


def test_the_hand_written_frames_are_valid_zstd() -> None:
    """The bombs are real: libzstd decodes them to exactly the bytes they claim."""
    dctx = zstandard.ZstdDecompressor()
    assert dctx.decompress(_rle_frame(INT8_RAW, INT8_RAW)) == bytes(INT8_RAW)
    no_size = _rle_frame(3 * RLE_MAX, None)
    assert zstandard.frame_content_size(no_size) == -1
    assert dctx.decompress(no_size, max_output_size=3 * RLE_MAX) == bytes(3 * RLE_MAX)
    total = 0
    with dctx.stream_reader(_rle_frame(GIB, None)) as reader:
        while chunk := reader.read(1 << 24):
            total += len(chunk)
    assert total == GIB
    assert len(_rle_frame(GIB, None)) < 40_000  # 1 GiB out of 32 KiB


def test_a_payload_expanding_past_its_size_misses() -> None:
    frames = bomb_frames()
    decoded = decode_block(_int8_frame_with(frames.pop("exact")), META, KEY, ROOT)
    assert isinstance(decoded, DecodedBlock) and not decoded.k.any() and not decoded.v.any()
    for name, payload in frames.items():
        out = decode_block(_int8_frame_with(payload), META, KEY, ROOT)
        assert isinstance(out, Miss) and out.reason == "bad_payload", (name, out)


BOMB_PROBE = """
import json, resource, sys, time, tracemalloc
sys.path.insert(0, sys.argv[1])
from tests.shared.store import test_codec as t
frames = {name: t._int8_frame_with(p) for name, p in t.bomb_frames().items()}
t.decode_block(t.FRAMES["int8"], t.META, t.KEY, t.ROOT)  # warm up: lazy imports, allocator
def vm_peak():  # peak virtual size, bytes: counts what is allocated even if never touched
    with open("/proc/self/status") as status:
        line = next(x for x in status if x.startswith("VmPeak:"))
    return int(line.split()[1]) * 1024
rss, vm = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, vm_peak()
tracemalloc.start()
out = {}
for name, frame in frames.items():
    start = time.perf_counter()
    result = t.decode_block(frame, t.META, t.KEY, t.ROOT)
    out[name] = [getattr(result, "reason", "block"), time.perf_counter() - start]
out["traced_peak_bytes"] = tracemalloc.get_traced_memory()[1]
out["max_rss_growth_bytes"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss) * 1024
out["vm_peak_growth_bytes"] = vm_peak() - vm
print(json.dumps(out))
"""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's VmPeak")
def test_bombs_miss_quickly_in_little_memory() -> None:
    """In a fresh process, so that its peaks are this test's alone: every bomb is a miss within
    0.5 s, Python allocates under 2 MiB at its peak (the block's buffer is 180 KiB), and the
    process's peak resident size and peak address space (which counts what zstd allocates,
    touched or not: a frame without a content size gets a buffer of its window) grow by under
    16 MiB, against the 1 GiB each payload would expand to."""
    root = str(Path(__file__).resolve().parents[3])
    probe = subprocess.run(
        [sys.executable, "-c", BOMB_PROBE, root], capture_output=True, text=True, timeout=120
    )
    assert probe.returncode == 0, probe.stderr
    out = json.loads(probe.stdout)
    assert out.pop("exact")[0] == "block"
    assert out.pop("traced_peak_bytes") < 2 << 20
    assert out.pop("max_rss_growth_bytes") < 16 << 20
    assert out.pop("vm_peak_growth_bytes") < 16 << 20
    assert set(out) == set(bomb_frames()) - {"exact"}
    for name, (reason, seconds) in out.items():
        assert reason == "bad_payload" and seconds < 0.5, (name, reason, seconds)


def test_checksum_mismatch_misses() -> None:
    fields = msgpack.unpackb(FRAMES["bf16"], raw=False)
    for change in (
        {"model_fp": "model-b"},
        {"token_ids": list(range(16))},
        {"checksum": bytes(16)},
    ):
        forged = msgpack.packb({**fields, **change}, use_bin_type=True)
        _miss(decode_block(forged, META, KEY, ROOT), "bad_checksum")


def _flip(data: bytes, bit: int) -> bytes:
    b = bytearray(data)
    b[bit // 8] ^= 1 << (bit % 8)
    return bytes(b)


def test_every_bit_flip_of_a_small_frame_misses() -> None:
    """Exhaustive: no single-bit corruption anywhere in a frame yields a block or raises."""
    k, v = _kv(SMALL)
    for fmt in FORMATS:
        frame = encode_block(SMALL, SMALL_TOKENS, k, v, fmt, SMALL_ROOT)
        assert isinstance(decode_block(frame, SMALL, SMALL_KEY, SMALL_ROOT), DecodedBlock)
        for bit in range(len(frame) * 8):
            out = decode_block(_flip(frame, bit), SMALL, SMALL_KEY, SMALL_ROOT)
            assert isinstance(out, Miss), (fmt, bit)
            assert out.reason in MISS_REASONS and out.reason != "internal_error", (fmt, bit)


@pytest.mark.parametrize("fmt", ["native", "int8", "fp8"])
def test_an_unchecked_decode_leaves_exactly_the_checksum_to_its_caller(fmt: str) -> None:
    """decode_unchecked (the load's fast path: the checksum left to the copy into the cache)
    gives the block decode_block(dequantize=False) gives, with a checksum that verifies; for
    every single-bit flip of the frame it gives nothing or a checksum that fails, so no
    corruption reaches a cache whose writer checks it."""
    k, v = _kv(SMALL)
    frame = encode_block(SMALL, SMALL_TOKENS, k, v, fmt, SMALL_ROOT)
    got = decode_unchecked(frame, SMALL, SMALL_KEY, SMALL_ROOT)
    want = decode_block(frame, SMALL, SMALL_KEY, SMALL_ROOT, dequantize=False)
    assert got is not None and isinstance(want, DecodedBlock) and got[1].verifies()
    block = got[0]
    assert block.token_ids == want.token_ids and block.parent == want.parent and block.is_first
    assert torch.equal(block.k.view(torch.uint8), want.k.view(torch.uint8))
    assert torch.equal(block.v.view(torch.uint8), want.v.view(torch.uint8))
    assert (block.scales is None) == (want.scales is None)
    assert block.scales is None or torch.equal(block.scales, want.scales)
    read = read_unchecked(frame, SMALL, SMALL_KEY, SMALL_ROOT)  # the bytes the write takes
    assert read is not None and read.stored == want.k.dtype and read.fmt == fmt
    raw = [t.contiguous().view(torch.uint8).numpy().tobytes() for t in (want.k, want.v)]
    assert bytes(read.payload) == raw[0] + raw[1]
    scales = b"" if want.scales is None else want.scales.numpy().tobytes()
    assert read.scales == scales
    for bit in range(len(frame) * 8):
        flipped = decode_unchecked(_flip(frame, bit), SMALL, SMALL_KEY, SMALL_ROOT)
        assert flipped is None or not flipped[1].verifies(), (fmt, bit)


def _chain(meta: BlockMeta, root: BlockHash, fmt: str, n: int, cache: torch.dtype | None = None):  # type: ignore[no-untyped-def]
    """n chained frames in `fmt` (from `cache`'s own bytes and scales where given), with each
    block's tokens, parent and hash."""
    frames, tokens, parents, hashes, parent = [], [], [], [], root
    for j in range(n):
        toks = [50 * j + t for t in range(meta.block_size)]
        k, v = _kv(meta, seed=j)
        kw: dict[str, Any] = {}
        if cache is not None:
            q = BlockData.from_float(k, v, cache)
            k, v, kw["scales"] = q.k, q.v, (q.k_scale, q.v_scale)
        frames.append(encode_block(meta, toks, k, v, fmt, parent, **kw))
        tokens.append(toks)
        parents.append(parent)
        parent = chain_hash(parent, toks)
        hashes.append(parent)
    return frames, tokens, parents, hashes


TEMPLATED = [("native", None), ("int8", None), ("fp8", None), ("int8", torch.int8),
             ("fp8", torch.float8_e4m3fn)]  # fmt: skip


@pytest.mark.parametrize(("fmt", "cache"), TEMPLATED)
def test_a_frame_template_reads_what_read_unchecked_reads(
    fmt: str, cache: torch.dtype | None
) -> None:
    """The template made from a load's first frame reads the next ones, given their tokens
    and parents, as read_unchecked does: the same fields, bytes, checksum and block."""
    frames, tokens, parents, hashes = _chain(META, ROOT, fmt, 3, cache)
    first = read_unchecked(frames[0], META, hashes[0], ROOT)
    assert first is not None
    template = FrameTemplate.of(META, first)
    assert template is not None
    for frame, toks, parent, h in zip(frames, tokens, parents, hashes, strict=True):
        want = read_unchecked(frame, META, h, ROOT)
        got = template.read(memoryview(frame), toks, parent, ROOT)
        assert want is not None and got is not None
        assert (got.fmt, got.stored, got.scales, got.shape) == (
            want.fmt, want.stored, want.scales, want.shape,
        )  # fmt: skip
        assert bytes(got.payload) == bytes(want.payload)
        assert got.checksum.head == want.checksum.head
        assert got.checksum.digest == want.checksum.digest
        assert got.checksum.verifies()
        assert {**got.fields, "payload": b""} == {**want.fields, "payload": b""}
        a, b = got.block(), want.block()
        assert (a.token_ids, a.parent, a.is_first) == (b.token_ids, b.parent, b.is_first)
        assert torch.equal(a.k.view(torch.uint8), b.k.view(torch.uint8))
        assert a.scales is None or (b.scales is not None and torch.equal(a.scales, b.scales))


@pytest.mark.parametrize("fmt", ["native", "int8", "fp8"])
def test_a_frame_template_takes_only_the_expected_blocks_bytes(fmt: str) -> None:
    """The template reads nothing but the frame its writer would have written for the block
    the reader expects: other tokens, another parent, another stored dtype, a compressed
    payload, a non-finite scale or a frame of another length are left to read_unchecked
    (None), and every single-bit flip is either left to it or caught by the checksum."""
    frames, tokens, parents, hashes = _chain(SMALL, SMALL_ROOT, fmt, 2)
    first = read_unchecked(frames[0], SMALL, hashes[0], SMALL_ROOT)
    assert first is not None
    template = FrameTemplate.of(SMALL, first)
    assert template is not None
    frame, toks, parent = frames[1], tokens[1], parents[1]
    assert template.read(frame, toks, parent, SMALL_ROOT) is not None
    assert template.read(frame, [toks[0] + 1, *toks[1:]], parent, SMALL_ROOT) is None
    assert template.read(frame, toks, SMALL_ROOT, SMALL_ROOT) is None
    assert template.read(frame + b"\0", toks, parent, SMALL_ROOT) is None
    assert template.read(frame[:-1], toks, parent, SMALL_ROOT) is None
    k, v = _kv(SMALL, torch.bfloat16)
    bf16 = encode_block(SMALL, toks, k, v, fmt, parent)
    assert template.read(bf16, toks, parent, SMALL_ROOT) is None
    k, v = _kv(SMALL)
    zstd = encode_block(SMALL, toks, k, v, fmt, parent, compress=True)
    assert template.read(zstd, toks, parent, SMALL_ROOT) is None
    if fmt != "native":
        data = BlockData.from_float(k, v, torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
        assert data.k_scale is not None and data.v_scale is not None
        k_scale = data.k_scale.clone()
        k_scale.view(-1)[1] = float("nan")
        bad = encode_block(SMALL, toks, data.k, data.v, fmt, parent, scales=(k_scale, data.v_scale))
        assert template.read(bad, toks, parent, SMALL_ROOT) is None
    for bit in range(len(frame) * 8):
        flipped = template.read(_flip(frame, bit), toks, parent, SMALL_ROOT)
        assert flipped is None or not flipped.checksum.verifies(), (fmt, bit)


def test_a_version_2_frame_makes_no_template() -> None:
    """A template writes the current version's bytes: a load whose first frame is older reads
    every frame with read_unchecked (which a version-2 frame, always zstd, does not take)."""
    first = read_unchecked(FRAMES["int8"], META, KEY, ROOT)
    assert first is not None
    old = dataclasses.replace(first, fields={**first.fields, "v": 2})
    assert FrameTemplate.of(META, old) is None


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_an_unchecked_read_refuses_a_frame_with_a_scale_that_is_not_finite(fmt: str) -> None:
    """A quantized frame whose checksum holds but one of whose scales is NaN or infinite is not
    left to the write: decode_block names it a bad payload."""
    k, v = _kv(SMALL)
    data = BlockData.from_float(k, v, torch.int8 if fmt == "int8" else torch.float8_e4m3fn)
    assert data.k_scale is not None and data.v_scale is not None
    for bad in (float("nan"), float("inf")):
        k_scale = data.k_scale.clone()
        k_scale.view(-1)[3] = bad
        frame = encode_block(
            SMALL, SMALL_TOKENS, data.k, data.v, fmt, SMALL_ROOT, scales=(k_scale, data.v_scale)
        )
        assert read_unchecked(frame, SMALL, SMALL_KEY, SMALL_ROOT) is None
        assert decode_block(frame, SMALL, SMALL_KEY, SMALL_ROOT) == Miss("bad_payload")


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "compact"])
def test_an_unchecked_decode_takes_only_payloads_copied_as_stored(fmt: str) -> None:
    """Converted or compressed payloads go through decode_block (checksum first)."""
    assert decode_block(FRAMES[fmt], META, KEY, ROOT) is not None
    assert decode_unchecked(FRAMES[fmt], META, KEY, ROOT) is None
    zstd = encode_block(META, TOKENS, K, V, "native", ROOT, compress=True)
    assert decode_unchecked(zstd, META, KEY, ROOT) is None
    assert decode_unchecked(FRAMES["native"], META, chain_hash(ROOT, [1] * 16), ROOT) is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(FORMATS),
    where=st.one_of(st.integers(0, 4095), st.floats(0.0, 1.0, exclude_max=True)),
)
def test_a_bit_flip_anywhere_in_a_full_frame_misses(fmt: str, where: int | float) -> None:
    """Flips in the header region (first 512 bytes) or at any position of the whole frame."""
    frame = FRAMES[fmt]
    bit = where if isinstance(where, int) else int(where * len(frame) * 8)
    out = decode_block(_flip(frame, bit), META, KEY, ROOT)
    assert isinstance(out, Miss), bit
    assert out.reason in MISS_REASONS and out.reason != "internal_error"


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=2048))
def test_arbitrary_bytes_never_raise(data: bytes) -> None:
    out = decode_block(data, META, KEY, ROOT)
    assert isinstance(out, Miss) and out.reason in MISS_REASONS


@settings(max_examples=100, deadline=None)
@given(
    obj=st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.text(max_size=8)
        | st.binary(max_size=8),
        lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids),
        max_leaves=20,
    )
)
def test_arbitrary_msgpack_never_raises(obj: object) -> None:
    out = decode_block(msgpack.packb(obj, use_bin_type=True), META, KEY, ROOT)
    assert isinstance(out, Miss) and out.reason in {"bad_schema", "not_msgpack"}


def test_encoder_rejects_inputs_that_do_not_match_meta() -> None:
    with pytest.raises(ValueError):
        encode_block(META, TOKENS, K[:, :8], V[:, :8], "native", ROOT)
    with pytest.raises(ValueError):
        encode_block(META, TOKENS[:-1], K, V, "native", ROOT)
    with pytest.raises(ValueError):
        encode_block(META, TOKENS, K, V, "int4", ROOT)
    with pytest.raises(ValueError):
        encode_block(META, TOKENS, K.double(), V.double(), "native", ROOT)


# --- frames read by position -------------------------------------------------------------------


def _by_msgpack(frame: bytes, meta: BlockMeta) -> dict[str, Any] | None:
    """The fields as the msgpack path reads them (None where it finds the frame malformed)."""
    try:
        obj = unpack(memoryview(frame), codec._LIMITS)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("v") != FRAME_VERSION:
        return None
    fields = codec._check_types(obj)
    if fields is None or codec._identity_miss(fields, meta) is not None:
        return None
    return fields


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    norm = {k: bytes(v) if isinstance(v, memoryview) else v for k, v in a.items()}
    return norm == {k: bytes(v) if isinstance(v, memoryview) else v for k, v in b.items()}


@pytest.mark.parametrize("fmt", FORMATS)
def test_frames_as_written_are_read_by_position(fmt: str) -> None:
    """Every format's frame, as encode_block writes it, takes the positional read (so that the
    load's fast path cannot silently stop applying), with exactly msgpack's fields."""
    for meta, tokens, frame in (
        (META, TOKENS, FRAMES[fmt]),
        (SMALL, SMALL_TOKENS, encode_block(SMALL, SMALL_TOKENS, *_kv(SMALL), fmt, SMALL_ROOT)),
    ):
        fast = codec._read_as_written(memoryview(frame), meta)
        slow = _by_msgpack(frame, meta)
        assert fast is not None and slow is not None and _same(fast, slow)
        assert fast["token_ids"] == tokens
    # another reader's meta, another field order: msgpack's path, with its verdict
    other = dataclasses.replace(META, model_fp="model-b")
    assert codec._read_as_written(memoryview(FRAMES[fmt]), other) is None
    reordered = msgpack.packb(dict(reversed(msgpack.unpackb(FRAMES[fmt]).items())))
    assert codec._read_as_written(memoryview(reordered), META) is None
    assert isinstance(decode_block(reordered, META, KEY, ROOT), DecodedBlock)


def test_the_positional_read_agrees_with_msgpack_on_every_corruption() -> None:
    """Exhaustive over a small frame of each format: every bit flip, every truncation and every
    one-byte insertion either leaves the positional read (None) or reads the fields msgpack
    reads."""
    k, v = _kv(SMALL)
    for fmt in FORMATS:
        frame = encode_block(SMALL, SMALL_TOKENS, k, v, fmt, SMALL_ROOT)
        variants = [_flip(frame, bit) for bit in range(len(frame) * 8)]
        variants += [frame[:n] for n in range(len(frame))]
        variants += [frame[:i] + b"\x00" + frame[i:] for i in range(len(frame) + 1)]
        for bad in variants:
            fast = codec._read_as_written(memoryview(bad), SMALL)
            if fast is not None:
                slow = _by_msgpack(bad, SMALL)
                assert slow is not None and _same(fast, slow), fmt
