"""`kvserve bench fleet`: arms and options, the bench serve flags of each workload, rows and
validation errors from hand-made results, tables. No test here starts a server (the slow
end-to-end run is test_bench_fleet_run)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from kvserve.services.bench.lib.fleet_deploy import Counters, Routing
from kvserve.services.bench.sweeps import fleet, fleet_report
from kvserve.services.cli import main
from kvserve.services.cli_support import CliError


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    fleet.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize(
    "argv",
    [
        ["--arms", "random,sticky"],
        ["--arms", "cache-aware@x"],
        ["--arms", "cache-aware@2:1.5"],
        ["--workers", "0"],
        ["--qps", "1,fast"],
        ["--validate"],
        ["--simulate", "/nonexistent/profile.json"],
        ["--time-scale", "0", "--simulate", "gpu"],
    ],
)
def test_bad_options_are_one_line_errors(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "fleet", *argv]) == 2
    err = capsys.readouterr().err
    assert "error" in err and err.count("\n") == 1, err


def test_arms_are_policies_or_weighted_cache_aware() -> None:
    arms, workers, qps = fleet.validate(
        parse(
            "--arms",
            "random,session,cache-aware,cache-aware@4:0.5",
            "--workers",
            "4,16",
            "--qps",
            "2.5,10",
            "--simulate",
            "gpu",
        )
    )
    assert arms == {
        "random": Routing("random"),
        "session": Routing("session"),
        "cache-aware": Routing("cache-aware"),
        "cache-aware@4:0.5": Routing("cache-aware", 4.0, 0.5),
    }
    assert (workers, qps) == ([4, 16], [2.5, 10.0])
    assert Routing("cache-aware", 4.0, 0.5).flags() == [
        "--routing",
        "cache-aware",
        "--overlap-weight",
        "4.0",
        "--router-store-cost",
        "0.5",
    ]
    assert fleet.parse_arm("cache-aware@4").flags()[-2:] == ["--router-store-cost", "0.2"]
    assert fleet.parse_arm("cache-aware@2:auto") == Routing("cache-aware", 2.0, None)


def test_each_workload_passes_its_shape_with_the_fleets_defaults() -> None:
    args = parse("--workload", "multi-tenant", "--tenants", "7")
    flags = fleet.shape_flags(args)
    assert flags[:2] == ["--workload", "multi-tenant"]
    given = dict(zip(flags[2::2], flags[3::2], strict=True))
    assert given["--tenants"] == "7"
    assert given["--context-len"] == str(fleet.SHAPES["multi-tenant"]["context-len"])
    assert set(given) == {f"--{k}" for k in fleet.SHAPES["multi-tenant"]}
    for workload in fleet.WORKLOADS:
        names = fleet.shape_flags(parse("--workload", workload))[2::2]
        assert names == [f"--{k}" for k in fleet.SHAPES[workload]]


def requests(ttfts: list[float], tpot: float = 0.01) -> list[dict[str, Any]]:
    return [{"success": True, "ttft_s": t, "tpot_s": tpot} for t in ttfts] + [
        {"success": False, "ttft_s": None, "tpot_s": None}
    ]


def test_a_row_takes_the_summary_the_requests_and_the_router() -> None:
    summary = {
        "output_tok_s": 120.0,
        "request_throughput": 2.0,
        "num_requests": 11,
        "failed": 1,
        "cached_tokens_reported": True,
        "cached_fraction": 0.5,
        "reused_fraction": 0.8,
        "duration_s": 10.0,
    }
    router = {
        "decision_us": {"p50": 100.0, "p99": 400.0},
        "requests": 10,
        "abs_error_tokens": 160,
        "events": {"applied": 48, "duplicate": 2},
        "kv_event_lag_s": {"last": 0.01, "max": 0.05},
        "decisions": {"cache": 10},
    }
    r = fleet_report.row(summary, requests([float(i) for i in range(1, 11)]), router, {"qps": 2})
    assert r["ttft_p50_s"] == pytest.approx(5.5) and r["ttft_p90_s"] == pytest.approx(9.1)
    assert r["tpot_mean_s"] == pytest.approx(0.01)
    assert (r["hit_rate"], r["reused_fraction"], r["qps"]) == (0.5, 0.8, 2)
    assert r["router_error_tokens_per_request"] == 16.0
    assert r["kv_events_per_s"] == 5.0 and r["kv_event_lag_max_s"] == 0.05
    assert (r["router_decision_p50_us"], r["router_decision_p99_us"]) == (100.0, 400.0)


def test_validation_errors_are_relative_and_checked_against_the_targets() -> None:
    real = {
        "output_tok_s": 100.0,
        "tpot_mean_s": 0.02,
        "ttft_p50_s": 1.0,
        "ttft_p90_s": 2.0,
        "hit_rate": 0.5,
    }
    close = {
        "output_tok_s": 95.0,
        "tpot_mean_s": 0.021,
        "ttft_p50_s": 1.15,
        "ttft_p90_s": 1.7,
        "hit_rate": 0.52,
    }
    errors = fleet_report.relative_errors(real, close)
    assert errors["output_tok_s_err"] == pytest.approx(-0.05)
    assert errors["ttft_p90_s_err"] == pytest.approx(-0.15)
    assert errors["within_targets"]
    off = fleet_report.relative_errors(real, {**close, "tpot_mean_s": 0.025})
    assert off["tpot_mean_s_err"] == pytest.approx(0.25) and not off["within_targets"]
    assert fleet_report.relative_errors({}, close)["within_targets"]  # nothing to compare
    table = fleet_report.validation_table({"1": {"real": real, "sim": close, "errors": errors}})
    assert "ttft_p90_s" in table and "-15.0%" in table


def test_rates_are_per_modelled_second() -> None:
    a = Counters(wall_s=0.0, commands=0, net_in=0, net_out=0, gateway_cpu_s=1.0, used_memory=0)
    b = Counters(
        wall_s=40.0,
        commands=8000,
        net_in=4000,
        net_out=400,
        gateway_cpu_s=5.0,
        used_memory=2_000_000,
    )
    rates = a.rates(b, requests=20, slowdown=4.0)  # 40 wall seconds model 10
    assert rates["redis_commands_per_s"] == 800.0 and rates["redis_bytes_in_per_s"] == 400.0
    assert rates["gateway_cpu_s_per_request"] == 0.2 and rates["gateway_cpu_frac"] == 0.1
    assert rates["redis_used_memory_mb"] == 2.0


def test_the_table_has_a_line_per_arm_and_qps() -> None:
    rows = {
        "random": [
            {"qps": 1.0, "output_tok_s": 10.0, "ttft_p90_s": 2.0},
            {"qps": 2.0, "error": "bench serve exited with 1\n..."},
        ],
        "cache-aware": [{"qps": 1.0, "output_tok_s": 12.0, "ttft_p90_s": 0.5}],
    }
    lines = fleet_report.table("multi-tenant, 4 workers", rows).splitlines()
    assert lines[0] == "== multi-tenant, 4 workers"
    assert any(line.startswith("random") and "2000" in line for line in lines)
    assert any("not run: bench serve exited with 1" in line for line in lines)
    assert any(line.startswith("cache-aware") and "500" in line for line in lines)


def test_validation_compares_the_medians_of_the_repeats() -> None:
    from kvserve.services.bench.sweeps.fleet_validate import compare

    def run(tok_s: float, p90: float) -> dict[str, Any]:
        return {"output_tok_s": tok_s, "tpot_mean_s": 0.02, "ttft_p50_s": 0.5,
                "ttft_p90_s": p90, "hit_rate": 0.5}  # fmt: skip

    reals = [run(100.0, 1.0), run(90.0, 3.0), run(110.0, 2.0)]
    sims = [run(101.0, 2.2), run(99.0, 2.1), run(98.0, 9.0)]
    got = compare(reals, sims)
    assert got["real"]["output_tok_s"] == 100.0 and got["sim"]["ttft_p90_s"] == 2.2
    assert got["errors"]["output_tok_s_err"] == pytest.approx(-0.01)
    assert got["errors"]["ttft_p90_s_err"] == pytest.approx(0.1)
    assert got["errors"]["within_targets"]
    assert got["real_spread"]["output_tok_s"] == pytest.approx(0.2)
    assert got["real_spread"]["ttft_p90_s"] == pytest.approx(1.0)
    failed = compare([*reals, {"qps": 1, "error": "bench serve exited"}], sims)
    assert not failed["errors"]["within_targets"] and failed["failed"] == ["bench serve exited"]


def test_a_disaggregated_fleet_and_its_pd_threshold() -> None:
    from kvserve.services.bench.lib.fleet_deploy import Workers

    args = parse("--disagg", "6:2", "--arms", "cache-aware/pd=256,cache-aware@4:1/pd=64")
    arms, workers, _ = fleet.validate(args)
    assert workers == [8]
    assert arms["cache-aware/pd=256"] == Routing("cache-aware", pd_threshold=256)
    assert arms["cache-aware@4:1/pd=64"] == Routing("cache-aware", 4.0, 1.0, 64)
    assert Routing("cache-aware", pd_threshold=64).flags()[-2:] == ["--pd-threshold", "64"]
    assert "--pd-threshold" not in Routing("cache-aware").flags()
    roles = Workers(3, prefill=2, decode=1).roles()
    assert roles == [("prefill", "worker-prefill-0"), ("prefill", "worker-prefill-1"),
                     ("decode", "worker-decode-0")]  # fmt: skip
    assert Workers(2).roles() == [("worker", "worker-0"), ("worker", "worker-1")]
    for bad in (["--disagg", "4"], ["--disagg", "0:2"], ["--arms", "cache-aware/pd=x"]):
        with pytest.raises(CliError):
            fleet.validate(parse(*bad))


def test_the_router_costs_cover_shared_prefixes_and_event_rates() -> None:
    from kvserve.services.bench.sweeps.router_cost import apply_rate, measure

    shared = measure(workers=4, blocks=64, prompt_tokens=256, decisions=5, shared_by="all")
    assert shared["indexed_blocks"] == [64] * 4 and shared["us_p99"] >= shared["us_median"] > 0
    rate = apply_rate(workers=4, blocks=64, events=50, hashes_per_event=8)
    assert rate["hashes_per_s"] == pytest.approx(8 * rate["events_per_s"])
