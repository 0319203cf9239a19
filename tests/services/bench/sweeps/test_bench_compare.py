"""`kvserve bench compare`: medians and ranges over repeats, the report of a saved run, and one
real run of the kvserve arm (a `kvserve serve` process driven by `kvserve bench serve`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvserve.services.bench.sweeps.compare import KEYS, aggregate, failed_run
from kvserve.services.cli import main


def summary(tok_s: float, ttft: float) -> dict[str, float]:
    return {k: ttft for k in KEYS} | {"output_tok_s": tok_s}


def test_aggregate_takes_medians_and_ranges() -> None:
    row = aggregate({"runs": [summary(10, 3), summary(30, 1), summary(20, 2)]})
    assert row["repeats"] == 3
    assert row["output_tok_s"] == 20 and row["range"]["output_tok_s"] == [10, 30]
    assert row["ttft_median_s"] == 2 and row["range"]["ttft_p99_s"] == [1, 3]
    failed = aggregate({"error": "could not build", "runs": [summary(1, 1)]})
    assert failed == {"error": "could not build", "repeats_done": 1}


def test_a_run_with_failed_requests_does_not_count() -> None:
    assert failed_run({"failed": 0, "num_requests": 64}) is None
    why = failed_run({"failed": 64, "num_requests": 64, "errors": ["HTTP 500: boom"]})
    assert why == "64 of 64 requests failed, e.g. HTTP 500: boom"


def test_report_prints_and_plots_a_saved_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = {
        "kvserve": {"runs": [summary(40, 5), summary(44, 4)]},
        "llama-server": {"runs": [summary(8, 50)]},
        "hf": {"error": "transformers shim did not start"},
    }
    (tmp_path / "compare.json").write_text(json.dumps({"raw": raw}))
    plot = tmp_path / "compare.png"
    argv = ["bench", "compare", "--workload", "shared-prefix", "--out", str(tmp_path)]
    assert main([*argv, "--report", "--plot", str(plot)]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = json.loads(lines[-1])
    assert rows["kvserve"]["output_tok_s"] == 42 and rows["llama-server"]["repeats"] == 1
    assert "not run: transformers shim did not start" in "\n".join(lines)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_arms_take_turns_within_each_repeat(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Repeats interleave the arms (A B C, A B C), so that the machine's drift over a run falls
    on every arm alike; an arm that fails is not run again and is reported with its reason.
    The runs themselves are stood in for here (a real one: the slow test below)."""
    from kvserve.services.bench.lib.process import StartError
    from kvserve.services.bench.sweeps import compare

    calls: list[tuple[str, int]] = []

    def run_repeat(arm: str, r: int, *args: object) -> dict[str, float]:
        calls.append((arm, r))
        if arm == "kvserve-fp32":
            raise StartError("no room for fp32 weights")
        return summary(10.0 * (r + 1), 1.0)

    monkeypatch.setattr(compare, "run_repeat", run_repeat)
    argv = ["bench", "compare", "--workload", "random", "--repeats", "3", "--out", str(tmp_path)]
    assert main([*argv, "--arms", "kvserve,kvserve-fp32,kvserve-sync"]) == 0
    assert calls == [
        ("kvserve", 0), ("kvserve-fp32", 0), ("kvserve-sync", 0),
        ("kvserve", 1), ("kvserve-sync", 1), ("kvserve", 2), ("kvserve-sync", 2),
    ]  # fmt: skip
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rows["kvserve"]["output_tok_s"] == 20 and rows["kvserve-sync"]["repeats"] == 3
    assert rows["kvserve-fp32"] == {"error": "no room for fp32 weights", "repeats_done": 0}
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["arms"] == rows


def test_unknown_arm_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "compare", "--workload", "random", "--arms", "kvserve,vllm"]
    assert main([*argv, "--out", str(tmp_path)]) == 2
    assert "unknown arms: vllm" in capsys.readouterr().err


@pytest.mark.slow  # ~25 s: starts `kvserve serve` twice
def test_kvserve_arm_runs_its_repeats(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = [
        "bench", "compare", "--workload", "random", "--num-requests", "3", "--input-len", "24",
        "--output-len", "3", "--arms", "kvserve", "--repeats", "2", "--warmup-requests", "1",
        "--threads", "1", "--out", str(tmp_path),
    ]  # fmt: skip
    assert main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    row = rows["kvserve"]
    assert row["repeats"] == 2 and row["output_tok_s"] > 0
    for r in range(2):
        records = (tmp_path / "kvserve" / f"repeat-{r}" / "requests.jsonl").read_text().splitlines()
        assert len(records) == 3
        assert all(json.loads(line)["output_tokens"] == 3 for line in records)


@pytest.mark.redis
def test_each_arm_is_saved_as_it_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first arm fails for real (its own redis-server refuses a bad maxmemory); the run is
    then stopped during the second, as a user would stop a long run: the first arm's result is
    already in compare.json."""
    from kvserve.services.bench.sweeps import compare

    real_run_repeat = compare.run_repeat
    calls: list[str] = []

    def run_repeat_then_stop(arm: str, *args: object) -> dict[str, object]:
        calls.append(arm)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run_repeat(arm, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(compare, "run_repeat", run_repeat_then_stop)
    argv = ["bench", "compare", "--workload", "random", "--arms", "kvserve-disagg,kvserve"]
    argv += ["--redis-maxmemory", "lots", "--repeats", "1", "--out", str(tmp_path)]
    assert main(argv) == 130  # the command line's answer to Ctrl-C
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert list(saved["arms"]) == ["kvserve-disagg"]
    assert "redis-server exited" in saved["arms"]["kvserve-disagg"]["error"]
    assert "could not run" in capsys.readouterr().out


def test_spec_arm_that_cannot_start_is_reported_not_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Where `kvserve serve` has no n-gram speculative decoding, the arm is not run and says
    why; no server is started."""
    from kvserve.services.bench.lib import arms

    monkeypatch.setattr(arms, "serve_flags", lambda: {"--model"})
    argv = ["bench", "compare", "--workload", "copy-edit", "--arms", "kvserve-spec"]
    assert main([*argv, "--repeats", "1", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "kvserve-spec" in out and "not run: kvserve-spec: `kvserve serve` has no" in out
    saved = json.loads((tmp_path / "compare.json").read_text())
    assert saved["arms"]["kvserve-spec"]["repeats_done"] == 0


def test_bench_serve_gets_the_ggufs_tokenizer_and_k_reaches_the_arm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse
    import subprocess

    from kvserve.services.bench.lib import arms
    from kvserve.services.bench.sweeps import compare

    p = argparse.ArgumentParser()
    compare.add_arguments(p)
    args = p.parse_args(["--workload", "copy-edit", "--num-speculative-tokens", "7"])
    assert "--tokenizer" not in p.format_help()  # the harness passes the GGUF itself
    assert args.arms.split(",") == list(arms.DEFAULT_ARMS)
    seen: list[list[str]] = []

    def fake_run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"failed": 0}) + "\n", "")

    monkeypatch.setattr(compare.subprocess, "run", fake_run)
    compare.bench_serve(args, "http://127.0.0.1:1", 49152, tmp_path, tmp_path / "m.gguf")
    cmd = seen[0]
    assert cmd[cmd.index("--workload") + 1] == "copy-edit"
    assert cmd[cmd.index("--tokenizer") + 1] == str(tmp_path / "m.gguf")
    made: list[arms.ArmSettings] = []

    class Made(Exception):
        pass

    def make_server(arm: str, port: int, settings: arms.ArmSettings) -> arms.ArmServer:
        made.append(settings)
        raise Made

    monkeypatch.setattr(arms, "make_server", make_server)
    with pytest.raises(Made):
        compare._start_server("kvserve-spec", args, tmp_path / "m.gguf", tmp_path, 0)
    assert made[0].speculative_tokens == 7
