"""The engine stats collector: bus drops exposed as `kvserve:bus_dropped_messages_total` (the
workers' from their reports, the owner's own with an empty `worker` label), and a worker's
report of the wrong shape left out of the scrape rather than failing it."""

from __future__ import annotations

from typing import Any

from kvserve.shared.telemetry import EngineStatsCollector
from prometheus_client import CollectorRegistry, generate_latest


def scrape(collector: EngineStatsCollector) -> list[str]:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode().splitlines()


def samples(lines: list[str], name: str) -> list[str]:
    return [line for line in lines if line.startswith(name + "{")]


def test_bus_drops_of_the_workers_and_of_the_owner() -> None:
    c = EngineStatsCollector("m")
    c.snapshot = {
        "w1": {"bus_dropped": {"requests": {"not_msgpack": 2, "oversized": 1}}},
        "w2": {"num_requests_running": 1},  # nothing dropped: no sample
    }
    c.own_bus_dropped = {"events": {"version": 3}}
    assert samples(scrape(c), "kvserve:bus_dropped_messages_total") == [
        'kvserve:bus_dropped_messages_total{model_name="m",reason="version",stream="events",'
        'worker=""} 3.0',
        'kvserve:bus_dropped_messages_total{model_name="m",reason="not_msgpack",'
        'stream="requests",worker="w1"} 2.0',
        'kvserve:bus_dropped_messages_total{model_name="m",reason="oversized",'
        'stream="requests",worker="w1"} 1.0',
    ]


def test_a_report_of_the_wrong_shape_is_left_out() -> None:
    bad: dict[str, Any] = {
        "num_requests_running": "3",
        "cached_tokens_by_source": [1, 2],
        "store": ["hits", 1],
        "store_latency": {"bounds": "x", "get": {"counts": ["a", "b"]}, "put": [1]},
        "bus_dropped": {"requests": [1], "cancel": {"invalid": "1"}},
    }
    good = {
        "num_requests_running": 2,
        "store": {"hits": 1, "lookups": {"hit": 4}},
        "store_latency": {"bounds": [0.1], "get": {"counts": [1, 1], "sum": 0.3, "errors": 0}},
    }
    c = EngineStatsCollector("m")
    c.snapshot = {"bad": bad, "good": good}
    lines = scrape(c)
    assert samples(lines, "kvserve:num_requests_running") == [
        'kvserve:num_requests_running{model_name="m",worker="good"} 2.0'
    ]
    assert samples(lines, "kvserve:store_hits") == [
        'kvserve:store_hits{model_name="m",worker="good"} 1.0'
    ]
    assert samples(lines, "kvserve:store_get_seconds_count") == [
        'kvserve:store_get_seconds_count{model_name="m",worker="good"} 2.0'
    ]
    assert samples(lines, "kvserve:store_lookups_total") == [
        'kvserve:store_lookups_total{model_name="m",outcome="hit",worker="good"} 4.0'
    ]
    assert samples(lines, "kvserve:bus_dropped_messages_total") == []
