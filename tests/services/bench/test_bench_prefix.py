"""`kvserve bench prefix` end to end at tiny sizes: it runs and its last line is the JSON
summary (speed is measured by the benchmark, not asserted); bad options are one-line errors."""

from __future__ import annotations

import pytest
from kvserve.services import cli

from tests.services.bench.cli_output import last_json, one_line_error


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


@pytest.mark.parametrize("option", [["--sweep", "0,abc"], ["--repeats", "0"], ["--parts", "nope"]])
def test_bad_arguments_are_one_line_errors(
    option: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert one_line_error(["bench", "prefix", *option], capsys).startswith("kvserve bench: error:")
