"""`kvserve bench store --parts throughput`: put_many / get_many of --blocks real blocks
(encoded in --format) against the Redis at --redis, batches of --batch: blocks/s and MB/s."""

from __future__ import annotations

import argparse
import asyncio
import time
import uuid
from typing import Any


def throughput(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Put and get rates of --blocks real frames (the K/V of a prefill in --format, repeated
    under fresh keys) against Redis in batches of --batch."""
    items = _real_frames(engine, args)
    nbytes = sum(len(v) for _, v in items)
    put_s, get_s, got = asyncio.run(_put_then_get(args, items))
    if got != len(items):
        raise RuntimeError(f"get_many returned {got} of {len(items)} blocks")
    mb = nbytes / 1e6
    out = {
        "put_blocks_per_s": len(items) / put_s,
        "put_mb_per_s": mb / put_s,
        "get_blocks_per_s": len(items) / get_s,
        "get_mb_per_s": mb / get_s,
        "throughput_format": args.format,
        "frame_bytes": nbytes / len(items),
    }
    print(
        f"store throughput ({args.format}, {nbytes / len(items) / 1e3:.0f} kB/block, batch "
        f"{args.batch}): put {out['put_blocks_per_s']:.0f} blocks/s {out['put_mb_per_s']:.0f} "
        f"MB/s, get {out['get_blocks_per_s']:.0f} blocks/s {out['get_mb_per_s']:.0f} MB/s"
    )
    return out


def _real_frames(engine: Any, args: argparse.Namespace) -> list[tuple[Any, bytes]]:
    """--blocks (hash, frame) pairs: the encoded blocks of a real prefill (at most 256),
    repeated under fresh random keys."""
    from kvserve.services.bench.workloads.text import reference_text
    from kvserve.shared.sampling_params import SamplingParams
    from kvserve.shared.store.codec import encode_block
    from kvserve.shared.store.hashing import BlockHash, block_hashes

    n_tokens = 16 * min(args.blocks, 256)
    ids = reference_text(engine.tokenizer, n_tokens + 1)
    engine.generate([ids], SamplingParams(max_tokens=1))
    meta, root = engine.kv.identity.meta, engine.root_hash()
    hashes = block_hashes(root, ids[:n_tokens], 16)
    blocks = [engine.kv.cached_block(h) for h in hashes]
    data = engine.runner.cache.read_blocks([b for b in blocks if b is not None])
    frames = []
    for i, (_, d) in enumerate(zip(hashes, data, strict=True)):  # every block is cached
        k, v = d.to_float()
        parent = hashes[i - 1] if i else root
        toks = ids[i * 16 : (i + 1) * 16]
        frames.append(encode_block(meta, toks, k, v, args.format, parent))
    return [
        (BlockHash(uuid.uuid4().bytes + uuid.uuid4().bytes), frames[i % len(frames)])
        for i in range(args.blocks)
    ]


async def _put_then_get(
    args: argparse.Namespace, items: list[tuple[Any, bytes]]
) -> tuple[float, float, int]:
    """(seconds to put all, seconds to get all, how many came back), in --batch batches, in a
    namespace of their own that is deleted at the end."""
    from kvserve.shared.store.backends import open_store

    ns = f"bench-{uuid.uuid4().hex[:12]}"
    store = open_store(f"{args.redis}?namespace={ns}&timeout=10")
    try:
        t0 = time.perf_counter()
        for i in range(0, len(items), args.batch):
            await store.put_many(items[i : i + args.batch])
        t1 = time.perf_counter()
        got = 0
        for i in range(0, len(items), args.batch):
            vals = await store.get_many([h for h, _ in items[i : i + args.batch]])
            got += sum(v is not None for v in vals)
        t2 = time.perf_counter()
        await store.delete([h for h, _ in items])
        return t1 - t0, t2 - t1, got
    finally:
        await store.close()
