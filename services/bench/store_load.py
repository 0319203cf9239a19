"""`kvserve bench store --parts load`: a prefix's blocks loaded from Redis into a KV cache by the
store connector alone (no model step, no engine loop), for each load setting in LOAD_ARMS.

The blocks are a real prefill's (the first --prefix-tokens length), encoded as each arm says
(format, zstd or not; an int8 / fp8 cache's frames are its own bytes and scales) and put into
a namespace of their own, with a KV cache and a store connector per arm. Each load asks which
blocks are stored (one round trip) and loads all of them into consecutive cache blocks, given
their tokens and parents as the engine gives a load them (frames checked against their
template). Every arm is set up first and each repeat loads once in every arm in turn, so that
a drift in the machine's speed meets all arms alike. Medians of --repeats (after one
unrecorded warm-up load each) of: the presence round trip, the load's wall time, the loader's
verification and write time (summed over its threads), and the load per block.
"""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from kvserve.services.bench.lib.bench_namespace import drop_namespace, fresh_namespace


@dataclass(frozen=True)
class LoadArm:
    """One load setting: the frames' format, the cache's dtype, and the pipeline's knobs."""

    name: str
    fmt: str
    cache: str  # CacheConfig.kv_dtype: auto (the model's fp32), int8, fp8
    compress: bool = False
    load_threads: int = 1
    one_call: bool = True  # KVCache.write_frames where it applies (else staged, per layer)
    whole_frames: bool = True  # batches after the first checked in the write (write_templated)
    verify_on_loop: bool = True
    in_place: bool = True  # gets read into one buffer (RedisStore.bulk), else through redis-py


# The defaults for each cache, and each step of the load pipeline undone one at a time.
LOAD_ARMS = (
    LoadArm("int8 -> int8 cache", "int8", "int8"),
    LoadArm("int8 -> fp32 cache", "int8", "auto"),
    LoadArm("native -> fp32 cache", "native", "auto"),
    LoadArm("fp8 -> fp8 cache", "fp8", "fp8"),
    LoadArm("int8 -> int8, staged copies", "int8", "int8", one_call=False),
    LoadArm("int8 -> fp32, staged copies", "int8", "auto", one_call=False),
    LoadArm("int8 -> int8, template on the loop", "int8", "int8", whole_frames=False),
    LoadArm("int8 -> fp32, template on the loop", "int8", "auto", whole_frames=False),
    LoadArm("int8 -> int8, verified on the loader", "int8", "int8", verify_on_loop=False),
    LoadArm("int8 -> fp32, verified on the loader", "int8", "auto", verify_on_loop=False),
    LoadArm("int8 -> fp32, zstd frames", "int8", "auto", compress=True),
    LoadArm("int8 -> int8, gets through redis-py", "int8", "int8", in_place=False),
    LoadArm("int8 -> fp32, gets through redis-py", "int8", "auto", in_place=False),
    LoadArm("int8 -> fp32, 2 loader threads", "int8", "auto", load_threads=2),
)
_DTYPES = {"auto": torch.float32, "int8": torch.int8, "fp8": torch.float8_e4m3fn}


def load_bench(make: Any, redis: str, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """Every LOAD_ARMS arm on the blocks of a `prefix_tokens` prefill; a table and a summary."""
    from kvserve.services.bench.workloads.text import reference_text
    from kvserve.shared.sampling_params import SamplingParams
    from kvserve.shared.store.hashing import block_hashes

    n = prefix_tokens // 16
    engine = make(None, num_blocks=n + 16)
    ids = reference_text(engine.tokenizer, n * 16 + 1)
    engine.generate([ids], SamplingParams(max_tokens=1))
    root = engine.root_hash()
    hashes = block_hashes(root, ids[: n * 16], 16)
    blocks = engine.runner.cache.read_blocks([engine.kv.cached_block(h) for h in hashes])
    source = _Source(engine.kv.identity.meta, engine.model_config, root, ids, hashes, blocks)
    engine.close()
    rows = _arms(source, redis, repeats)
    print(f"{'load (' + str(n) + ' blocks)':>34} {'B/token':>8} {'load ms':>16} {'ms/block':>8} "
          f"{'verify':>7} {'write':>6} {'presence':>8}")  # fmt: skip
    for r in rows:
        print(
            f"{r['arm']:>34} {r['bytes_per_token']:>8,.0f} {r['load_ms']:>6.1f} "
            f"[{r['load_range_ms'][0]:.1f}-{r['load_range_ms'][1]:.1f}] {r['ms_per_block']:>8.3f} "
            f"{r['verify_ms']:>7.1f} {r['write_ms']:>6.1f} {r['presence_ms']:>8.2f}"
        )
    return {"load_prefix_tokens": n * 16, "load_arms": rows}


@dataclass(frozen=True)
class _Source:
    meta: Any  # BlockMeta of the fp32 engine that computed the blocks
    config: Any  # ModelConfig
    root: Any
    ids: list[int]
    hashes: list[Any]
    blocks: list[Any]  # BlockData, fp32


def _frames(arm: LoadArm, src: _Source, meta: Any) -> list[tuple[Any, bytes]]:
    from kvserve.shared.store.block_data import BlockData
    from kvserve.shared.store.codec import encode_block

    out = []
    for i, (h, block) in enumerate(zip(src.hashes, src.blocks, strict=True)):
        parent, toks = (src.hashes[i - 1] if i else src.root), src.ids[i * 16 : (i + 1) * 16]
        k, v = block.k, block.v
        kw: dict[str, Any] = {"compress": arm.compress}
        if arm.cache != "auto":
            q = BlockData.from_float(k, v, _DTYPES[arm.cache])
            k, v, kw["scales"] = q.k, q.v, (q.k_scale, q.v_scale)
        out.append((h, encode_block(meta, toks, k, v, arm.fmt, parent, **kw)))
    return out


class _Rig:
    """One arm set up: its frames in a namespace of their own, a KV cache and a connector."""

    def __init__(self, arm: LoadArm, src: _Source, redis: str) -> None:
        from kvserve.shared.engine.kv.cache import KVCache
        from kvserve.shared.engine.kv.connector import StoreConnector
        from kvserve.shared.engine.kv.load import Chain
        from kvserve.shared.store.backends import open_store
        from kvserve.shared.store.redis import RedisStore

        self.arm, self.src, self.redis = arm, src, redis
        self.rows: list[dict[str, Any]] = []
        dtype = _DTYPES[arm.cache]
        kv_format = "float32" if arm.cache == "auto" else arm.cache
        meta = dataclasses.replace(src.meta, kv_format=kv_format)
        frames = _frames(arm, src, meta)
        self.n = len(frames)
        self.bytes_per_token = sum(len(f) for _, f in frames) / (16 * self.n)
        self.ns = fresh_namespace("load")
        url = f"{redis}?namespace={self.ns}&timeout=5"
        asyncio.run(_put(open_store(url), frames))
        self.cache = KVCache(src.config, self.n + 8, 16, dtype, populate="eager")
        reads = open_store(url)
        if not arm.in_place and isinstance(reads, RedisStore):
            reads.bulk = None
        self.conn = StoreConnector(
            reads,
            meta,
            arm.fmt,
            dtype,
            load_threads=arm.load_threads,
            verify_on_loop=arm.verify_on_loop,
        )
        self.chain = Chain.of_run(src.ids, 16, 0, src.root, src.hashes)  # as the engine gives it

    def load(self, recorded: bool = True) -> None:
        """One load of every block (the presence question first, as the engine asks it)."""
        from kvserve.shared.engine.kv.load import LoadJob

        arm, src, cache = self.arm, self.src, self.cache
        got = self.conn.fetch(src.hashes, src.root, 1.0).result()
        t0 = time.perf_counter()
        direct = cache.write_frames if arm.one_call else None
        templated = cache.write_templated if arm.one_call and arm.whole_frames else None
        res = self.conn.load(
            got, src.hashes, src.root, list(range(self.n)), cache.write_stacked, LoadJob(),
            direct, self.chain, templated,
        ).result()  # fmt: skip
        wall = time.perf_counter() - t0
        if res.loaded != self.n:
            raise RuntimeError(f"{arm.name}: loaded {res.loaded} of {self.n} blocks")
        if recorded:
            self.rows.append({"wall": wall, **res.timings, **got.timings})

    def close(self) -> None:
        try:
            self.conn.close()
            self.cache.close()
        finally:
            drop_namespace(self.redis, self.ns)


def _arms(src: _Source, redis: str, repeats: int) -> list[dict[str, Any]]:
    """Every arm set up first, then each repeat loads once in every arm in turn (after one
    unrecorded load each): a drift in the machine's speed meets all arms alike."""
    rigs: list[_Rig] = []
    try:
        for arm in LOAD_ARMS:
            rigs.append(_Rig(arm, src, redis))
        for rig in rigs:
            rig.load(recorded=False)
        for _ in range(repeats):
            for rig in rigs:
                rig.load()
        return [_summary(r.arm, r.rows, r.bytes_per_token, r.n) for r in rigs]
    finally:
        for rig in rigs:
            rig.close()


async def _put(store: Any, frames: list[tuple[Any, bytes]]) -> None:
    try:
        for i in range(0, len(frames), 32):
            await store.put_many(frames[i : i + 32])
    finally:
        await store.close()


def _summary(arm: LoadArm, rows: list[dict[str, Any]], bpt: float, n: int) -> dict[str, Any]:
    def med(key: str) -> float:
        return 1e3 * statistics.median(r[key] for r in rows)

    walls = [1e3 * r["wall"] for r in rows]
    return {
        **dataclasses.asdict(arm),
        "arm": arm.name,
        "bytes_per_token": bpt,
        "load_ms": statistics.median(walls),
        "load_range_ms": [min(walls), max(walls)],
        "ms_per_block": statistics.median(walls) / n,
        "verify_ms": med("verify_cpu_s"),
        "write_ms": med("write_cpu_s"),
        "presence_ms": med("contains_s"),
    }
