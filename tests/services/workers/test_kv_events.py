"""KV events: the KV-cache manager logs every block that enters or leaves a tier (and a flush
as "cleared"), and the worker's publisher numbers, merges and sends them; a lost batch leaves a
gap in seq that a router can see."""

from __future__ import annotations

from typing import Any

import pytest
from kvserve.services.workers.kv_events import KVEventPublisher, merge
from kvserve.shared.engine.kv.events import TierEvent
from kvserve.shared.protocol import KVEvent
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.helpers import long_ids, run_one

GREEDY = SamplingParams(max_tokens=1, temperature=0.0)


class RecordingPort:
    """What a worker's port does with KV events, recorded; `fail` makes the next publish fail;
    `resync` is the next answer to `resync_requested`."""

    name = "w"

    def __init__(self) -> None:
        self.events: list[KVEvent] = []
        self.fail = False
        self.resync = False

    async def resync_requested(self) -> bool:
        asked, self.resync = self.resync, False
        return asked

    async def publish_kv_events(self, events: list[KVEvent]) -> None:
        if self.fail:
            self.fail = False
            raise ConnectionError("bus down")
        self.events += events


def test_the_manager_logs_stored_evicted_and_cleared_blocks(make_engine: Any, tokenizer: Any):
    engine = make_engine(num_blocks=6, block_size=16)
    kv = engine.kv
    kv.events.enable()
    prompt = long_ids(tokenizer, 0)[:50]  # 3 full blocks are cached (the 4th holds the last)
    run_one(engine, "a", prompt, GREEDY)
    stored = [h for e in kv.events.take() if e.kind == "stored" for h in e.hashes]
    assert stored == kv.prefix_hashes(prompt[:48], None)
    run_one(engine, "b", long_ids(tokenizer, 3)[:90], GREEDY)  # needs every block: evicts
    removed = [h for e in kv.events.take() if e.kind == "removed" for h in e.hashes]
    assert set(removed) == set(stored)
    kv.reset()
    assert kv.events.take()[-1] == TierEvent("cleared", "")
    assert kv.events.take() == []


def test_an_unread_log_past_its_bound_becomes_one_cleared(make_engine: Any, tokenizer: Any):
    engine = make_engine(num_blocks=16, block_size=16)
    engine.kv.events.enable()
    engine.kv.events.max_events = 2
    run_one(engine, "a", long_ids(tokenizer, 0)[:100], GREEDY)  # 6 blocks, one event each
    events = engine.kv.events.take()
    assert events[0] == TierEvent("cleared", "") and len(events) <= 2


def test_merge_joins_runs_of_one_kind_and_tier_within_the_bound() -> None:
    h = [bytes([i]) * 32 for i in range(5)]
    events = [TierEvent("stored", "device", (x,)) for x in h[:3]]
    events += [TierEvent("removed", "device", (h[3],)), TierEvent("cleared", "")]
    events += [TierEvent("cleared", ""), TierEvent("stored", "device", (h[4],))]
    assert merge(events) == [
        TierEvent("stored", "device", tuple(h[:3])),
        TierEvent("removed", "device", (h[3],)),
        TierEvent("cleared", ""),
        TierEvent("cleared", ""),
        TierEvent("stored", "device", (h[4],)),
    ]
    assert [len(e.hashes) for e in merge(events[:3], max_hashes=2)] == [2, 1]


@pytest.mark.asyncio
async def test_the_publisher_numbers_events_and_a_lost_batch_leaves_a_gap(
    make_engine: Any, tokenizer: Any
) -> None:
    engine = make_engine(num_blocks=32, block_size=16)
    port = RecordingPort()
    publisher = KVEventPublisher(port, engine.kv.events, "inc-1")  # type: ignore[arg-type]
    run_one(engine, "a", long_ids(tokenizer, 0)[:50], GREEDY)
    await publisher.flush()
    assert [(e.seq, e.op, e.tier, len(e.block_hashes)) for e in port.events] == [
        (0, "stored", "device", 3)
    ]
    engine.kv.reset()
    port.fail = True
    await publisher.flush()  # lost: the removal and the "cleared" (seq 1, 2) are never seen
    run_one(engine, "b", long_ids(tokenizer, 2)[:40], GREEDY)
    await publisher.flush()
    assert [e.seq for e in port.events] == [0, 3] and publisher.failed == 2
    assert all(e.worker == "w" and e.incarnation == "inc-1" for e in port.events)


@pytest.mark.asyncio
async def test_a_requested_snapshot_is_cleared_then_every_block(
    make_engine: Any, tokenizer: Any
) -> None:
    engine = make_engine(num_blocks=32, block_size=16)
    port = RecordingPort()

    async def snapshot() -> None:
        engine.kv.log_snapshot(chunk=2)

    publisher = KVEventPublisher(port, engine.kv.events, "inc-1", snapshot, resync_every=1)  # type: ignore[arg-type]
    prompt = long_ids(tokenizer, 0)[:50]
    run_one(engine, "a", prompt, GREEDY)
    await publisher.flush()
    port.events.clear()
    await publisher._resync_if_asked()  # not asked: nothing
    assert publisher.snapshots == 0
    port.resync = True
    await publisher._resync_if_asked()
    await publisher.flush()
    # logged in chunks of 2, published merged
    assert [(e.op, len(e.block_hashes)) for e in port.events] == [("cleared", 0), ("stored", 3)]
    assert [h for e in port.events for h in e.block_hashes] == engine.kv.prefix_hashes(
        prompt[:48], None
    )
