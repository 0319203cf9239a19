"""`kvserve bench store` end to end at tiny sizes against the local Redis: it runs and its last
line is the JSON summary with the keys the issue names (speed is measured, not asserted)."""

from __future__ import annotations

import json

import pytest
from kvserve.services import cli

from tests.services.bench.cli_output import one_line_error


@pytest.mark.redis
@pytest.mark.slow  # ~21 s; a benchmark's smoke run (2-core AVX2 machine)
def test_bench_store_tiny(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "store", "--parts", "formats,ttft,throughput", "--formats", "fp16,int8"]
    args += ["--text-tokens", "48"]
    args += ["--plot", str(tmp_path / "store.png")]
    args += ["--gen-tokens", "8", "--num-prompts", "1", "--prefix-tokens", "64"]
    args += ["--repeats", "1", "--blocks", "8", "--batch", "4"]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert set(summary["bytes_per_token"]) == {"fp16", "int8"}
    assert summary["ratio_int8_vs_fp16"] < 0.55
    assert summary["ttft_breakdown"][0]["cached_tokens"] == 64
    for key in ("ttft_store_s", "ttft_recompute_s", "speedup", "get_mb_per_s", "put_mb_per_s"):
        assert summary[key] > 0
    assert (tmp_path / "store.png").stat().st_size > 0


def test_bench_store_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    for args in (
        ["bench", "store", "--parts", "nope"],
        ["bench", "store", "--formats", "int3"],
        ["bench", "store", "--repeats", "0"],
        ["bench", "store", "--breakeven-lengths", "16,abc"],
        ["bench", "store", "--breakeven-formats", "int3"],
        ["bench", "store", "--format", "int8,int3"],
        ["bench", "store", "--kv-dtypes", "auto,bf16"],
        ["bench", "store", "--prefix-tokens", "2048,32"],
        ["bench", "store", "--prefix-tokens", "2048,abc"],
    ):
        assert "--" in one_line_error(args, capsys)
    # The model's 8192 positions less room for a question.
    err = one_line_error(["bench", "store", "--parts", "ttft", "--prefix-tokens", "8192"], capsys)
    assert "--prefix-tokens" in err and "64..8160" in err


@pytest.mark.redis
@pytest.mark.slow  # ~55 s: ten engines (2-core AVX2 machine)
def test_bench_store_ttft_grid(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Two cache dtypes x two formats in one run: a table line and a summary per combination,
    the recompute and device hit shared by a dtype's formats, the first's figures also at the
    top level, the plot written."""
    args = ["bench", "store", "--parts", "ttft", "--prefix-tokens", "64"]
    args += ["--kv-dtypes", "auto,int8", "--format", "int8,native", "--repeats", "1"]
    args += ["--plot", str(tmp_path / "ttft.png")]
    assert cli.main(args) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    summary = json.loads(lines[-1])
    runs = summary["ttft_runs"]
    grid = [(64, kv, f) for kv in ("auto", "int8") for f in ("int8", "native")]
    assert [(r["prefix_tokens"], r["kv_dtype"], r["ttft_format"]) for r in runs] == grid
    for n, kv, f in grid:
        assert any(line.split()[:3] == [str(n), kv, f] for line in lines[:-1])
    for r in runs:
        assert r["cached_tokens"] == r["prefix_tokens"]
        assert r["speedup"] == pytest.approx(r["ttft_recompute_s"] / r["ttft_store_s"])
        assert r["store_vs_device"] == pytest.approx(r["ttft_store_s"] / r["ttft_device_s"])
        assert r["store_bytes_per_token"] > 0 and r["decode_cpu_ms_per_block"] > 0
        assert "decode_cpu_s" in r["ttft_breakdown_median_s"]
    for a, b in zip(runs[::2], runs[1::2], strict=True):  # a pair's two formats
        assert a["ttft_recompute_s"] == b["ttft_recompute_s"]
        assert a["ttft_device_s"] == b["ttft_device_s"]
    assert runs[1]["store_bytes_per_token"] > runs[0]["store_bytes_per_token"]  # native > int8
    assert summary["ttft_store_s"] == runs[0]["ttft_store_s"]
    assert (tmp_path / "ttft.png").stat().st_size > 0


@pytest.mark.slow  # ~10 s: four engines and their loads (2-core AVX2 machine)
@pytest.mark.redis
def test_bench_store_breakeven_tiny(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """One block and four blocks, int8: every TTFT measured, the rule's choice named, the ratio
    to the faster choice computed from them, the plot written."""
    args = ["bench", "store", "--parts", "breakeven", "--breakeven-formats", "int8"]
    args += ["--breakeven-lengths", "16,64", "--repeats", "1"]
    args += ["--breakeven-plot", str(tmp_path / "breakeven.png")]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = summary["breakeven"]
    assert [(r["format"], r["prefix_tokens"]) for r in rows] == [("int8", 16), ("int8", 64)]
    for r in rows:
        best = min(r["ttft_load_s"], r["ttft_recompute_s"])
        assert r["rule_over_best"] == pytest.approx(r["ttft_rule_s"] / best)
        assert r["rule_chose"] in ("load", "recompute")
    assert summary["breakeven_rule_worst"] == max(r["rule_over_best"] for r in rows)
    assert (tmp_path / "breakeven.png").stat().st_size > 0


@pytest.mark.redis
@pytest.mark.slow  # ~10-19 s: eight connectors and caches
def test_bench_store_load_tiny(capsys) -> None:  # type: ignore[no-untyped-def]
    """Four blocks through every load arm: each loads them all (the bench checks), its figures
    are measured, frames of a quantized cache are a quarter of native ones, and the bench
    leaves no key behind in its namespaces."""
    from kvserve.services.bench.store_load import LOAD_ARMS

    before = _bench_keys()
    args = ["bench", "store", "--parts", "load", "--prefix-tokens", "64", "--repeats", "1"]
    assert cli.main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["arm"]: r for r in summary["load_arms"]}
    assert list(rows) == [a.name for a in LOAD_ARMS] and summary["load_prefix_tokens"] == 64
    for r in rows.values():
        assert r["load_ms"] > 0 and r["verify_ms"] > 0 and r["write_ms"] > 0
        assert r["load_range_ms"][0] <= r["load_ms"] <= r["load_range_ms"][1]
    native, int8 = rows["native -> fp32 cache"], rows["int8 -> int8 cache"]
    assert int8["bytes_per_token"] < 0.3 * native["bytes_per_token"]
    assert _bench_keys() == before


def _bench_keys() -> int:
    import redis

    client = redis.Redis.from_url("redis://127.0.0.1:6379/15")
    try:
        return sum(1 for _ in client.scan_iter(match="load-*", count=1000))
    finally:
        client.close()
