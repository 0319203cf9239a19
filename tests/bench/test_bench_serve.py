"""`kvserve bench serve`: the workloads (deterministic, the requested shapes), the Mooncake trace
loader on the real trace, the reusable-token count (alone and fed by the session runner), bad
arguments, and a tiny end-to-end run against `kvserve serve`."""

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
from kvserve.services.bench import serve
from kvserve.services.bench import workloads as wl
from kvserve.services.bench.reuse import ReuseTracker

from tests.services.kvserve_process import ServeProcess

VOCAB = 49152


def all_ids(sessions: list[wl.Session]) -> list[int]:
    return [t for s in sessions for turn in s.turns for t in turn.tokens]


def test_random_workload_shapes_and_determinism() -> None:
    a = wl.random_workload(50, 100, 20, 0.5, VOCAB, seed=1)
    assert a == wl.random_workload(50, 100, 20, 0.5, VOCAB, seed=1)
    assert a != wl.random_workload(50, 100, 20, 0.5, VOCAB, seed=2)
    assert len(a) == 50 and all(len(s.turns) == 1 for s in a)
    ins = [len(s.turns[0].tokens) for s in a]
    outs = [s.turns[0].output_len for s in a]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 10
    assert min(outs) >= 10 and max(outs) <= 30
    fixed = wl.random_workload(5, 64, 8, 0.0, VOCAB)
    assert {len(s.turns[0].tokens) for s in fixed} == {64}
    assert {s.turns[0].output_len for s in fixed} == {8}
    ids = all_ids(a)
    assert min(ids) >= wl.MIN_TOKEN_ID and max(ids) < VOCAB


def test_shared_prefix_workload() -> None:
    s = wl.shared_prefix_workload(3, 4, 32, 8, 5, VOCAB, seed=0)
    assert s == wl.shared_prefix_workload(3, 4, 32, 8, 5, VOCAB, seed=0)
    assert len(s) == 12
    assert all(len(x.turns[0].tokens) == 40 and x.turns[0].output_len == 5 for x in s)
    by_group: dict[str, list[list[int]]] = {}
    for x in s:
        by_group.setdefault(x.tag, []).append(x.turns[0].tokens)
    assert len(by_group) == 3 and all(len(v) == 4 for v in by_group.values())
    prefixes = {tuple(v[0][:32]) for v in by_group.values()}
    assert len(prefixes) == 3  # one prefix per group, distinct across groups
    for v in by_group.values():
        assert len({tuple(p[:32]) for p in v}) == 1  # shared within the group
        assert len({tuple(p[32:]) for p in v}) == 4  # distinct questions
    assert [x.tag for x in s] != sorted(x.tag for x in s)  # shuffled
    ids = all_ids(s)
    assert min(ids) >= wl.MIN_TOKEN_ID and max(ids) < VOCAB


def test_multi_round_workload() -> None:
    s = wl.multi_round_workload(3, 4, 50, 10, 6, 1000, seed=3)
    assert s == wl.multi_round_workload(3, 4, 50, 10, 6, 1000, seed=3)
    assert len(s) == 3 and all(x.carry_history and len(x.turns) == 4 for x in s)
    system = s[0].turns[0].tokens[:50]
    for x in s:
        assert x.turns[0].tokens[:50] == system and len(x.turns[0].tokens) == 60
        assert all(len(t.tokens) == 10 and t.output_len == 6 for t in x.turns[1:])
    ids = all_ids(s)
    assert min(ids) >= wl.MIN_TOKEN_ID and max(ids) < 1000


def test_mooncake_loader_on_the_real_trace() -> None:
    raw = [json.loads(line) for line in wl.MOONCAKE_TRACE.read_text().splitlines()[:300]]
    s = wl.mooncake_workload(window=(0, 300), scale=8, time_scale=2.0, max_context=2048)
    assert s == wl.mooncake_workload(window=(0, 300), scale=8, time_scale=2.0, max_context=2048)
    assert len(s) == 300
    for x, row in zip(s, raw, strict=True):
        n_in, n_out = len(x.turns[0].tokens), x.turns[0].output_len
        assert n_out == max(1, round(row["output_length"] / 8))
        assert n_in == min(-(-row["input_length"] // 8), 2048 - n_out)
        assert n_in + n_out <= 2048
        assert x.arrival_s == pytest.approx(row["timestamp"] / 1000 / 2.0)
    # Shared hash ids -> identical 64-token blocks at the same positions.
    owners: dict[int, list[tuple[int, int]]] = {}
    for k, x in enumerate(s):
        for pos, h in enumerate(x.hash_ids):
            if (pos + 1) * 64 <= len(x.turns[0].tokens):
                owners.setdefault(h, []).append((k, pos))
    shared = {h: o for h, o in owners.items() if len(o) > 1}
    assert shared, "the trace window should share some blocks"
    for h, o in list(shared.items())[:50]:
        blocks = {tuple(s[k].turns[0].tokens[p * 64 : (p + 1) * 64]) for k, p in o}
        assert blocks == {tuple(wl.block_tokens(h, 64, VOCAB))}
    assert wl.block_tokens(1, 64, VOCAB) != wl.block_tokens(2, 64, VOCAB)
    # A window: the same requests, times relative to its first one.
    w = wl.mooncake_workload(window=(100, 20), scale=8, time_scale=2.0)
    assert len(w) == 20 and w[0].arrival_s == 0
    assert [x.turns for x in w] == [x.turns for x in s[100:120]]
    assert w[5].arrival_s == pytest.approx(s[105].arrival_s - s[100].arrival_s)
    assert wl.parse_window("5:") == (5, -1)
    for bad in ("5", "a:b", "-1:3", "0:0"):
        with pytest.raises(ValueError):
            wl.parse_window(bad)


def test_reuse_counts_a_shared_system_prompt_from_the_second_request() -> None:
    system = list(range(1000, 1040))  # 40 tokens: two whole 16-token blocks and 8 more
    reuse = ReuseTracker(16)
    assert reuse.observe(system + list(range(1, 11))) == 0
    assert reuse.observe(system + list(range(11, 21))) == 32  # whole blocks only, not 40
    assert reuse.observe(list(range(2000, 2050))) == 0


def test_reuse_counts_the_previous_prompt_and_answer_of_a_follow_up_round() -> None:
    prompt, answer, question = list(range(1000, 1044)), [7, 8, 9, 10], list(range(1, 13))
    reuse = ReuseTracker(16)
    assert reuse.observe(prompt) == 0
    follow_up = prompt + answer + question  # 60 tokens; the 3rd block ends with the answer
    assert reuse.reusable(follow_up) == 32  # the prompt's two whole blocks
    reuse.add(prompt + answer)
    assert reuse.observe(follow_up) == 48


def test_reuse_never_counts_the_last_prompt_token() -> None:
    reuse = ReuseTracker(16)
    reuse.add(list(range(1000, 1064)))
    assert reuse.reusable(list(range(1000, 1032))) == 16  # at most (32 - 1) // 16 blocks
    assert reuse.reusable(list(range(1000, 1033))) == 32
    assert reuse.reusable([1000]) == 0 and reuse.reusable([]) == 0
    with pytest.raises(ValueError):
        ReuseTracker(0)


class AnsweringClient:
    """Stands in for serve.Client: every completion succeeds with 4 new token ids."""

    def __init__(self) -> None:
        self.ids = itertools.count(60000)

    async def complete(self, prompt: list[int], res: serve.RequestResult) -> list[int]:
        await asyncio.sleep(0)  # let the other sessions send theirs
        res.success, res.ttft_s, res.output_tokens = True, 0.01, 4
        return [next(self.ids) for _ in range(4)]

    async def tokenize(self, text: str) -> None:
        return None


def test_the_session_runner_feeds_reuse_in_send_order() -> None:
    """Two users, two rounds, a 32-token system prompt, 12-token questions, 4-token answers:
    the second user's first round reuses the system prompt's two blocks; every second round
    its own history's three (prompt 44 + answer 4 = 48 tokens)."""
    sessions = wl.multi_round_workload(2, 2, 32, 12, 4, VOCAB, seed=0)
    args = argparse.Namespace(seed=0, max_concurrency=None, reuse_block_size=16)
    client: Any = AnsweringClient()
    results, duration = asyncio.run(serve.run_once(args, client, sessions, math.inf, VOCAB))
    reusable = {(r.index, r.turn): r.reusable_tokens for r in results}
    assert reusable == {(0, 0): 0, (1, 0): 32, (0, 1): 48, (1, 1): 48}
    summary = serve.summarize(results, duration, {}, math.inf)
    assert summary["reusable_tokens_total"] == 128 and summary["reused_fraction"] == 0.0
    assert serve.summarize([], 1.0, {}, None)["reused_fraction"] is None


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
    server = ServeProcess(["--model", str(model_path), "--store", "memory://"]).wait_ready()
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


def test_multi_round_users_have_contexts_of_their_own() -> None:
    from kvserve.services.bench import workloads as wl

    sessions = wl.multi_round_workload(3, 2, 8, 4, 2, vocab_size=1000, context_len=16)
    firsts = [s.turns[0].tokens for s in sessions]
    assert all(len(t) == 8 + 16 + 4 for t in firsts)
    assert len({tuple(t[:8]) for t in firsts}) == 1  # the shared system prompt
    assert len({tuple(t[8:24]) for t in firsts}) == 3  # each user's own context
