"""`kvserve bench serve`: the reusable-token count fed by the session runner, bad arguments, no
torch, and a tiny end-to-end run against `kvserve serve` (the workloads and the reuse tracker
alone: tests/services/bench/workloads/, tests/services/bench/lib/test_reuse.py)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from kvserve.services import cli
from kvserve.services.bench.lib.completions import RequestResult
from kvserve.services.bench.lib.process import kvserve_process
from kvserve.services.bench.serve_report import summarize
from kvserve.services.bench.serve_sessions import run_once
from kvserve.services.bench.workloads.sessions import MultiRound

VOCAB = 49152


class AnsweringClient:
    """Stands in for lib.completions.Client: every completion succeeds with 4 new token ids."""

    def __init__(self) -> None:
        self.ids = itertools.count(60000)

    async def complete(self, prompt: list[int], res: RequestResult) -> list[int]:
        await asyncio.sleep(0)  # let the other sessions send theirs
        res.success, res.ttft_s, res.output_tokens = True, 0.01, 4
        return [next(self.ids) for _ in range(4)]

    async def tokenize(self, text: str) -> None:
        return None


def test_the_session_runner_feeds_reuse_in_send_order() -> None:
    """Two users, two rounds, a 32-token system prompt, 12-token questions, 4-token answers:
    the second user's first round reuses the system prompt's two blocks; every second round
    its own history's three (prompt 44 + answer 4 = 48 tokens)."""
    sessions = MultiRound(2, 2, 32, 12, 4).sessions(VOCAB, seed=0)
    args = argparse.Namespace(seed=0, max_concurrency=None, reuse_block_size=16)
    client: Any = AnsweringClient()
    results, duration = asyncio.run(run_once(args, client, sessions, math.inf, VOCAB))
    reusable = {(r.index, r.turn): r.reusable_tokens for r in results}
    assert reusable == {(0, 0): 0, (1, 0): 32, (0, 1): 48, (1, 1): 48}
    summary = summarize(results, duration, {}, math.inf)
    assert summary["reusable_tokens_total"] == 128 and summary["reused_fraction"] == 0.0
    assert summarize([], 1.0, {}, None)["reused_fraction"] is None


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
    for args in (
        [*base, "--workload", "nope"],
        [*base, "--workload", "random", "--request-rate", "fast"],
        [*base, "--workload", "random", "--request-rate", "0"],
        [*base, "--workload", "random", "--slo", "ttft=abc"],
        [*base, "--workload", "random", "--max-concurrency", "0"],
        [*base, "--workload", "mooncake", "--window", "x"],
        [*base, "--workload", "random"],  # nothing listens on port 9
        ["bench", "serve", "--base-url", "localhost:1", "--workload", "random"],
    ):
        assert cli.main(args) == 2, args
        err = capsys.readouterr().err
        assert "error" in err and err.count("\n") == 1, err


def test_bench_serve_does_not_import_torch() -> None:
    code = (
        "import sys; from kvserve.services import cli; "
        "cli.main(['bench', 'serve', '--base-url', 'http://127.0.0.1:9', '--workload', 'x']); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)


@pytest.mark.slow  # ~25 s; the client against a real kvserve serve (2-core AVX2 machine)
def test_bench_serve_end_to_end(model_path: Path, tmp_path: Path) -> None:
    args = ["--model", str(model_path), "--store", "memory://"]
    server = kvserve_process(("serve", "--port", "0"), args).spawn().wait_ready()
    try:
        out = tmp_path / "out"
        cmd = [sys.executable, "-m", "kvserve.services.cli", "bench", "serve"]
        cmd += ["--base-url", server.url, "--workload", "shared-prefix", "--groups", "2"]
        cmd += ["--prompts-per-group", "3", "--prefix-len", "32", "--question-len", "8"]
        cmd += ["--output-len", "4", "--max-concurrency", "1", "--request-rate", "inf"]
        cmd += ["--slo", "ttft=60000,tpot=60000", "--out", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    finally:
        server.stop()
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["num_requests"] == 6 and summary["completed"] == 6 and summary["failed"] == 0
    for key in ("output_tok_s", "request_throughput", "ttft_mean_s", "ttft_median_s",
                "ttft_p99_s", "tpot_mean_s", "itl_mean_s", "e2e_mean_s", "goodput"):  # fmt: skip
        assert summary[key] > 0, key
    assert summary["output_tokens_total"] == 24
    # Sequential requests, two groups of three: at least 4 requests find their group's 32-token
    # prefix cached (two 16-token blocks).
    assert summary["cached_tokens_total"] >= 4 * 32
    rows = [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and all(r["success"] and r["output_tokens"] == 4 for r in rows)
    assert all(r["prompt_tokens"] == 40 and len(r["itl_s"]) == 3 for r in rows)
    assert json.loads((out / "summary.json").read_text()) == summary
    for png in ("ttft.png", "tpot.png"):
        assert (out / png).stat().st_size > 1000
