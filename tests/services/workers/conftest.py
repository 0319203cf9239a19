"""Fixtures of the worker tests: `disagg_engines` (a prefill and a decode engine for the
session) and `disagg` (the topology of tests/services/workers/disagg.py, fresh for each test)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
from kvserve.services.workers.decode import DecodeWorker
from kvserve.services.workers.prefill import PrefillWorker
from kvserve.shared.config import StoreConfig
from kvserve.shared.engine.async_engine import AsyncEngine

from tests.services.workers.disagg import NUM_BLOCKS, AckRecordingPort, Disagg, SharedMemoryStore


@pytest.fixture(scope="session")
def disagg_engines(make_engine: Callable[..., Any]) -> Iterator[tuple[Any, Any]]:
    """(prefill engine, decode engine), each with a store connector (memory://, native
    blocks: outputs equal recomputation). Used by one test at a time."""
    store = StoreConfig(url="memory://")
    engines = (
        make_engine(num_blocks=NUM_BLOCKS, store=store),
        make_engine(num_blocks=NUM_BLOCKS, store=store),
    )
    yield engines
    for e in engines:
        e.close()


def _fresh(engine: Any, store: SharedMemoryStore) -> None:
    """The engine as a new process would find it: empty prefix cache and host tier, the given
    store, and the store cost rule's seeded estimates (so a fetch is chosen over a recompute
    whatever earlier tests measured)."""
    engine.kv.connector.flush()  # the previous test's block writes go to the previous store
    engine.reset_prefix_cache()
    engine.kv.prefill_s_per_token = 1 / 300
    engine.kv.connector.store = store
    engine.kv.connector.rtt_s = 0.002
    engine.kv.connector.fetch_s_per_block = 0.005


@pytest.fixture
async def disagg(disagg_engines: tuple[Any, Any]) -> AsyncIterator[Disagg]:
    prefill_engine, decode_engine = disagg_engines
    store = SharedMemoryStore()
    for engine in disagg_engines:
        _fresh(engine, store)
    d = Disagg(store)
    d.prefill_port = AckRecordingPort(d.prefill_bus.worker("prefill-0"))
    d.decode_port = AckRecordingPort(d.decode_bus.worker("decode-0"))
    d.prefill = PrefillWorker(d.prefill_port, AsyncEngine(prefill_engine), d.forward, poll_s=0.05)
    d.decode = DecodeWorker(d.decode_port, AsyncEngine(decode_engine), poll_s=0.05)
    await d.prefill.start()
    await d.decode.start()
    try:
        yield d
    finally:
        for worker in (d.prefill, d.decode):
            await worker.stop(drain_timeout=0)
            worker.engine.stop()
