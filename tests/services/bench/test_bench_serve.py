"""`kvserve bench serve`: the reusable-token count fed by the session runner, agent prompts
extending each other, the user key in the body only under --send-user, --slowdown against a
stand-in server that answers after a fixed delay, bad arguments, no torch, and a tiny
end-to-end run against `kvserve serve` (the workloads and the reuse tracker alone:
tests/services/bench/workloads/, tests/services/bench/lib/test_reuse.py)."""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import math
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from kvserve.services import cli
from kvserve.services.bench.lib.completions import Client, RequestResult
from kvserve.services.bench.lib.process import kvserve_process
from kvserve.services.bench.serve_report import spec_counters, spec_decode, summarize, table
from kvserve.services.bench.serve_sessions import arrival_times, run_once
from kvserve.services.bench.workloads.sessions import Agentic, MultiRound, Session

from tests.services.bench.cli_output import last_json

VOCAB = 49152


def runner_args(**kw: Any) -> argparse.Namespace:
    """What run_once reads of bench serve's arguments."""
    return argparse.Namespace(**{"seed": 0, "max_concurrency": None, "reuse_block_size": 16,
                                 "slowdown": 1.0, **kw})  # fmt: skip


class AnsweringClient:
    """Stands in for lib.completions.Client: every completion succeeds with 4 new token ids;
    it keeps each request's prompt and user by (session index, turn)."""

    def __init__(self) -> None:
        self.ids = itertools.count(60000)
        self.sent: dict[tuple[int, int], tuple[list[int], str]] = {}

    async def complete(self, prompt: list[int], res: RequestResult) -> list[int]:
        self.sent[res.index, res.turn] = (prompt, res.user)
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
    client: Any = AnsweringClient()
    results, duration = asyncio.run(run_once(runner_args(), client, sessions, math.inf, VOCAB))
    reusable = {(r.index, r.turn): r.reusable_tokens for r in results}
    assert reusable == {(0, 0): 0, (1, 0): 32, (0, 1): 48, (1, 1): 48}
    summary = summarize(results, duration, {}, math.inf)
    assert summary["reusable_tokens_total"] == 128 and summary["reused_fraction"] == 0.0
    assert summarize([], 1.0, {}, None)["reused_fraction"] is None


def engine_metrics(snapshot: dict[str, dict[str, Any]]) -> str:
    """The Prometheus text a gateway serves for these workers' stats."""
    from kvserve.shared.telemetry import EngineStatsCollector
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    collector = EngineStatsCollector("m")
    collector.snapshot = snapshot
    registry.register(collector)
    return generate_latest(registry).decode()


def test_spec_decode_figures_are_the_counters_growth_over_the_run() -> None:
    after = spec_counters(
        engine_metrics({
            "a": {"spec_decode_num_drafts": 10, "spec_decode_num_draft_tokens": 40,
                  "spec_decode_num_accepted_tokens": 30, "num_preemptions": 3},
            "b": {"spec_decode_num_drafts": 6, "spec_decode_num_draft_tokens": 24,
                  "spec_decode_num_accepted_tokens": 2},
        })
    )  # fmt: skip
    assert after == {"num_drafts": 16.0, "num_draft_tokens": 64.0, "num_accepted_tokens": 32.0}
    before = {"num_drafts": 8.0, "num_draft_tokens": 32.0, "num_accepted_tokens": 8.0}
    figures = spec_decode(before, after)
    assert figures == {
        "spec_decode_draft_tokens": 32,
        "spec_decode_accepted_tokens": 24,
        "spec_decode_acceptance_rate": 0.75,
        "spec_decode_mean_accepted_tokens": 3.0,
    }
    summary = summarize([], 1.0, {}, math.inf) | figures
    assert "spec decode: drafts accepted / rate / per step  24 of 32 / 0.750 / 3.000" in table(
        summary
    )
    # a server without the counters, or one that drafted nothing: no figures, no table row
    assert spec_counters("# TYPE other_total counter\nother_total 1.0\n") is None
    assert spec_counters(engine_metrics({})) is None  # no worker reports yet
    for none in (spec_decode(None, None), spec_decode(after, after)):
        assert none["spec_decode_acceptance_rate"] is None
        assert "spec decode" not in table(summarize([], 1.0, {}, math.inf) | none)


def test_agent_prompts_extend_each_other() -> None:
    """Two agents, three turns (a 32-token system prompt, 8-token tasks, 12-token tool results,
    4-token answers): each prompt is the previous prompt, its answer and a tool result; every
    request carries its agent's user key."""
    sessions = Agentic(2, 3, 32, 8, 12, 4).sessions(VOCAB, seed=0)
    client = AnsweringClient()
    results, _ = asyncio.run(run_once(runner_args(), client, sessions, math.inf, VOCAB))
    for k in range(2):
        prompts = [client.sent[k, j][0] for j in range(3)]
        assert [len(p) for p in prompts] == [40, 40 + 4 + 12, 56 + 4 + 12]
        assert prompts[1][:40] == prompts[0] and prompts[2][:56] == prompts[1]
        assert {client.sent[k, j][1] for j in range(3)} == {f"a{k}"}
    assert client.sent[0, 0][0][:32] == client.sent[1, 0][0][:32]  # the shared system prompt
    assert sorted(r.user for r in results) == ["a0"] * 3 + ["a1"] * 3


def test_a_failed_round_skips_the_later_ones_each_under_its_own_turn() -> None:
    class Failing(AnsweringClient):
        async def complete(self, prompt: list[int], res: RequestResult) -> list[int]:
            res.error = "HTTP 500"
            return []

    sessions = Agentic(1, 3, 8, 4, 4, 2).sessions(VOCAB)
    client: Any = Failing()
    results, _ = asyncio.run(run_once(runner_args(), client, sessions, math.inf, VOCAB))
    assert [(r.turn, r.user, r.error.startswith("skipped")) for r in results] == [
        (0, "a0", False), (1, "a0", True), (2, "a0", True)]  # fmt: skip


def test_the_body_carries_the_user_only_with_send_user() -> None:
    res = RequestResult(0, "t1-u0-q2", 0, None, 2, 4, user="t1-u0")
    warmup = RequestResult(0, "warmup", 0, None, 2, 4)

    def body(send_user: bool, r: RequestResult) -> dict[str, Any]:
        args = argparse.Namespace(base_url="http://x", api_key=None, send_user=send_user,
                                  slowdown=1.0)  # fmt: skip
        return Client(args, "m", None).body([101, 102], r)

    assert body(True, res)["user"] == "t1-u0"
    assert "user" not in body(False, res)
    assert "user" not in body(True, warmup)  # a request without a user key
    assert {k: v for k, v in body(True, res).items() if k != "user"} == body(False, res)


DELAY_S, GAP_S = 0.2, 0.08  # the stand-in server's wall time to the first token, between tokens


class DelayedServer:
    """An OpenAI-compatible stand-in on 127.0.0.1, in a thread and event loop of its own:
    /v1/models, and streamed completions whose first token comes DELAY_S after the request and
    every next one GAP_S later. `received`: (perf_counter() on arrival, body) of each
    completion."""

    def __init__(self) -> None:
        self.received: list[tuple[float, dict[str, Any]]] = []
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runner = web.AppRunner(self._app())
        self.port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        self.url = f"http://127.0.0.1:{self.port}"

    def _app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _start(self) -> int:
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        return int(self.runner.addresses[0][1])

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "stand-in", "vocab_size": 1000}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        t = time.perf_counter()
        body = await request.json()
        self.received.append((t, body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        n = body["max_tokens"]
        for i in range(n):
            await asyncio.sleep(DELAY_S if i == 0 else GAP_S)
            await resp.write(_event({"choices": [{"index": 0, "text": "x"}]}))
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
        await resp.write(_event({"choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _event(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


@pytest.fixture
def delayed_server() -> Iterator[DelayedServer]:
    server = DelayedServer()
    yield server
    server.stop()


def bench(server: DelayedServer, out: Path, *flags: str) -> list[dict[str, Any]]:
    """bench serve against `server` (exit 0 asserted); the rows of requests.jsonl."""
    argv = ["bench", "serve", "--base-url", server.url, "--no-plots", "--out", str(out)]
    assert cli.main([*argv, *flags]) == 0
    return [json.loads(line) for line in (out / "requests.jsonl").read_text().splitlines()]


def test_slowdown_records_modelled_time_and_sends_at_rate_over_s(
    delayed_server: DelayedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--slowdown 4 at a modelled 20 requests/s: a 0.2 s wall TTFT is recorded as 0.05 s, a
    0.08 s gap as 0.02 s; start times are the modelled Poisson arrivals, and the server sees
    them 4 times as far apart (5 requests/s)."""
    flags = ["--workload", "random", "--num-requests", "6", "--input-len", "8"]
    flags += ["--output-len", "2", "--request-rate", "20", "--slowdown", "4"]
    t0 = time.perf_counter()
    rows = bench(delayed_server, tmp_path, *flags)
    wall = time.perf_counter() - t0
    summary = last_json(capsys)
    assert summary["slowdown"] == 4 and summary["request_rate"] == 20 and summary["completed"] == 6
    # Wall-clock times on two shared vCPUs: a request's 0.2 s took up to 0.3 s, so the bounds
    # are 0.16 s of wall time wide, still well apart from a slowdown of 2 (0.1 s, 0.14 s).
    for r in rows:
        assert r["ttft_s"] == pytest.approx(DELAY_S / 4, abs=0.04)
        assert r["itl_s"] == [pytest.approx(GAP_S / 4, abs=0.015)]
        assert r["tpot_s"] == pytest.approx(r["e2e_s"] - r["ttft_s"])
        assert r["e2e_s"] == pytest.approx((DELAY_S + GAP_S) / 4, abs=0.05)
    arrivals = arrival_times([Session([])] * 6, 20.0, seed=0)  # modelled, as the run drew them
    for r in rows:
        assert r["start_s"] == pytest.approx(arrivals[r["index"]], abs=0.02)
    got = sorted(t for t, _ in delayed_server.received)
    sent_at = [4 * a for a in sorted(arrivals)]
    for t, s in zip(got, sent_at, strict=True):
        assert t - got[0] == pytest.approx(s - sent_at[0], abs=0.06)
    assert arrivals[-1] < summary["duration_s"] < wall / 4


def test_send_user_puts_each_sessions_key_in_its_body(
    delayed_server: DelayedServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Multi-tenant, 2 x 2 x 2 queries: with --send-user each body's `user` is its session's
    key; without, no body has one (the rows record it either way)."""
    flags = ["--workload", "multi-tenant", "--tenants", "2", "--users-per-tenant", "2"]
    flags += ["--queries-per-user", "2", "--context-len", "16", "--question-len", "4"]
    flags += ["--output-len", "1"]
    rows = bench(delayed_server, tmp_path / "with", *flags, "--send-user")
    sent = Counter(body["user"] for _, body in delayed_server.received)
    assert sent == Counter(r["user"] for r in rows)
    assert sent == {f"t{t}-u{u}": 2 for t in (0, 1) for u in (0, 1)}  # a user's two queries
    assert all(r["user"] == r["session"].rpartition("-")[0] for r in rows)
    delayed_server.received.clear()
    rows = bench(delayed_server, tmp_path / "without", *flags)
    assert len(delayed_server.received) == 8
    assert not any("user" in body for _, body in delayed_server.received)
    assert {r["user"] for r in rows} == set(sent)  # still recorded
    # No slowdown: the wall delay as it is.
    assert all(r["ttft_s"] == pytest.approx(DELAY_S, abs=0.08) for r in rows)
    assert last_json(capsys)["slowdown"] == 1


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["bench", "serve", "--base-url", "http://127.0.0.1:9"]
    for args in (
        [*base, "--workload", "nope"],
        [*base, "--workload", "random", "--request-rate", "fast"],
        [*base, "--workload", "random", "--request-rate", "0"],
        [*base, "--workload", "random", "--slo", "ttft=abc"],
        [*base, "--workload", "random", "--max-concurrency", "0"],
        [*base, "--workload", "mooncake", "--window", "x"],
        [*base, "--workload", "random", "--slowdown", "0.5"],
        [*base, "--workload", "random", "--slowdown", "nan"],
        [*base, "--workload", "multi-tenant", "--tenants", "0"],
        [*base, "--workload", "agentic", "--tool-output-len", "0"],
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
