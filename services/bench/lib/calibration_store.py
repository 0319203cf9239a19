"""The store part of `kvserve bench calibrate`: a prompt's blocks written, a presence round trip
and a stored run loaded, through the StoreConnector of engines on a Redis."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import redis
from kvserve.services.bench.lib.calibration_steps import SUFFIX, Driver, Grid
from kvserve.services.bench.lib.cost_fit import store_cost
from kvserve.services.bench.lib.engine_timing import first_token_s
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present
from kvserve.services.cli_support import CliError
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.connector import FetchResult
from kvserve.shared.engine.sim.profile import (
    StoreCost,
)
from kvserve.shared.store.redis import split_store_query

RTT_PROBES = 20


@dataclass(frozen=True)
class StoreMeasure:
    """What the store part measured (times in seconds)."""

    rtt_s: float  # median presence round trip of one block
    write_s: float  # median: a prompt chunk's blocks, from its step's end until flushed
    write_blocks: int
    load_s: float  # median FetchResult load time (gets, verification, decode, cache writes)
    load_blocks: int
    contains_s: float  # median presence of a load's whole prompt (the fetch's first stage)
    frame_bytes_per_token: float
    format: str

    def cost(self) -> StoreCost:
        """The profile's store figures: per-block costs with the round trip taken off."""
        return store_cost(self.rtt_s, self.load_s, self.load_blocks, self.write_s,
                          self.write_blocks, self.frame_bytes_per_token)  # fmt: skip


def timed_write(engine: Engine, rid: str, prompt: list[int]) -> float:
    """Seconds from the end of the prompt's one step (which published its full blocks) until
    the store holds them all."""
    first_token_s(engine, rid, prompt)
    t0 = time.perf_counter()
    if not engine.kv.flush():
        raise RuntimeError("the store did not take the blocks within 30 s")
    return time.perf_counter() - t0


def round_trip_s(engine: Engine, prompt: list[int]) -> float:
    """The median of RTT_PROBES presence questions for the prompt's first block."""
    first = engine.kv.prefix_hashes(prompt, None)[:1]
    times = []
    for _ in range(RTT_PROBES):
        t0 = time.perf_counter()
        engine.kv.stored(first)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_load(engine: Engine, rid: str, prompt: list[int], blocks: int) -> FetchResult:
    """The store lookup of a prompt whose first `blocks` blocks the store holds; RuntimeError
    unless all of them were loaded."""
    first_token_s(engine, rid, prompt)
    f = engine.kv.last_fetch
    if f is None or f.decision != "load" or f.loaded != blocks:
        got = "no lookup" if f is None else f"{f.decision}, {f.loaded} loaded"
        raise RuntimeError(f"the store load of {blocks} blocks did not happen ({got})")
    return f


def measure_store(make: Callable[[], Engine], grid: Grid) -> StoreMeasure:
    """Engine A writes prompts' blocks (timed, one untimed first) and the prefixes to load;
    a fresh engine B loads each prefix for the same prompt plus a suffix (one untimed
    first). Both engines are closed."""
    a = make()
    d = Driver(a, random.Random(1))
    n = grid.store_repeats + 1
    writes = [timed_write(a, f"w{i}", d.tokens(grid.write_tokens)) for i in range(n)][1:]
    prefixes = [d.tokens(grid.load_tokens) for _ in range(n)]
    for i, p in enumerate(prefixes):
        first_token_s(a, f"p{i}", p)
    a.kv.flush()
    rtt = round_trip_s(a, prefixes[0])
    conn = a.kv.connector
    assert conn is not None
    frame_bytes = conn.encoded_bytes / conn.encoded_tokens
    fmt = a.config.store.frame_format(a.config.cache.kv_dtype)
    prompts = [p + d.tokens(SUFFIX) for p in prefixes]
    a.close()
    del a, d  # A's cache goes before B's is made
    b = make()
    blocks = grid.load_tokens // b.block_size
    loads = [timed_load(b, f"l{i}", p, blocks) for i, p in enumerate(prompts)]
    b.close()
    return StoreMeasure(
        rtt_s=rtt,
        write_s=statistics.median(writes),
        write_blocks=grid.write_tokens // b.block_size,
        load_s=statistics.median(f.timings["load_s"] for f in loads[1:]),
        load_blocks=blocks,
        contains_s=statistics.median(f.timings["contains_s"] for f in loads[1:]),
        frame_bytes_per_token=frame_bytes,
        format=fmt,
    )


@contextlib.contextmanager
def redis_url(given: str | None) -> Iterator[str]:
    """The given URL, or a redis-server of its own (stopped after the block)."""
    if given is not None:
        yield given
        return
    if not redis_binaries_present():
        raise CliError("redis-server is not on PATH: install it or pass --redis URL")
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def flush_db(url: str) -> None:
    """FLUSHDB on the db the store URL names (its store-only query parameters dropped)."""
    try:
        with redis.Redis.from_url(split_store_query(url)[2]) as client:
            client.flushdb()
    except redis.RedisError as e:
        raise CliError(f"--redis {url}: FLUSHDB failed: {e}") from None
