"""`kvserve bench prefix` and `kvserve bench kvquant` end to end at tiny sizes: they run and
their last line is the JSON summary (speed is measured by the benchmarks, not asserted)."""

from __future__ import annotations

import json

import pytest
from kvserve.services import cli


def last_json(capsys) -> dict:  # type: ignore[no-untyped-def, type-arg]
    lines = capsys.readouterr().out.strip().splitlines()
    return json.loads(lines[-1])  # type: ignore[no-any-return]


@pytest.mark.slow  # ~20 s; the prefix-cache behaviour itself is in tests/engine
def test_bench_prefix_tiny(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = [
        "bench",
        "prefix",
        "--system-len",
        "64",
        "--question-len",
        "8",
        "--repeats",
        "1",
        "--gsp-groups",
        "2",
        "--gsp-per-group",
        "2",
        "--gsp-prefix-len",
        "32",
        "--gsp-question-len",
        "8",
        "--gsp-output-len",
        "4",
        "--w1-requests",
        "0",
        "--sweep",
        "0,32",
        "--plot",
        str(tmp_path / "ttft.png"),
    ]
    assert cli.main(args) == 0
    summary = last_json(capsys)
    for key in ("ttft_cold_s", "ttft_warm_s", "ttft_reduction", "gsp_speedup"):
        assert summary[key] > 0 or key == "ttft_reduction"
    assert summary["gsp_on"]["tokens"] == summary["gsp_off"]["tokens"] == 2 * 2 * 4
    assert summary["sweep_lengths"] == [0, 32]
    assert (tmp_path / "ttft.png").stat().st_size > 0


@pytest.mark.slow  # ~15 s; a benchmark's smoke run (2-core AVX2 machine)
def test_bench_kvquant_tiny(capsys) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "kvquant", "--text-tokens", "64", "--gen-tokens", "8", "--num-prompts", "2"]
    assert cli.main(args) == 0
    summary = last_json(capsys)
    assert summary["bytes_per_token"] == {"fp32": 46080, "int8": 12240, "fp8": 12240}
    for key in (
        "kld_int8",
        "ppl_delta_int8",
        "agree_int8",
        "kld_fp8",
        "ppl_delta_fp8",
        "agree_fp8",
    ):
        assert key in summary
    assert 0 <= summary["agree_int8"] <= 1 and summary["kld_int8"] >= 0


def test_bad_arguments_are_one_line_errors(capsys) -> None:  # type: ignore[no-untyped-def]
    for args in (
        ["bench", "prefix", "--sweep", "0,abc"],
        ["bench", "prefix", "--repeats", "0"],
        ["bench", "prefix", "--parts", "nope"],
        ["bench", "kvquant", "--budget", "lots"],
        ["bench", "kvquant", "--gen-tokens", "0"],
    ):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("kvserve bench: error:") and err.count("\n") == 1
