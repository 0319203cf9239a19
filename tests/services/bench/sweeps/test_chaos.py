"""`kvserve bench chaos`: its arguments, its report, and (slow) a short real run against
`kvserve serve` on a Redis behind the fault proxy, whose invariants must hold: no request lost,
no greedy answer changed, no KV block leaked."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
from kvserve.services.bench.lib.redis_server import redis_binaries_present
from kvserve.services.bench.sweeps import chaos
from kvserve.services.bench.sweeps.chaos_report import FaultReport, table
from kvserve.services.bench.sweeps.chaos_soak import slope
from kvserve.services.cli_support import CliError


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
