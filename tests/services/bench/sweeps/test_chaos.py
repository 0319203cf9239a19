"""`kvserve bench chaos`: its arguments, its report (poisoned requests counted apart, skipped
faults, the faults' counters), the pieces of its faults (which apply where, the garbage written
into the bus, the supervisor, the bus streams the soak reads), a short real run of a poisoned
load against `kvserve serve`, and (slow) a longer one whose invariants must hold: no request
lost, no greedy answer changed, no KV block leaked."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kvserve.services.bench.lib.process import ServerProcess
from kvserve.services.bench.lib.redis_server import redis_binaries_present
from kvserve.services.bench.sweeps import chaos
from kvserve.services.bench.sweeps.chaos_counters import Counters, counter, fill
from kvserve.services.bench.sweeps.chaos_faults import FAULTS, NEW_FAULTS, skip_reason
from kvserve.services.bench.sweeps.chaos_garbage import (
    GARBAGE,
    OVERSIZED_BYTES,
    garbage,
    real_message,
    target_streams,
)
from kvserve.services.bench.sweeps.chaos_load import Outcome
from kvserve.services.bench.sweeps.chaos_redis import RedisNode, bus_streams
from kvserve.services.bench.sweeps.chaos_report import FaultReport, table
from kvserve.services.bench.sweeps.chaos_soak import fold_out, slope
from kvserve.services.bench.sweeps.chaos_supervisor import Supervisor
from kvserve.services.cli_support import CliError
from kvserve.shared.protocol import ProtocolError, decode, encode


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    chaos.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ("--targets", "nope"),
        ("--faults", "redis-kill,meteor"),
        ("--faults", ""),
        ("--rate", "0"),
        ("--calm-s", "-1"),
        ("--max-queue", "0"),
        ("--faults", "worker-stop", "--fault-s", "3"),  # not past the workers' --claim-idle
    ],
)
def test_bad_arguments_are_one_line_errors(argv: tuple[str, ...]) -> None:
    with pytest.raises(CliError):
        chaos._check(parse(*argv))


def test_the_table_names_every_failure_kind() -> None:
    report = FaultReport(
        "burst", sent=32, ok=9, failed={"http_503": 23}, failed_with_retry_after=23,
        p99_ttft_s=1.5, p99_ttft_calm_s=0.5, used_blocks_before=0, used_blocks_after=0,
    )  # fmt: skip
    text = table({"target": "serve", "faults": [asdict(report)]})
    assert "http_503: 23 (23 w/ Retry-After)" in text
    assert "1.50 / 0.50" in text and "0->0" in text


@pytest.mark.slow
@pytest.mark.redis
def test_a_short_chaos_run_loses_nothing(tmp_path: Path) -> None:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    cmd = [
        sys.executable, "-m", "kvserve.services.cli", "bench", "chaos", "--targets", "serve",
        "--faults", "net-cut,redis-kill,client-disconnect,burst", "--rate", "2",
        "--calm-s", "3", "--fault-s", "3", "--recover-s", "5", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout.strip().splitlines()[-1])
    faults = {r["fault"]: r for r in result["faults"]}
    assert set(faults) == {"net-cut", "redis-kill", "client-disconnect", "burst"}
    for r in faults.values():
        assert r["lost"] == 0 and r["wrong"] == 0, r
        assert r["used_blocks_after"] == r["used_blocks_before"], r
    burst = faults["burst"]
    assert burst["failed"].get("http_503", 0) == burst["failed_with_retry_after"]
    assert faults["redis-kill"]["store_back_s"] is not None


def test_soak_slopes_and_the_soak_alone() -> None:
    assert slope([5.0, 5.0, 5.0]) == 0.0
    assert slope([1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert chaos._check(parse("--faults", "none", "--soak-min", "2"))[1] == []
    with pytest.raises(CliError):
        chaos._check(parse("--soak-min", "-1"))


def test_every_fault_runs_by_default() -> None:
    _, faults = chaos._check(parse())
    assert faults == list(FAULTS) and set(NEW_FAULTS) <= set(faults)
    assert chaos._check(parse("--faults", "worker-stop", "--fault-s", "3.5"))[1] == ["worker-stop"]


def outcome(i: int, phase: str, result: str, **kw: Any) -> Outcome:
    return Outcome(i, "plain-greedy", 0, float(i), phase, result, **kw)


def test_poisoned_requests_are_counted_apart() -> None:
    outcomes = [
        outcome(0, "calm:poison-raise", "ok", ttft_s=0.2),
        outcome(1, "calm:poison-raise", "http_500", code="internal_error", fault="raise"),
        outcome(2, "poison-raise", "ok", ttft_s=0.4),
        outcome(3, "poison-raise", "wrong", ttft_s=0.3),
        outcome(4, "poison-raise", "lost"),
        outcome(5, "poison-raise", "http_503", retry_after=True, code="overloaded"),
        outcome(6, "poison-raise", "http_500", code="internal_error", fault="raise"),
        outcome(7, "poison-raise", "http_500", code="internal_error", fault="raise"),
        outcome(8, "poison-raise", "stream_error", code="internal_error", fault="raise"),
        outcome(9, "poison-raise", "ok", ttft_s=9.0, fault="raise"),  # the fault missed
    ]
    outcomes[0].done_s = 1.0
    # a calm request still in flight when the fault began at 2.0: no calm figure
    outcomes.append(outcome(10, "calm:poison-raise", "ok", ttft_s=5.0, done_s=6.0))
    rep = FaultReport("poison-raise")
    rep.count(outcomes, fault_start_s=2.0)
    assert (rep.sent, rep.ok, rep.wrong, rep.lost) == (4, 1, 1, 1)
    assert rep.failed == {"http_503": 1} and rep.failed_with_retry_after == 1
    assert rep.poisoned == {"http_500 internal_error": 2, "stream_error internal_error": 1,
                            "ok": 1}  # fmt: skip
    assert rep.p99_ttft_s == 0.4 and rep.p99_ttft_calm_s == 0.2  # poisoned ones left out
    rep.count(outcomes)
    assert rep.p99_ttft_calm_s == 5.0


def test_the_table_shows_skips_poisoned_requests_deaths_and_counters() -> None:
    reports = [
        FaultReport("bad-message", skipped="serve's bus is in its process"),
        FaultReport("poison-kill", sent=10, ok=10, poisoned={"http_500 quarantined": 1},
                    workers_lost=2, died=["worker-1", "worker-0"]),
        FaultReport("redis-full", sent=10, ok=10, evicted_keys={"bus": 0, "store": 12}),
        FaultReport("slow-reader", sent=12, ok=12, stream_stalls=4),
        FaultReport("worker-stop", sent=12, ok=12, taken_over=None),
    ]  # fmt: skip
    lines = table({"target": "fleet", "faults": [asdict(r) for r in reports]}).splitlines()
    skipped, kill, full, slow, stop = lines[3:]
    assert skipped.split() == ["bad-message", "skipped:", "serve's", "bus", "is", "in", "its",
                               "process"]  # fmt: skip
    assert "1 (http_500 quarantined: 1)" in kill and kill.endswith("died: worker-1 worker-0")
    assert full.endswith("evicted bus 0, store 12")
    assert slow.endswith("stalls 4") and stop.endswith("taken over -")


METRICS = """\
# HELP kvserve:stream_stalls_total Streams aborted.
# TYPE kvserve:stream_stalls_total counter
kvserve:stream_stalls_total 3.0
# HELP kvserve:bus_dropped_messages_total Bus messages dropped.
# TYPE kvserve:bus_dropped_messages_total counter
kvserve:bus_dropped_messages_total{worker="",stream="events",reason="invalid"} 2.0
kvserve:bus_dropped_messages_total{worker="w0",stream="requests",reason="version"} 5.0
"""


def test_counters_are_read_from_prometheus_text_and_differenced() -> None:
    assert counter(METRICS, "kvserve:stream_stalls") == {(): 3.0}
    assert counter(METRICS, "kvserve:no_such") is None
    dropped = counter(METRICS, "bus_dropped_messages")
    assert dropped is not None and sorted(dropped.values()) == [2.0, 5.0]
    before = Counters(stalls=1.0, dropped={"events/invalid": 2.0}, evicted={"bus": 0, "store": 50},
                      taken_over=1)  # fmt: skip
    after = Counters(stalls=5.0, dropped={"events/invalid": 2.0, "requests/version": 5.0},
                     evicted={"bus": 0, "store": 7}, taken_over=3)  # fmt: skip
    rep = FaultReport("bad-message")
    fill(rep, before, after, "fleet")
    assert (rep.stream_stalls, rep.bus_dropped, rep.taken_over) == (4, 5, 2)
    assert rep.bus_dropped_by == {"requests/version": 5}
    assert rep.evicted_keys == {"bus": 0, "store": 7}  # the store restarted: counted from 0
    served = FaultReport("worker-stop")
    fill(served, Counters(None, None, {}, 0), Counters(None, None, {}, 0), "serve")
    assert (served.stream_stalls, served.bus_dropped, served.taken_over) == (None, None, None)


def test_which_faults_apply_where() -> None:
    serve = SimpleNamespace(kind="serve", procs={"serve": None})
    fleet = SimpleNamespace(kind="fleet", procs=dict.fromkeys(["gateway", "worker-0", "worker-1"]))
    skipped = {f for f in FAULTS if skip_reason(f, serve) is not None}  # type: ignore[arg-type]
    assert skipped == {"bad-message", "poison-kill", "worker-kill", "prefill-kill", "decode-kill"}
    skipped = {f for f in FAULTS if skip_reason(f, fleet) is not None}  # type: ignore[arg-type]
    assert skipped == {"prefill-kill", "decode-kill"}


@pytest.mark.parametrize("stream", ["kvserve:prefill", "kvserve:cancel", "kvserve:kv_events",
                                    "kvserve:out:cmpl-1"])  # fmt: skip
def test_every_garbage_entry_is_one_a_reader_refuses(stream: str) -> None:
    message = real_message(stream)
    real = encode(message)
    assert decode(real) == message  # made from a valid message of the stream
    reasons = {}
    for kind in GARBAGE:
        entry = garbage(kind, real)
        if b"m" not in entry:
            reasons[kind] = "missing_field"
        elif len(entry[b"m"]) > OVERSIZED_BYTES - 1:
            reasons[kind] = "oversized"
        else:
            with pytest.raises(ProtocolError) as refused:
                decode(entry[b"m"])
            reasons[kind] = refused.value.reason
    assert OVERSIZED_BYTES > 8 << 20  # past the bus's bound
    assert reasons["truncated"] == "not_msgpack" and reasons["version"] == "version"
    assert reasons["mistyped"] == "invalid" and reasons["no_m"] == "missing_field"
    assert reasons["oversized"] == "oversized" and set(reasons) == set(GARBAGE)


class Streams:
    """A Redis client's SCAN over stream keys, and nothing else."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys

    def scan_iter(self, match: str, count: int, _type: str) -> list[bytes]:
        assert (match, _type) == ("kvserve:*", "stream")
        return [k.encode() for k in self.keys]


def test_garbage_goes_to_every_stream_read_token_events_first() -> None:
    there = ["kvserve:prefill", "kvserve:out:b", "kvserve:out:a", "kvserve:resync:decode-0"]
    streams = target_streams(Streams(there), "disagg", ["prefill-0", "decode-0"])
    assert streams == [
        "kvserve:out:a", "kvserve:out:b", "kvserve:cancel", "kvserve:decode", "kvserve:kv_events",
        "kvserve:prefill", "kvserve:resync:decode-0", "kvserve:to:decode-0",
        "kvserve:to:prefill-0",
    ]  # fmt: skip
    assert "kvserve:decode" not in target_streams(Streams([]), "fleet", ["worker-0"])


async def test_the_supervisor_restarts_a_dead_process_and_counts_it_once() -> None:
    died = ServerProcess("worker-0", [sys.executable, "-c", "raise SystemExit(3)"]).spawn()
    held = ServerProcess("worker-1", [sys.executable, "-c", "pass"]).spawn()
    assert died.wait(30) == 3 and held.wait(30) == 0
    assert died.proc is not None and held.proc is not None
    first, held_pid = died.proc.pid, held.proc.pid
    sup = Supervisor({"worker-0": died, "worker-1": held}, respawn_s=0.0, poll_s=0.01)
    with sup.hold("worker-1"):
        sup.check()
        sup.check()  # the same death, seen again: recorded once
        assert [(d.name, d.returncode) for d in sup.deaths] == [("worker-0", 3)]
        await sup.settle()
        assert died.proc.pid != first and held.proc.pid == held_pid  # only worker-0 restarted
        assert sup.since(sup.deaths[0].at) == sup.deaths
    died.wait(30)  # the restarted one dies too
    sup.check()
    assert [d.name for d in sup.deaths] == ["worker-0", "worker-0", "worker-1"]
    await sup.settle()
    assert held.proc.pid != held_pid  # no longer held: restarted
    assert died.wait(30) == 3 and held.wait(30) == 0


@pytest.mark.redis
def test_the_soak_reads_every_bus_stream_and_its_pending_entries(tmp_path: Path) -> None:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    bus = RedisNode("bus", tmp_path / "bus.log")
    bus.start()
    try:
        r = bus.client()
        for _ in range(3):
            r.xadd("kvserve:prefill", {b"m": b"x"})
        r.xgroup_create("kvserve:prefill", "prefill", id="0")
        r.xreadgroup("prefill", "w0", {"kvserve:prefill": ">"}, count=2)  # 2 pending, unacked
        for key in ("kvserve:out:a", "kvserve:out:b", "other:stream"):
            r.xadd(key, {b"m": b"x"})
        r.zadd("kvserve:workers", {"w0": 1.0})  # not a stream
        assert r.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        r.close()
        streams = bus_streams(bus)
    finally:
        bus.stop()
    assert streams == {
        "kvserve:out:a": {"len": 1, "pending": 0},
        "kvserve:out:b": {"len": 1, "pending": 0},
        "kvserve:prefill": {"len": 3, "pending": 2},
    }
    assert fold_out(streams) == {
        "kvserve:prefill": {"len": 3, "pending": 2},
        "kvserve:out:*": {"len": 2, "pending": 0, "streams": 2},
    }


@pytest.mark.redis
@pytest.mark.slow  # a real serve under the bench: ~15 s
def test_poisoned_requests_fail_alone_against_serve(tmp_path: Path) -> None:
    """A real short run (about 15 s here): each poisoned request fails with its code, every
    other request is ok, no process dies, no block leaks."""
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    cmd = [
        sys.executable, "-m", "kvserve.services.cli", "bench", "chaos", "--targets", "serve",
        "--faults", "poison-raise,bad-message", "--rate", "2", "--calm-s", "2", "--fault-s", "3",
        "--recover-s", "2", "--out", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (result,) = json.loads(done.stdout.strip().splitlines()[-1])
    raised, bad = result["faults"]
    assert bad["fault"] == "bad-message" and bad["skipped"]
    assert raised["poisoned"] == {"http_500 internal_error": 4}
    assert raised["sent"] == raised["ok"] > 0 and raised["failed"] == {}
    assert raised["workers_lost"] == 0
    assert raised["used_blocks_after"] == raised["used_blocks_before"] == 0
    assert "poison-raise" in done.stdout and "skipped: serve's bus" in done.stdout
