"""The engine's tiers: blocks evicted from the device cache come back from the host tier, blocks
published by one engine are loaded by another through the store, bad frames are recomputed,
the write-behind queue drops instead of blocking, and the cost rule can say recompute; the store
calls' latency histograms and their Prometheus metrics.

Outputs across a store round trip are compared token for token with a cold run, so the store
format here is `native` (bit-exact)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from kvserve.shared.config import StoreConfig
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.codec import BlockMeta, encode_block
from kvserve.shared.store.disk import DiskStore
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.memory import MemoryStore

from tests.shared.engine.helpers import run_one

# Read by the `prompts` and `cold` fixtures (tests/conftest.py): SYSTEM with each of QUESTIONS
# as a chat, and their outputs under GREEDY with prefix caching off.
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
SYSTEM = "You are a meticulous librarian who explains things with care and precision. " * 8
QUESTIONS = ["Name a fruit.", "What is rain?", "Say hi.", "Count to three."]


def full_blocks(prompt: Sequence[int], bs: int = 16) -> int:
    return ((len(prompt) - 1) // bs) * bs


def test_evicted_blocks_come_back_from_host_tier(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    # Room for about one request: the second request evicts the first one's blocks.
    engine = make_engine(num_blocks=len(prompts[0]) // 16 + 3, store=StoreConfig("memory://"))
    try:
        run_one(engine, "a", prompts[0], GREEDY)
        assert engine.prefix_cache_stats["host_tier_blocks"] == 0
        # No shared prefix: evicts a's blocks.
        run_one(engine, "b", list(reversed(prompts[1])), GREEDY)
        assert engine.prefix_cache_stats["host_tier_blocks"] > 0
        tokens, cached = run_one(engine, "c", prompts[0], GREEDY)
        assert tokens == cold[0]
        assert cached == full_blocks(prompts[0])
        stats = engine.prefix_cache_stats
        assert stats["hits_tokens_host"] > 0
        assert stats["hits_tokens_host"] + stats["hits_tokens_device"] == cached
    finally:
        engine.close()


def test_second_engine_loads_prefix_from_store(make_engine, prompts, cold, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = StoreConfig(f"file://{tmp_path}")
    a = make_engine(store=store)
    tokens, cached = run_one(a, "a", prompts[0], GREEDY)
    assert tokens == cold[0] and cached == 0
    a.close()  # flushes the write-behind queue
    assert a.store_stats() == {}  # closed
    b = make_engine(store=store)
    try:
        tokens, cached = run_one(b, "b", prompts[1], GREEDY)  # shares the system prompt with a's
        assert tokens == cold[1]
        assert cached > 0
        stats = b.prefix_cache_stats
        assert stats["hits_tokens_store"] == cached
        assert b.store_stats()["decision_load"] == 1
        assert _lookups(b) == {"hit": 1}
        # Loaded straight into device blocks (no host-tier staging), and indexed there.
        assert stats["host_tier_blocks"] == 0
        assert b.kv.tiers.num_cached_blocks >= cached // b.block_size
    finally:
        b.close()


def test_a_request_aborted_during_its_load_gives_back_every_block(  # type: ignore[no-untyped-def]
    make_engine, prompts, cold, tmp_path: Path
) -> None:
    """The load writes into blocks the engine gave it, from worker threads; aborted while a
    write is under way, those blocks return to the pool only once that write has finished,
    no later write starts, and nothing of the load is indexed."""
    a = make_engine(store=StoreConfig(f"file://{tmp_path}"))
    run_one(a, "a", prompts[0], GREEDY)
    a.close()
    b = make_engine(store=StoreConfig(f"file://{tmp_path}"))
    writing, gate, writes = threading.Event(), threading.Event(), []
    cache = b.kv.cache
    write, write_frames = cache.write_stacked, cache.write_frames

    def slow(real):  # type: ignore[no-untyped-def]
        def write(blocks: list[int], *kv: object) -> object:
            writes.append(blocks)
            writing.set()
            assert gate.wait(30)
            return real(blocks, *kv)

        return write

    cache.write_stacked, cache.write_frames = slow(write), slow(write_frames)  # type: ignore[method-assign]
    try:
        b.add_request("b", list(prompts[1]), GREEDY)
        while not writing.is_set():  # the lookup chose to load; a thread is writing a block
            b.step()
        assert b.abort_request("b")
        b.kv.take_fetched(wait=False)
        assert b.kv.pool.num_free < b.kv.pool.num_blocks  # the block being written is held
        started = len(writes)
        gate.set()
        while b.kv.pool.num_free < b.kv.pool.num_blocks:
            b.kv.take_fetched(wait=True)
        assert len(writes) == started  # no write started after the abort
        b.kv.pool.check()
        assert b.kv.tiers.num_cached_blocks == 0
        cache.write_stacked, cache.write_frames = write, write_frames  # type: ignore[method-assign]
        tokens, _ = run_one(b, "c", prompts[1], GREEDY)  # and the engine goes on serving
        assert tokens == cold[1]
    finally:
        gate.set()
        b.close()


def _outputs(engine, request_id: str, prompt: list[int]) -> list[RequestOutput]:  # type: ignore[no-untyped-def]
    """Every output of one request run to its end."""
    engine.add_request(request_id, list(prompt), GREEDY)
    outs: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def test_request_output_says_where_its_prefix_came_from(  # type: ignore[no-untyped-def]
    make_engine, prompts, tmp_path: Path
) -> None:
    """Each RequestOutput carries its cached tokens by tier and how its store lookup ended: a
    fresh prompt asks the store and finds nothing (absent); another engine finds the shared
    prefix there (hit: every cached token from the store); asked again, that engine's device
    cache holds the prompt and the store is not asked."""
    store = StoreConfig(f"file://{tmp_path}")
    a = make_engine(store=store)
    outs = _outputs(a, "a", prompts[0])
    a.close()
    assert {(o.store_lookup, o.num_cached_tokens) for o in outs} == {("absent", 0)}
    assert outs[-1].cached_tokens_by_source == {"device": 0}
    b = make_engine(store=store)
    try:
        outs = _outputs(b, "b", prompts[1])  # shares the system prompt with a's
        cached = outs[-1].num_cached_tokens
        assert cached > 0 and {o.store_lookup for o in outs} == {"hit"}
        assert outs[-1].cached_tokens_by_source == {"device": 0, "store": cached}
        again = _outputs(b, "c", prompts[1])[-1]
        assert again.store_lookup is None
        assert again.cached_tokens_by_source == {"device": full_blocks(prompts[1])}
        assert _lookups(b) == {"hit": 1}
    finally:
        b.close()


def test_open_breaker_is_a_lookup_outcome() -> None:
    """A connector over a Redis store whose breaker is open: the lookup sends nothing and is
    counted `breaker_open`, not `absent`."""
    import torch
    from kvserve.services.bench.lib.process import free_port
    from kvserve.shared.engine.kv.connector import StoreConnector
    from kvserve.shared.store.breaker import CircuitBreaker
    from kvserve.shared.store.redis import RedisStore

    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=3600.0)
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: only a short circuit answers
    redis_store = RedisStore.from_url(url, timeout_s=0.2, breaker=breaker)
    meta = BlockMeta("m", "float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=4)
    connector = StoreConnector(redis_store, meta, "native", torch.float32)
    wanted = [BlockHash(bytes([i]) * 32) for i in range(1, 4)]
    try:
        breaker.record_failure()
        assert breaker.state == "open"
        res = connector.fetch(wanted, BlockHash(bytes(32)), 1.0).result(timeout=5)
        assert (res.outcome, res.decision, res.present) == ("breaker_open", "none", 0)
        assert res.loaded == 0
        lookups = connector.stats()["lookups"]
        assert isinstance(lookups, dict)
        assert {k: n for k, n in lookups.items() if n} == {"breaker_open": 1}
        st = redis_store.stats()
        assert (st["short_circuits"], st["get_errors"]) == (1, 0)
    finally:
        connector.close()


@pytest.mark.redis
def test_loads_from_redis_reuse_the_readers_buffers() -> None:
    """The connector makes the bulk reader's buffers for its batches at start, and each batch's
    buffer goes back once its write is done: a second load reads into the same buffers, and
    both write exactly what a load straight from the frames writes."""
    import uuid

    from kvserve.kernels import cpu_ops
    from kvserve.services.bench.lib.redis_server import redis_answers
    from kvserve.shared.engine.kv.cache import KVCache
    from kvserve.shared.engine.kv.connector import FETCH_BATCH, StoreConnector
    from kvserve.shared.engine.kv.load import BatchLoader, LoadJob
    from kvserve.shared.store.codec import frame_bytes
    from kvserve.shared.store.redis import RedisStore

    from tests.shared.engine.kv.test_cache import _encoded, assert_same_blocks
    from tests.shared.model_configs import model_config

    server = "redis://127.0.0.1:6379/15"
    url = f"{server}?namespace=kvtest:reuse:{uuid.uuid4().hex}&timeout=2"
    if not asyncio.run(redis_answers(server)):
        pytest.skip("no Redis at 127.0.0.1:6379")
    if not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    config = model_config(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    meta = BlockMeta("m", "int8", 4, 2, config.num_kv_heads, config.head_dim)
    n = 2 * FETCH_BATCH + 3  # three batches, the last a short one
    root, frames, hashes = _encoded(n, meta, "int8", torch.int8)
    want = KVCache(config, n + 1, 4, torch.int8, populate="lazy")
    direct = BatchLoader(
        meta, torch.int8, root, want.write_stacked, LoadJob(), "int8", want.write_frames
    )
    assert direct.load(hashes, frames, list(range(1, n + 1))).written == n

    store = RedisStore.from_url(url)
    connector = StoreConnector(store, meta, "int8", torch.int8)
    try:
        asyncio.run_coroutine_threadsafe(
            store.put_many([(h, bytes(f)) for h, f in zip(hashes, frames, strict=True)]),
            connector._loop,
        ).result(timeout=5)
        connector.connected.result(timeout=5)
        bulk = store.bulk
        assert bulk is not None and len(bulk._buffers) == bulk.max_buffers
        assert all(len(b) >= FETCH_BATCH * frame_bytes(meta, "int8") for b in bulk._buffers)
        made = {id(b) for b in bulk._buffers}
        for _ in range(2):
            cache = KVCache(config, n + 1, 4, torch.int8, populate="lazy")
            got = connector.fetch(hashes, root, 1.0).result(timeout=5)
            dst = list(range(1, n + 1))
            res = connector.load(
                got, hashes, root, dst, cache.write_stacked, LoadJob(), cache.write_frames
            ).result(timeout=5)
            assert (res.outcome, res.loaded) == ("hit", n)
            assert_same_blocks(cache, want)
            back = asyncio.run_coroutine_threadsafe(_buffer_ids(bulk), connector._loop)
            assert back.result(timeout=5) == made
    finally:
        asyncio.run_coroutine_threadsafe(store.delete(hashes), connector._loop).result(timeout=5)
        connector.close()


async def _buffer_ids(bulk: Any) -> set[int]:
    """The reader's kept buffers, read on its loop (each write's recycle was queued there
    before the write's own result, so before the load's)."""
    return {id(b) for b in bulk._buffers}


def test_close_closes_the_store_threads_event_loop(tmp_path: Path) -> None:
    """Its selector and self-pipe are released at close, not left to the garbage collector
    (whose finalization order can find the pipe already closed: an exception in __del__)."""
    import torch
    from kvserve.shared.engine.kv.connector import StoreConnector
    from kvserve.shared.store.disk import DiskStore

    meta = BlockMeta("m", "float32", block_size=16, num_layers=1, num_kv_heads=1, head_dim=4)
    connector = StoreConnector(DiskStore(tmp_path, 1 << 20), meta, "native", torch.float32)
    loop = connector._loop
    assert not loop.is_closed()
    connector.close()
    assert loop.is_closed()


def _lookups(engine) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """The store lookups that happened, by outcome (every outcome is reported, zeros too)."""
    lookups = engine.store_stats()["lookups"]
    assert set(lookups) == {"hit", "absent", "recompute", "timeout", "evicted", "corrupt",
                            "wrong_identity", "unavailable", "breaker_open"}  # fmt: skip
    return {k: n for k, n in lookups.items() if n}


def _root_and_hashes(engine, prompt: list[int]) -> tuple[BlockHash, list[BlockHash]]:  # type: ignore[no-untyped-def]
    from kvserve.shared.store.hashing import block_hashes

    root = engine.root_hash()
    n = (len(prompt) - 1) // engine.block_size
    return root, block_hashes(root, prompt[: n * engine.block_size], engine.block_size)


def test_bad_frames_are_recomputed_and_deleted(make_engine, prompts, cold, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = StoreConfig(f"file://{tmp_path}")
    a = make_engine(store=store)
    run_one(a, "a", prompts[2], GREEDY)
    a.close()
    _, hashes = _root_and_hashes(a, prompts[2])
    disk = DiskStore(str(tmp_path))
    frames = asyncio.run(disk.get_many([hashes[2]]))  # block 2 gets one flipped byte
    assert frames[0] is not None
    flipped = bytearray(frames[0])
    flipped[len(flipped) // 2] ^= 0x01
    asyncio.run(disk.put_many([(hashes[2], bytes(flipped))]))
    asyncio.run(disk.close())

    b = make_engine(store=store)
    try:
        tokens, cached = run_one(b, "b", prompts[2], GREEDY)
        assert tokens == cold[2]
        assert cached == 2 * b.block_size  # blocks 0 and 1 loaded, the rest recomputed
        assert b.store_stats()["miss_reasons"] == {"bad_checksum": 1}
        assert _lookups(b) == {"corrupt": 1}
    finally:
        b.close()
    disk = DiskStore(str(tmp_path))
    # The bad frame was deleted, then b recomputed and republished the block.
    (again,) = asyncio.run(disk.get_many([hashes[2]]))
    assert again is not None and again != bytes(flipped)
    asyncio.run(disk.close())


def test_frames_of_another_model_or_format_are_never_used(  # type: ignore[no-untyped-def]
    make_engine, prompts, cold, tmp_path: Path
) -> None:
    eng = make_engine(store=StoreConfig(f"file://{tmp_path}"))
    root, hashes = _root_and_hashes(eng, prompts[3])
    meta: BlockMeta = eng.kv.connector.meta
    # Frames of the right tokens and chain, stamped with another model / KV format, stored
    # under the keys this engine will ask for.
    import torch

    zeros = torch.zeros(meta.block_shape)
    bad = []
    for i, h in enumerate(hashes[:2]):
        wrong = (
            BlockMeta("another-model", *_meta_rest(meta))
            if i == 0
            else BlockMeta(meta.model_fp, "int8", *_meta_rest(meta)[1:])
        )
        toks = prompts[3][i * 16 : (i + 1) * 16]
        parent = hashes[i - 1] if i else root
        bad.append((h, encode_block(wrong, toks, zeros, zeros, "native", parent)))
    assert asyncio.run(_put(eng, bad)) == 2
    try:
        tokens, cached = run_one(eng, "x", prompts[3], GREEDY)
        assert tokens == cold[3] and cached == 0
        assert eng.store_stats()["miss_reasons"] == {"wrong_model": 1}
        assert _lookups(eng) == {"wrong_identity": 1}
        # An int8-cache engine never even asks for this engine's blocks: another root.
        q = make_engine(store=StoreConfig(f"file://{tmp_path}"), kv_dtype="int8")
        try:
            eng.kv.connector.flush()
            _, cached_q = run_one(q, "q", prompts[3], GREEDY)
            assert cached_q == 0
            assert q.store_stats().get("decision_load", 0) == 0
        finally:
            q.close()
    finally:
        eng.close()


def _meta_rest(meta: BlockMeta) -> tuple[str, int, int, int, int]:
    return (meta.kv_format, meta.block_size, meta.num_layers, meta.num_kv_heads, meta.head_dim)


async def _put(engine, items: list[tuple[BlockHash, bytes]]) -> int:  # type: ignore[no-untyped-def]
    return int(await engine.kv.connector.store.put_many(items))


class GatedStore(MemoryStore):
    """A memory store whose writes wait until the test opens the gate: a stalled backend."""

    def __init__(self) -> None:
        super().__init__(max_bytes=1 << 30)
        self.gate = asyncio.Event()

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        await self.gate.wait()
        return await super().put_many(items)


def test_full_write_queue_drops_and_never_blocks(make_engine, prompts, cold) -> None:  # type: ignore[no-untyped-def]
    eng = make_engine(store=StoreConfig("memory://", write_queue_blocks=1))
    gated = GatedStore()
    assert eng.kv.connector is not None
    eng.kv.connector.store = gated
    try:
        tokens, _ = run_one(eng, "a", prompts[0], GREEDY)  # completes while the store is stuck
        assert tokens == cold[0]
        stats = eng.store_stats()
        assert stats["dropped_writes"] >= full_blocks(prompts[0]) // 16 - 2
    finally:
        eng.kv.connector._loop.call_soon_threadsafe(gated.gate.set)
        eng.close()


def test_cost_rule_can_choose_recompute(make_engine, prompts, cold, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    store = StoreConfig(f"file://{tmp_path}")
    a = make_engine(store=store)
    run_one(a, "a", prompts[1], GREEDY)
    a.close()
    b = make_engine(store=store)
    try:
        b.kv.prefill_s_per_token = 1e-9  # recomputing looks free: loading cannot win
        tokens, cached = run_one(b, "b", prompts[1], GREEDY)
        assert tokens == cold[1] and cached == 0
        assert b.store_stats()["decision_recompute"] == 1
        assert _lookups(b) == {"recompute": 1}
        assert b.store_stats().get("fetched_blocks", 0) == 0
    finally:
        b.close()


def test_compact_store_format_through_the_engine(make_engine, prompts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # Lossy, so only reuse is asserted here; its quality is measured by `kvserve bench store`.
    store = StoreConfig(f"file://{tmp_path}", format="compact")
    a = make_engine(store=store)
    run_one(a, "a", prompts[0], GREEDY)
    a.close()
    b = make_engine(store=store)
    try:
        tokens, cached = run_one(b, "b", prompts[0], GREEDY)
        assert len(tokens) == GREEDY.max_tokens
        assert cached == full_blocks(prompts[0])
        assert b.prefix_cache_stats["hits_tokens_store"] == cached
        assert b.store_stats()["miss_reasons"] == {}
    finally:
        b.close()


def test_store_latency_stats_and_metrics() -> None:
    from kvserve.shared.engine.kv.latency import LatencyStats
    from kvserve.shared.telemetry import EngineStatsCollector
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    lat = LatencyStats((0.01, 0.1))
    lat.observe("get", 0.005)
    lat.observe("get", 0.05)
    lat.observe("get", 5.0)
    lat.error("put")
    with lat.time("put"):
        pass
    try:
        with lat.time("put"):
            raise OSError("store down")
    except OSError:
        pass
    snap = lat.snapshot()
    assert snap["bounds"] == [0.01, 0.1]
    assert snap["get"]["counts"] == [1, 1, 1] and snap["get"]["count"] == 3
    assert snap["put"]["count"] == 1 and snap["put"]["errors"] == 2
    collector = EngineStatsCollector("m")
    collector.snapshot = {"w0": {"store_latency": snap}}
    registry = CollectorRegistry()
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    get = {(s.name, s.labels.get("le")): s.value for s in fams["kvserve:store_get_seconds"].samples}
    assert get[("kvserve:store_get_seconds_bucket", "0.01")] == 1
    assert get[("kvserve:store_get_seconds_bucket", "0.1")] == 2
    assert get[("kvserve:store_get_seconds_bucket", "+Inf")] == 3
    assert get[("kvserve:store_get_seconds_count", None)] == 3
    errors = {s.labels["op"]: s.value for s in fams["kvserve:store_errors"].samples}
    assert errors == {"get": 0, "put": 2}


def test_store_lookups_are_one_counter_by_outcome() -> None:
    from kvserve.shared.telemetry import EngineStatsCollector
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    collector = EngineStatsCollector("m")
    store = {"lookups": {"hit": 3, "absent": 1, "corrupt": 0}, "fetched_blocks": 7}
    collector.snapshot = {"w0": {"store": store}}
    registry = CollectorRegistry()
    registry.register(collector)
    fams = {f.name: f for f in text_string_to_metric_families(generate_latest(registry).decode())}
    lookups = fams["kvserve:store_lookups"]
    assert lookups.type == "counter"
    assert {s.labels["outcome"]: s.value for s in lookups.samples} == {
        "hit": 3, "absent": 1, "corrupt": 0
    }  # fmt: skip
    assert "kvserve:store_fetched_blocks" in fams and "kvserve:store_lookups_hit" not in fams


def test_a_single_stored_block_is_recomputed(make_engine, prompts, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """One block costs less to recompute than to fetch (MIN_FETCH_BLOCKS); two are loaded."""
    from kvserve.shared.engine.kv.connector import MIN_FETCH_BLOCKS

    assert MIN_FETCH_BLOCKS == 2
    store = StoreConfig(f"file://{tmp_path}")
    a = make_engine(store=store)
    run_one(a, "a", prompts[0][:40], GREEDY)  # blocks 0 and 1 stored
    a.close()
    b = make_engine(store=store)
    try:
        _, cached = run_one(b, "one", prompts[0][:20], GREEDY)  # 1 block wanted
        assert cached == 0 and _lookups(b) == {"recompute": 1}
        b.reset_prefix_cache()
        _, cached = run_one(b, "two", prompts[0][:40], GREEDY)  # 2 blocks wanted
        assert cached == 32 and _lookups(b) == {"recompute": 1, "hit": 1}
    finally:
        b.close()


# fp8 and zstd frames (~5-7 s each: two engines) in the slow run only; the fp8 write's C++
# checks are tested bit for bit in test_load.py
@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8", marks=pytest.mark.slow)])
@pytest.mark.parametrize("comp", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_quantized_frames_load_exactly(
    make_engine, prompts, tmp_path: Path, fmt: str, comp: bool
) -> None:  # type: ignore[no-untyped-def]
    """An int8 / fp8 cache loads frames of its own format as a copy of their bytes and scales:
    bit for bit what the writing engine's cache held, with or without zstd. A float cache holds
    exactly the frames' dequantized K/V. Uncompressed frames after the first are read against
    the bytes their writer wrote for the request's blocks (the engine gives the load their
    tokens and parents)."""
    from kvserve.shared.store import codec
    from kvserve.shared.store.codec import DecodedBlock, decode_block

    from tests.shared.engine.kv.test_load import template_reads

    monkey = pytest.MonkeyPatch()
    monkey.setitem(codec.COMPRESS, fmt, comp)
    templated = template_reads(monkey)
    try:
        for kv_dtype in ("auto", fmt):
            store = StoreConfig(f"file://{tmp_path / kv_dtype / str(comp)}", format=fmt)
            a = make_engine(store=store, kv_dtype=kv_dtype)
            run_one(a, "a", prompts[0], GREEDY)
            root, hashes = _root_and_hashes(a, prompts[0])
            written = a.kv.cache.read_blocks([a.kv.pool.index.block_of(h) for h in hashes])
            a.close()
            disk = DiskStore(str(tmp_path / kv_dtype / str(comp)))
            frames = asyncio.run(disk.get_many(hashes))
            asyncio.run(disk.close())
            b = make_engine(store=store, kv_dtype=kv_dtype)
            templated.clear()
            try:
                _, cached = run_one(b, "b", prompts[0], GREEDY)
                assert cached == len(hashes) * b.block_size
                assert templated == ([] if comp else [True] * (len(hashes) - 1))
                assert b.prefix_cache_stats["hits_tokens_store"] == cached
                loaded = b.kv.cache.read_blocks([b.kv.pool.index.block_of(h) for h in hashes])
                for h, frame, mine, theirs in zip(hashes, frames, loaded, written, strict=True):
                    assert frame is not None and msgpack.unpackb(frame)["comp"] == (
                        "zstd" if comp else "none"
                    )
                    if kv_dtype != "auto":
                        for x, y in zip(_raw_parts(mine), _raw_parts(theirs), strict=True):
                            assert torch.equal(x, y)
                        continue
                    want = decode_block(frame, b.kv.connector.meta, h, root)
                    assert isinstance(want, DecodedBlock)
                    assert torch.equal(mine.k, want.k) and torch.equal(mine.v, want.v)
            finally:
                b.close()
    finally:
        monkey.undo()


def _raw_parts(block):  # type: ignore[no-untyped-def]
    return [t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
            for t in (block.k, block.v, block.k_scale, block.v_scale)]  # fmt: skip


def test_a_prefix_longer_than_a_batch_loads_its_later_batches_whole(
    make_engine, prompts, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A prefix of more blocks than one fetch batch, into an int8 cache from its own frames: the
    batches after the first go to the cache whole (KVCache.write_templated checks each frame
    against the template, then its checksum), every frame after the first is read by the
    template, and the blocks are the writing engine's bit for bit."""
    from kvserve.shared.engine.kv.cache import KVCache
    from kvserve.shared.engine.kv.connector import FETCH_BATCH

    from tests.shared.engine.kv.test_load import template_reads

    prompt = prompts[0] + prompts[1]  # two chats: 15 full blocks of 16
    store = StoreConfig(f"file://{tmp_path}", format="int8")
    monkey = pytest.MonkeyPatch()
    templated = template_reads(monkey)
    whole: list[int] = []
    write = KVCache.write_templated

    def counted(self, blocks, *args):  # type: ignore[no-untyped-def]
        whole.append(len(blocks))
        return write(self, blocks, *args)

    monkey.setattr(KVCache, "write_templated", counted)
    try:
        a = make_engine(store=store, kv_dtype="int8")
        want, _ = run_one(a, "a", prompt, GREEDY)
        _, hashes = _root_and_hashes(a, prompt)
        written = a.kv.cache.read_blocks([a.kv.pool.index.block_of(h) for h in hashes])
        a.close()
        assert len(hashes) > FETCH_BATCH
        b = make_engine(store=store, kv_dtype="int8")
        templated.clear()
        try:
            got, cached = run_one(b, "b", prompt, GREEDY)
            assert cached == len(hashes) * b.block_size and got == want
            assert whole == [len(hashes) - FETCH_BATCH]  # the second batch, in one call
            assert templated == [True] * (len(hashes) - 1)
            loaded = b.kv.cache.read_blocks([b.kv.pool.index.block_of(h) for h in hashes])
            for mine, theirs in zip(loaded, written, strict=True):
                for x, y in zip(_raw_parts(mine), _raw_parts(theirs), strict=True):
                    assert torch.equal(x, y)
        finally:
            b.close()
    finally:
        monkey.undo()
