"""`kvserve bench startup` end to end, one run of each command: every part is reported, the
parts of a `generate` account for most of its wall time and never for more, and bad options are
one-line errors. Speed is not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvserve.services.bench.startup import ENGINE_PARTS
from kvserve.services.cli import main


@pytest.mark.slow  # ~6-8 s: an engine and a server started and timed (2-core AVX2 machine)
def test_startup_reports_every_part(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "startup", "--repeats", "1", "--max-tokens", "2", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ")
    summary = json.loads((tmp_path / "startup.json").read_text())
    assert json.loads(out.strip().splitlines()[-1]) == summary
    (gen,) = summary["generate"]["runs"]
    parts = ["interpreter", "imports", *ENGINE_PARTS[:5], "first_step", "rest", "exit"]
    assert list(gen) == [*parts, "total"]
    assert all(gen[k] >= 0 for k in parts)
    # The parts are disjoint stretches of the run: together at most its wall time, and most
    # of it (argument parsing, tokenizing the prompt and the engine's own set-up are not parts).
    assert 0.5 * gen["total"] <= sum(gen[k] for k in parts) <= gen["total"]
    (serve,) = summary["serve"]["runs"]
    assert list(serve) == ["listening", *ENGINE_PARTS, "total"]
    assert 0 < serve["listening"] <= serve["total"]
    assert summary["serve"]["target_s"] == 10.0 and summary["generate"]["target_s"] == 5.0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--parts", "boot"], "--parts: unknown ['boot']"),
        (["--repeats", "0"], "--repeats must be >= 1"),
    ],
)
def test_bad_options_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "startup", *args]) == 2
    assert capsys.readouterr().err == f"kvserve bench: error: {message}\n"
