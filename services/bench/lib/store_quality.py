"""Quality and size of the prefix store's block formats, measured on the model's real K/V.

The worst case of a store hit: everything before a block came through the store. The token
sequence is processed block by block; block i is computed with blocks 0..i-1 in the KV cache as
they came back from `encode_block` / `decode_block` in the format under test, its logits are
kept, then block i itself is round-tripped through the codec (read from the engine's KVCache for
every layer, encoded, decoded, written back). The same pass without any round trip is the exact
reference. A trailing partial block is computed but never stored (only full blocks are).

- `kld`: mean KL(P_exact || P_fmt) of the next-token distributions over a text;
- `agree`: teacher-forced top-1 agreement with reference greedy tokens (as lib/quality.py's
  `agreement`);
- `bytes_per_token`: mean frame bytes / block_size; `ratio_vs_fp16`: over 2 * L * H * D * 2;
- `encode_ms`, `decode_ms`: mean codec time per block (this process, this machine);
- compression (not for `compact`, which is always compressed): each block is also encoded with
  and without zstd and both frames read as a load reads them (decode_block, dequantize=False):
  `zstd_saved` (fraction of the plain frame's bytes), `zstd_extra_ms` (decode time zstd adds
  per block) and `zstd_pays_below_gbps` (the link speed below which sending the saved bytes
  takes longer than decompressing: zstd pays only on slower links).

Uses engine internals (pool, runner, KVCache) the way `Engine.score` does: a one-off forward
outside the scheduler that changes no request; its blocks are freed afterwards.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from kvserve.kernels.reference import gather_kv, store_kv
from kvserve.services.bench.lib.quality import text_metrics
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.scheduler import Batch, ScheduledSeq
from kvserve.shared.engine.sequence import BlockId, SeqId, Sequence
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.codec import DecodedBlock, decode_block, encode_block
from kvserve.shared.store.hashing import BlockHash, chain_hash

# (block index, token ids, parent hash, k, v) -> (k', v') written back; k/v [L, bs, H, D]
RoundTrip = Callable[[int, list[int], BlockHash, torch.Tensor, torch.Tensor], tuple]


@dataclass
class CodecStats:
    """What the codec round trips of one measurement cost."""

    frame_bytes: list[int] = field(default_factory=list)
    encode_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    # Per block, frames with / without zstd: bytes and decode (dequantize=False) seconds.
    zstd: list[tuple[int, float]] = field(default_factory=list)
    plain: list[tuple[int, float]] = field(default_factory=list)


def _timed_read(frame: bytes, read: Callable[[bytes], object]) -> tuple[int, float]:
    t0 = time.perf_counter()
    if not isinstance(read(frame), DecodedBlock):
        raise RuntimeError("a frame did not decode")
    return len(frame), time.perf_counter() - t0


def codec_round_trip(engine: Engine, fmt: str, stats: CodecStats) -> RoundTrip:
    """A RoundTrip through encode_block / decode_block in `fmt`, recording sizes and times."""
    meta, root = engine.kv.identity.meta, engine.root_hash()

    def rt(
        i: int, tokens: list[int], parent: BlockHash, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        t0 = time.perf_counter()
        frame = encode_block(meta, tokens, k, v, fmt, parent, root=root)
        t1 = time.perf_counter()
        out = decode_block(frame, meta, chain_hash(parent, tokens), root)
        t2 = time.perf_counter()
        if not isinstance(out, DecodedBlock):
            raise RuntimeError(f"block {i} in {fmt} did not decode: {out}")
        stats.frame_bytes.append(len(frame))
        stats.encode_s.append(t1 - t0)
        stats.decode_s.append(t2 - t1)
        if fmt != "compact":
            h = chain_hash(parent, tokens)

            def read(f: bytes) -> object:
                return decode_block(f, meta, h, root, dequantize=False)

            for dst, comp in ((stats.zstd, True), (stats.plain, False)):
                f = encode_block(meta, tokens, k, v, fmt, parent, root=root, compress=comp)
                dst.append(_timed_read(f, read))
        return out.k, out.v

    return rt


def _read_block(engine: Engine, block: BlockId) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of one cache block across layers: [L, bs, H, D], the cache's float dtype (float32
    for a quantized cache)."""
    cache = engine.runner.cache
    dtype = torch.float32 if cache.quantized else cache.dtype
    ids = torch.tensor([block], device=cache.k[0].device)
    k = torch.stack(
        [gather_kv(c, s, ids, dtype) for c, s in zip(cache.k, cache.k_scale, strict=True)]
    )
    v = torch.stack(
        [gather_kv(c, s, ids, dtype) for c, s in zip(cache.v, cache.v_scale, strict=True)]
    )
    return k, v


def _write_block(engine: Engine, block: BlockId, k: torch.Tensor, v: torch.Tensor) -> None:
    cache = engine.runner.cache
    bs = cache.block_size
    dev = cache.k[0].device
    slots = torch.arange(block * bs, (block + 1) * bs, device=dev)
    for layer in range(len(cache.k)):
        store_kv(
            k[layer].to(dev),
            v[layer].to(dev),
            cache.k[layer],
            cache.v[layer],
            slots,
            cache.k_scale[layer],
            cache.v_scale[layer],
        )


@torch.inference_mode()
def blockwise_logits(
    engine: Engine, token_ids: list[int], round_trip: RoundTrip | None
) -> torch.Tensor:
    """Logits [T, vocab] of `token_ids` computed one block at a time, each full block passed
    through `round_trip` (None: kept exact) before the next block attends to it."""
    engine.validate(token_ids, SamplingParams(max_tokens=1))
    bs = engine.block_size
    seq = Sequence(
        SeqId(-1), "store-quality", 0, list(token_ids), len(token_ids), SamplingParams(), -1
    )
    blocks = engine.kv.allocate_blocks(seq.blocks_needed(len(token_ids), bs))
    if blocks is None:
        raise RuntimeError("not enough free KV blocks for this sequence")
    seq.block_table = blocks
    parent = engine.root_hash()
    runner = engine.model_runner
    out = []
    try:
        for i, start in enumerate(range(0, len(token_ids), bs)):
            tokens = list(token_ids[start : start + bs])
            seq.num_computed_tokens = start
            _, hidden = runner.forward(Batch(scheduled=[ScheduledSeq(seq, len(tokens))]))
            out.append(runner.model.compute_logits(hidden))
            if round_trip is not None and len(tokens) == bs:
                k, v = _read_block(engine, blocks[i])
                k2, v2 = round_trip(i, tokens, parent, k, v)
                _write_block(engine, blocks[i], k2, v2)
            parent = chain_hash(parent, tokens)
    finally:
        engine.kv.free_blocks(blocks)
    return torch.cat(out)


def reference_greedy(engine: Engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens per prompt (EOS ignored) with the engine as it is (its exact cache)."""
    params = SamplingParams(max_tokens=n, ignore_eos=True)
    return [c[0] for c in engine.generate(prompts, params)]


def teacher_forced_agreement(
    engine: Engine,
    prompts: list[list[int]],
    refs: list[list[int]],
    round_trip: RoundTrip | None,
) -> float:
    """Fraction of positions where the block-wise pass over prompt + ref[:-1] predicts ref."""
    hits = total = 0
    for prompt, ref in zip(prompts, refs, strict=True):
        logits = blockwise_logits(engine, prompt + ref[:-1], round_trip)[len(prompt) - 1 :]
        hits += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
    return hits / total


def measure_round_trip(
    engine: Engine,
    round_trip: RoundTrip | None,
    text_ids: list[int],
    prompts: list[list[int]],
    refs: list[list[int]],
    exact_logits: torch.Tensor | None = None,
) -> dict[str, float]:
    """kld, ppl_delta and agree of `round_trip` against the exact block-wise pass."""
    if exact_logits is None:
        exact_logits = blockwise_logits(engine, text_ids, None)
    m = text_metrics(exact_logits, blockwise_logits(engine, text_ids, round_trip), text_ids)
    agree = teacher_forced_agreement(engine, prompts, refs, round_trip)
    return {"kld": m["kld"], "ppl_delta": m["ppl_delta"], "agree": agree}


def raw_fp16_bytes_per_token(engine: Engine) -> int:
    cfg = engine.model_config
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2


def format_quality(
    engine: Engine,
    fmt: str,
    text_ids: list[int],
    prompts: list[list[int]],
    refs: list[list[int]],
    exact_logits: torch.Tensor | None = None,
) -> dict[str, float]:
    """Size, speed and quality of store format `fmt` (see the module docstring).

    `exact_logits`: `blockwise_logits(engine, text_ids, None)`, when already computed (it is the
    same for every format)."""
    stats = CodecStats()
    q = measure_round_trip(
        engine, codec_round_trip(engine, fmt, stats), text_ids, prompts, refs, exact_logits
    )
    n = len(stats.frame_bytes)
    if n == 0:
        raise ValueError("format_quality: the inputs hold no full block")
    bpt = sum(stats.frame_bytes) / n / engine.block_size
    return {
        "bytes_per_token": bpt,
        "ratio_vs_fp16": bpt / raw_fp16_bytes_per_token(engine),
        **q,
        "encode_ms": 1e3 * sum(stats.encode_s) / n,
        "decode_ms": 1e3 * sum(stats.decode_s) / n,
        **_compression(stats),
    }


def _compression(stats: CodecStats) -> dict[str, float]:
    """What zstd saves and costs a load per block (empty for `compact`)."""
    if not stats.zstd:
        return {}
    zb, zs = (sum(x) / len(stats.zstd) for x in zip(*stats.zstd, strict=True))
    pb, ps = (sum(x) / len(stats.plain) for x in zip(*stats.plain, strict=True))
    extra_s = max(zs - ps, 1e-9)
    return {
        "zstd_saved": 1 - zb / pb,
        "zstd_extra_ms": 1e3 * extra_s,
        "zstd_pays_below_gbps": 0.0 if zb >= pb else 8 * (pb - zb) / extra_s / 1e9,
    }
