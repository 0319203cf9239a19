"""`kvserve bench kvquant` end to end at tiny sizes: it runs and its last line is the JSON
summary (speed is measured by the benchmark, not asserted); bad options are one-line errors."""

from __future__ import annotations

import pytest
from kvserve.services import cli

from tests.services.bench.cli_output import last_json, one_line_error


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


@pytest.mark.parametrize("option", [["--budget", "lots"], ["--gen-tokens", "0"]])
def test_bad_arguments_are_one_line_errors(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert one_line_error(["bench", "kvquant", *option], capsys).startswith("kvserve bench: error:")
