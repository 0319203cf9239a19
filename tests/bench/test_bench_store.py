"""`kvserve bench store` end to end at tiny sizes against the local Redis: it runs and its last
line is the JSON summary with the keys the issue names (speed is measured, not asserted)."""

from __future__ import annotations

import json

import pytest
from kvserve.services import cli


@pytest.mark.redis
@pytest.mark.slow  # ~21 s; a benchmark's smoke run (2-core AVX2 machine)
def test_bench_store_tiny(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    args = ["bench", "store", "--formats", "fp16,int8", "--text-tokens", "48"]
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


def test_bench_store_bad_arguments(capsys) -> None:  # type: ignore[no-untyped-def]
    for args in (
        ["bench", "store", "--parts", "nope"],
        ["bench", "store", "--formats", "int3"],
        ["bench", "store", "--repeats", "0"],
    ):
        assert cli.main(args) == 2
        err = capsys.readouterr().err
        assert "--" in err and err.count("\n") == 1
