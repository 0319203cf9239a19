"""`kvserve bench profile` end to end on a tiny workload: every prompt and output token is
accounted for in the steps, the parts add up to the step time, and bad options are one-line
errors. Speed is not asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvserve.services.bench.profile import COMPONENTS
from kvserve.services.cli import main

REQUESTS, INPUT_LEN, OUTPUT_LEN = 4, 40, 5


@pytest.mark.slow  # ~12 s; a benchmark's smoke run (2-core AVX2 machine)
def test_profile_accounts_for_every_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(
        [
            "bench", "profile", "--workload", "random", "--num-requests", str(REQUESTS),
            "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN), "--threads", "1",
            "--store", "none", "--out", str(tmp_path),
        ]
    )  # fmt: skip
    assert rc == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # Random prompts share no block: each prompt token is computed once; the first output token
    # of each request comes from its last prefill step, the others from decode steps.
    assert summary["prefill"]["tokens"] == REQUESTS * INPUT_LEN
    assert summary["decode"]["tokens"] == REQUESTS * (OUTPUT_LEN - 1)
    assert summary["decode"]["steps"] == OUTPUT_LEN - 1  # all four decode together
    for kind in ("prefill", "decode"):
        row = summary[kind]
        assert sum(row["parts_s"].values()) == pytest.approx(row["seconds"], rel=1e-6)
        assert row["parts_s"]["linear"] > 0 and row["parts_s"]["attention"] > 0
    steps = json.loads((tmp_path / "profile.json").read_text())["steps"]
    assert len(steps) == summary["all"]["steps"]
    assert set(steps[0]["parts"]) == set(COMPONENTS)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--workload", "multi-round"], "multi-round"),
        (["--workload", "nope"], "--workload must be one of"),
        (["--workload", "random", "--threads", "0"], "--threads"),
        (["--workload", "random", "--model", "/no/such.gguf"], "no such file"),
    ],
)
def test_profile_bad_options(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1
