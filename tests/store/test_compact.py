"""The `compact` store format (shared/store/quant.py) on the default model's real K/V: size,
error bounds, end-to-end quality, and that malformed compact frames are misses."""

from __future__ import annotations

import math
from typing import Any

import msgpack
import pytest
import torch
import zstandard
from kvserve.services.bench.lib import store_quality as sq
from kvserve.services.bench.workloads.text import PROMPTS, reference_text
from kvserve.shared.store import quant
from kvserve.shared.store.codec import (
    MISS_REASONS,
    BlockMeta,
    DecodedBlock,
    Miss,
    decode_block,
    encode_block,
    frame_checksum,
)
from kvserve.shared.store.hashing import BlockHash, chain_hash

MAX_RATIO = 0.25  # frame bytes per token / raw fp16 bytes per token


@pytest.fixture(scope="module")
def engine(make_engine):  # type: ignore[no-untyped-def]
    return make_engine(num_blocks=48)


@pytest.fixture(scope="module")
def real_blocks(engine, tokenizer):  # type: ignore[no-untyped-def]
    """K/V [L, 16, H, D] of the first 4 blocks of a 72-token text, read from the KVCache."""
    ids = reference_text(tokenizer, 72)
    blocks: list[tuple[list[int], BlockHash, torch.Tensor, torch.Tensor]] = []

    def capture(i: int, toks: list[int], parent: BlockHash, k: torch.Tensor, v: torch.Tensor):
        blocks.append((toks, parent, k.clone(), v.clone()))
        return k, v

    sq.blockwise_logits(engine, ids, capture)
    assert len(blocks) == 4
    return blocks


def _fields(frame: bytes) -> dict[str, Any]:
    return msgpack.unpackb(frame, raw=False)


def _resign(frame: bytes, **changes: Any) -> bytes:
    fields = _fields(frame)
    fields.update(changes)
    fields["checksum"] = frame_checksum(fields)
    return msgpack.packb(fields, use_bin_type=True)


# --- round trip on real K/V ----------------------------------------------------------------


def test_round_trip_of_real_blocks_is_small_and_within_bounds(engine, real_blocks) -> None:
    """Frames <= 1/4 of raw fp16; every K element within half its step (the steps are those of
    the frame, near K_STEP x the head's RMS deviation); every V vector within
    V_STEP / 2 * 2**(1/16) of its norm (a quarter of that for the attention sink)."""
    meta, root = engine.kv.identity.meta, engine.root_hash()
    raw_fp16 = sq.raw_fp16_bytes_per_token(engine)
    v_bound = quant.V_STEP / 2 * 2 ** (1 / 16)
    for i, (toks, parent, k, v) in enumerate(real_blocks):
        frame = encode_block(meta, toks, k, v, "compact", parent, root=root)
        assert len(frame) / meta.block_size <= MAX_RATIO * raw_fp16
        out = decode_block(frame, meta, chain_hash(parent, toks), root)
        assert isinstance(out, DecodedBlock) and out.fmt == "compact"
        assert out.is_first == (i == 0) and out.token_ids == toks
        assert out.k.dtype == torch.float32 and out.k.shape == meta.block_shape

        steps = torch.frombuffer(bytearray(_fields(frame)["scales"]), dtype=torch.float32)
        steps = steps.view(3, meta.num_layers, 1, meta.num_kv_heads, 1)
        dev = k - k.mean(1, keepdim=True)
        rms = dev.square().mean((1, 3), keepdim=True).sqrt()
        assert bool((steps[0] <= 1.25 * quant.K_STEP * rms).all())  # little or no coarsening
        per_token = torch.cat([steps[1], steps[0].expand(-1, meta.block_size - 1, -1, -1)], 1)
        assert bool(((out.k - k).abs() <= per_token / 2 * (1 + 1e-5) + 1e-6).all())
        ratio = steps[1] / steps[0]
        if i == 0:  # the sink: a 4x finer K step, unless its residuals need more room in int8
            assert float(ratio.max()) < 0.6 and float(ratio.min()) == pytest.approx(0.25)
        else:
            assert float(ratio.min()) >= 1.0

        rel = (out.v - v).norm(dim=-1) / v.norm(dim=-1)  # [L, T, H]
        assert float(rel[:, 1:].max()) <= v_bound
        sink = quant.SINK_FACTOR if i == 0 else 1.0
        assert float(rel[:, 0].max()) <= v_bound * sink
        # Mean errors: rounding noise of step**2 / 12, the step K_STEP x the head's RMS
        # deviation for K (0.56% of the deviation energy), up to 2**(1/16) above V_STEP x the
        # token's RMS for V (1.8-2.1% of V's energy); 10% slack.
        k_rel = float((out.k - k).square().sum() / dev.square().sum())
        v_rel = float((out.v - v).square().sum() / v.square().sum())
        assert k_rel <= 1.1 * quant.K_STEP**2 / 12
        assert v_rel <= 1.1 * quant.V_STEP**2 / 12 * 2 ** (2 / 16)


def test_encoder_rejects_non_finite_kv(real_blocks) -> None:
    _, _, k, v = real_blocks[1]
    with pytest.raises(ValueError):
        quant.encode(k, v.clone().fill_(float("nan")), first=False)


def test_extreme_and_constant_blocks_round_trip_without_clipping() -> None:
    """An outlier channel 1e4x the rest, V tokens over 12 octaves, and an all-zero block: no
    value is clipped, each stays within half its step (V's in the rotated basis)."""
    layout = quant.CompactLayout(2, 16, 1, 64)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(2, 16, 1, 64, generator=g)
    k[..., 5] = 1e4 + 3e3 * torch.randn(2, 16, 1, generator=g)
    v = torch.randn(2, 16, 1, 64, generator=g) * torch.logspace(-2, 2, 16)[None, :, None, None]
    for kk, vv in ((k, v), (torch.zeros_like(k), torch.zeros_like(v))):
        blk = quant.encode(kk, vv, first=True)
        raw = zstandard.ZstdDecompressor().decompress(blk.payload)
        assert len(blk.scales) == layout.scales_bytes and len(raw) == layout.payload_bytes
        out = quant.decode(blk.scales, raw, layout)
        assert out is not None
        steps = torch.frombuffer(bytearray(blk.scales), dtype=torch.float32).view(3, 2, 1, 1, 1)
        per_token = torch.cat([steps[1], steps[0].expand(-1, 15, -1, -1)], 1)
        assert bool(((out[0] - kk).abs() <= per_token / 2 * (1 + 1e-5)).all())
        code = torch.frombuffer(bytearray(raw[-layout.sections[-1] :]), dtype=torch.uint8)
        v_steps = steps[2] * torch.exp2(-code.float().view(2, 16, 1, 1) / 16)
        err = ((out[1] - vv) @ quant.rotation(64)).abs()
        assert bool((err <= v_steps / 2 * (1 + 1e-4) + 1e-6 * v_steps.amax()).all())


# --- quality -------------------------------------------------------------------------------


@pytest.mark.slow  # ~19 s on the whole model (2-core AVX2 machine)
def test_quality_on_the_model(engine, tokenizer) -> None:
    """Worst case (every earlier block came through the store): KLD <= 0.02 and greedy
    agreement >= 95% against the exact cache, at <= 1/4 of fp16; a 2-bit round trip fails
    the same thresholds, so the check can fail."""
    ids = reference_text(tokenizer, 256)
    prompts = [tokenizer.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS[:2]]
    refs = sq.reference_greedy(engine, prompts, 32)
    exact = sq.blockwise_logits(engine, ids, None)
    m = sq.format_quality(engine, "compact", ids, prompts, refs, exact)
    print(f"\ncompact (reduced setting): {m}")
    assert m["ratio_vs_fp16"] <= MAX_RATIO
    assert m["kld"] <= 0.02
    assert m["agree"] >= 0.95

    def two_bit(i: int, toks: list[int], parent: BlockHash, k: torch.Tensor, v: torch.Tensor):
        def q(x: torch.Tensor) -> torch.Tensor:  # per-token asymmetric, 4 levels
            lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
            s = ((hi - lo) / 3).clamp_min(1e-8)
            return torch.round((x - lo) / s) * s + lo

        return q(k), q(v)

    bad = sq.measure_round_trip(engine, two_bit, ids, prompts, refs, exact)
    assert bad["kld"] > 0.02 or bad["agree"] < 0.95


# --- malformed compact frames --------------------------------------------------------------

SMALL = BlockMeta("m", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
SMALL_PARENT = BlockHash(b"\x07" * 32)
SMALL_TOKENS = [5, 6, 7, 8]
SMALL_KEY = chain_hash(SMALL_PARENT, SMALL_TOKENS)


@pytest.fixture(scope="module")
def frame() -> bytes:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(SMALL.block_shape, generator=g)
    v = torch.randn(SMALL.block_shape, generator=g)
    out = encode_block(SMALL, SMALL_TOKENS, k, v, "compact", SMALL_PARENT)
    assert isinstance(decode_block(out, SMALL, SMALL_KEY, SMALL_PARENT), DecodedBlock)
    return out


def _miss(frame: bytes, reason: str | None = None) -> None:
    out = decode_block(frame, SMALL, SMALL_KEY, SMALL_PARENT)
    assert isinstance(out, Miss), out
    assert out.reason in MISS_REASONS and out.reason != "internal_error"
    if reason is not None:
        assert out.reason == reason


def test_truncated_compact_frames_miss(frame: bytes) -> None:
    for n in range(len(frame)):
        _miss(frame[:n])


def test_every_bit_flip_of_a_compact_frame_misses(frame: bytes) -> None:
    for bit in range(len(frame) * 8):
        b = bytearray(frame)
        b[bit // 8] ^= 1 << (bit % 8)
        _miss(bytes(b))


def _steps(frame: bytes, **at: float) -> bytes:
    s = torch.frombuffer(bytearray(_fields(frame)["scales"]), dtype=torch.float32).clone()
    for idx, val in at.items():
        s[int(idx.removeprefix("i"))] = val
    return s.numpy().tobytes()


def test_wrong_size_or_bad_scales_and_payload_miss(frame: bytes) -> None:
    fields = _fields(frame)
    raw = zstandard.ZstdDecompressor().decompress(fields["payload"])
    layout = quant.CompactLayout(2, 4, 2, 8)
    assert len(raw) == layout.payload_bytes and len(fields["scales"]) == layout.scales_bytes
    cctx = zstandard.ZstdCompressor()
    n_off = layout.sections[0]
    huge_off = b"\xff\x7f" * (n_off // 2) + raw[n_off:]  # offsets 32767 x a huge step -> inf
    for change in (
        {"scales": fields["scales"][:-4]},
        {"scales": fields["scales"] + b"\x00" * 4},
        {"scales": b""},
        {"scales": _steps(frame, i0=math.nan)},
        {"scales": _steps(frame, i3=math.inf)},
        {"scales": _steps(frame, i5=0.0)},
        {"scales": _steps(frame, i8=-1.0)},
        {"scales": _steps(frame, i0=3e38, i1=3e38), "payload": cctx.compress(huge_off)},
        {"payload": cctx.compress(raw[:-1])},
        {"payload": cctx.compress(raw + b"\x00")},
        {"payload": cctx.compress(raw * 3)},
        {"payload": b"\x28\xb5\x2f\xfd" + b"\x00" * 16},  # a zstd magic, then garbage
        {"payload": zstandard.ZstdCompressor(write_content_size=False).compress(raw)},
        {"fmt": "int8"},  # sizes no longer match the format
    ):
        _miss(_resign(frame, **change), "bad_payload")
    # Any values of the right sizes decode to finite tensors: random bytes are still a block.
    junk = bytes(range(256)) * (len(raw) // 256) + bytes(len(raw) % 256)
    ok = decode_block(_resign(frame, payload=cctx.compress(junk)), SMALL, SMALL_KEY, SMALL_PARENT)
    assert isinstance(ok, DecodedBlock) and bool(torch.isfinite(ok.k).all())


def test_a_compact_frame_under_another_shape_misses(frame: bytes) -> None:
    other = BlockMeta("m", "float32", block_size=4, num_layers=2, num_kv_heads=1, head_dim=16)
    out = decode_block(frame, other, SMALL_KEY, SMALL_PARENT)
    assert isinstance(out, Miss) and out.reason == "wrong_shape"
