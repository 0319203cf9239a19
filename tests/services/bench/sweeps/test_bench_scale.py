"""`kvserve bench scale`: bad options, each arm's server command, the bench serve options of each
workload, rows, ratios and tables from hand-made results, one arm x workload with the server and
the client stood in for, and `--report` on a saved run. No test starts a server."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.bench.lib import arms
from kvserve.services.bench.lib.llama_cpp import CONTEXT_PER_SLOT
from kvserve.services.bench.lib.process import HttpReady
from kvserve.services.bench.sweeps import compare, scale
from kvserve.services.cli import main

MODEL = Path("model.gguf")


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    scale.add_arguments(p)
    return p.parse_args(list(argv))


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


@pytest.mark.parametrize(
    "argv",
    [
        ["--arms", "one-worker,vllm"],
        ["--workloads", "random"],
        ["--arms", ""],
        ["--users", "0"],
        ["--window", "x"],
        ["--report", "--out", "/nonexistent/scale"],
    ],
)
def test_bad_options_are_one_line_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "scale", *argv]) == 2
    err = capsys.readouterr().err
    assert "error" in err and err.count("\n") == 1, err


def test_unknown_arm_names_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "scale", "--arms", "rr-local,vllm"]) == 2
    err = capsys.readouterr().err
    assert "--arms: unknown vllm; choose from one-worker, rr-local, rr-shared" in err


@pytest.mark.parametrize(
    ("arm", "workers", "routing", "store", "threads"),
    [
        ("one-worker", "1", "round-robin", "local", "2"),
        ("rr-local", "2", "round-robin", "local", "1"),
        ("rr-shared", "2", "round-robin", "shared", "1"),
        ("cache-shared", "2", "cache-aware", "shared", "1"),
    ],
)
def test_each_stack_arm_is_its_topology(
    arm: str, workers: str, routing: str, store: str, threads: str, tmp_path: Path
) -> None:
    server = scale.make_server(arm, parse("--store-format", "int8"), MODEL, tmp_path)
    cmd = server.process.cmd
    assert cmd[1] == "stack" and flag(cmd, "--model") == str(MODEL)
    assert flag(cmd, "--workers") == workers and flag(cmd, "--routing") == routing
    assert flag(cmd, "--worker-store") == store and flag(cmd, "--threads-per-worker") == threads
    assert flag(cmd, "--store-format") == "int8" and flag(cmd, "--metrics-port") == "0"
    assert flag(cmd, "--request-timeout") == "3600.0"
    assert server.process.ready == HttpReady("/ready", int(workers))  # once all are listed
    assert server.redis is not None and flag(cmd, "--redis") == server.redis.url
    assert server.process.env["OMP_NUM_THREADS"] == "2"


def test_a_given_redis_is_used_as_is(tmp_path: Path) -> None:
    url = "redis://127.0.0.1:6379/13"
    server = scale.make_server("cache-shared", parse("--redis", url), MODEL, tmp_path)
    assert server.redis is None and flag(server.process.cmd, "--redis") == url


def test_llama_server_has_two_slots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(arms, "ensure_llama_server", lambda: Path("/opt/llama-server"))
    server = scale.make_server("llama-server", parse(), MODEL, tmp_path)
    cmd = server.process.cmd
    assert cmd[0] == "/opt/llama-server" and server.process.ready == HttpReady("/health", 0)
    assert flag(cmd, "--parallel") == "2" and flag(cmd, "-c") == str(2 * CONTEXT_PER_SLOT)
    assert flag(cmd, "--threads") == "2" and flag(cmd, "--threads-batch") == "2"


def test_workloads_become_bench_serve_options() -> None:
    args = parse("--users", "3", "--rounds", "2", "--window", "10:20")
    argv = {w: compare.serve_argv(scale.serve_options(w, args)) for w in scale.WORKLOADS}
    # The 64-token questions and the 8 prompts per group are bench serve's defaults.
    assert argv["multi-round"] == [
        "--workload", "multi-round", "--max-concurrency", "3", "--output-len", "32",
        "--users", "3", "--rounds", "2", "--system-len", "256", "--user-context-len", "1024",
    ]  # fmt: skip
    assert argv["shared-prefix"] == [
        "--workload", "shared-prefix", "--max-concurrency", "8", "--output-len", "32",
        "--groups", "4", "--prefix-len", "512",
    ]  # fmt: skip
    assert argv["mooncake"] == ["--workload", "mooncake", "--window", "10:20"]
    ns = scale.serve_options("mooncake", args)
    assert ns.warmup_requests == 4 and ns.run_timeout == 3600.0


def request(turn: int, ttft: float, success: bool = True) -> dict[str, Any]:
    return {"turn": turn, "ttft_s": ttft if success else None, "success": success}


SUMMARY = {"output_tok_s": 50.0, "failed": 1, "num_requests": 5, "cached_fraction": 0.5,
           "reused_fraction": 0.8, "cached_tokens_reported": True}  # fmt: skip
ROUTER = {"policy": "cache-aware", "decisions": {"hit": 3}, "predicted_cached_tokens": 96,
          "actual_cached_tokens": 64, "abs_error_tokens": 40, "requests": 4}  # fmt: skip


def test_row_from_a_summary_and_its_requests() -> None:
    requests = [request(0, 0.4), request(0, 0.2), request(1, 0.1), request(1, 0.3)]
    row = scale.row(SUMMARY, [*requests, request(2, 0.0, success=False)], ROUTER)
    assert row["output_tok_s"] == 50.0 and row["failed"] == 1 and row["num_requests"] == 5
    assert row["ttft_p50_s"] == pytest.approx(0.25) and row["ttft_mean_s"] == pytest.approx(0.25)
    assert row["ttft_p90_s"] == pytest.approx(0.37)  # numpy's linear interpolation
    assert row["ttft_by_round_s"] == pytest.approx([0.3, 0.2])
    assert row["ttft_p90_later_rounds_s"] == pytest.approx(0.28)  # rounds after the first
    assert row["hit_rate"] == 0.5 and row["reused_fraction"] == 0.8
    assert row["router_error_per_request"] == 10.0 and row["router"] == ROUTER
    # llama-server: no cached tokens in its usage, no router.
    bare = scale.row({**SUMMARY, "cached_tokens_reported": False}, requests, None)
    assert bare["hit_rate"] is None and bare["reused_fraction"] is None
    assert bare["router_error_per_request"] is None
    assert scale.row(SUMMARY, [], {"requests": 0, "abs_error_tokens": 0})["ttft_p90_s"] is None


def cell(tok_s: float, p90: float, rounds: list[float] | None = None) -> dict[str, Any]:
    return {"output_tok_s": tok_s, "ttft_p50_s": p90 / 2, "ttft_p90_s": p90,
            "ttft_mean_s": p90 / 2, "ttft_by_round_s": rounds or [p90 / 2], "hit_rate": 0.25,
            "reused_fraction": 0.5, "failed": 0, "num_requests": 8, "router": None,
            "router_error_per_request": None, "ttft_p90_later_rounds_s": p90 / 4}  # fmt: skip


CELLS = {
    "one-worker": cell(40.0, 2.0, [3.0, 1.0]),
    "rr-local": cell(60.0, 1.0, [1.5, 0.5]),
    "cache-shared": cell(80.0, 0.5, [1.0, 0.25]),
    "llama-server": {"error": "could not build\nlog: ..."},
}


def test_ratios_against_one_worker_and_rr_local() -> None:
    rows = scale.with_ratios(CELLS)
    later = "ttft_p90_later_rounds_s"
    assert rows["cache-shared"]["vs_one_worker"] == {
        "output_tok_s": 2.0, "ttft_p90_s": 0.25, later: 0.25
    }  # fmt: skip
    assert rows["cache-shared"]["vs_rr_local"] == {
        "output_tok_s": 80 / 60, "ttft_p90_s": 0.5, later: 0.5
    }  # fmt: skip
    assert rows["one-worker"]["vs_one_worker"] == {
        "output_tok_s": 1.0,
        "ttft_p90_s": 1.0,
        later: 1.0,
    }
    assert rows["llama-server"] == CELLS["llama-server"]
    alone = scale.with_ratios({"rr-shared": cell(10.0, 1.0)})["rr-shared"]
    assert alone["vs_one_worker"] == {"output_tok_s": None, "ttft_p90_s": None, later: None}
    assert "vs_one_worker" not in CELLS["cache-shared"]  # the input is left as it was


def test_table_shows_ratios_rounds_and_arms_not_run() -> None:
    text = scale.table("multi-round", scale.with_ratios(CELLS))
    lines = text.splitlines()
    assert lines[0] == "== multi-round" and lines[1].split()[:3] == ["arm", "out", "tok/s"]
    cache = next(line for line in lines if line.startswith("cache-shared")).split()
    assert cache[:4] == ["cache-shared", "80.0", "2.00", "1.33"]  # tok/s, x1w, xrr
    assert cache[4:9] == ["250", "500", "250", "0.25", "0.50"]  # TTFT ms, p90 x1w, p90 xrr
    assert cache[9:] == ["0.25", "0.50", "0", "-"]  # hit, reused, failed, router error
    assert "llama-server    not run: could not build" in text
    assert "mean TTFT per round (ms)" in text and "  one-worker   3000 1000 | 500 (2.00)" in text


def test_one_run_with_the_server_and_client_stood_in_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class Server:
        url = "http://127.0.0.1:9"
        stopped = False

        def start(self, timeout: float) -> None:
            pass

        def stop(self) -> None:
            Server.stopped = True

    def bench(ns: argparse.Namespace, base_url: str, vocab: int, run_dir: Path) -> dict[str, Any]:
        assert ns.workload == "multi-round" and ns.users == 9 and vocab == 49152
        lines = [json.dumps(request(t, 0.5)) for t in (0, 0, 1)]
        (run_dir / "requests.jsonl").write_text("\n".join(lines) + "\n")
        return SUMMARY

    monkeypatch.setattr(scale, "make_server", lambda *a: Server())
    monkeypatch.setattr(scale, "_bench", bench)
    monkeypatch.setattr(scale, "router_stats", lambda url: ROUTER)
    row = scale.run_cell("cache-shared", "multi-round", parse(), MODEL, 49152, tmp_path)
    assert Server.stopped and row["ttft_by_round_s"] == [0.5, 0.5]
    assert row["router_error_per_request"] == 10.0
    assert (tmp_path / "multi-round" / "cache-shared" / "requests.jsonl").is_file()


def test_a_run_with_failed_requests_still_reports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing(ns: argparse.Namespace, base_url: str, vocab: int, run_dir: Path) -> None:
        (run_dir / "summary.json").write_text(json.dumps(SUMMARY))
        raise compare.RunFailed("1 of 5 requests failed")

    monkeypatch.setattr(compare, "bench_serve", failing)
    assert scale._bench(argparse.Namespace(), "http://x", 1, tmp_path) == SUMMARY

    def timing_out(ns: argparse.Namespace, base_url: str, vocab: int, run_dir: Path) -> None:
        raise compare.RunFailed("bench serve ran past 10 s")

    monkeypatch.setattr(compare, "bench_serve", timing_out)
    with pytest.raises(compare.RunFailed):  # the earlier run's summary.json is not taken
        scale._bench(argparse.Namespace(), "http://x", 1, tmp_path)


def test_report_prints_and_plots_a_saved_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = {"multi-round": CELLS, "mooncake": {"one-worker": cell(30.0, 4.0)}}
    (tmp_path / "scale.json").write_text(json.dumps({"results": results}))
    plot = tmp_path / "scale.png"
    assert main(["bench", "scale", "--report", "--out", str(tmp_path), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    report = json.loads(out[-1])
    assert list(report) == ["multi-round", "mooncake"]
    assert report["multi-round"]["rr-local"]["vs_one_worker"]["output_tok_s"] == 1.5
    assert report["mooncake"]["one-worker"]["vs_rr_local"]["output_tok_s"] is None
    assert "== mooncake" in out and "== multi-round" in out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_router_cost_fills_every_index_and_times_decisions() -> None:
    from kvserve.services.bench.sweeps.router_cost import measure

    cost = measure(workers=3, blocks=40, prompt_tokens=128, decisions=5)
    assert cost["indexed_blocks"] == [40, 40, 40]
    assert 0 < cost["us_median"] <= cost["us_p99"]
