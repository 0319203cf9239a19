"""The served part of `kvserve bench calibrate --served`: the steps real workers run while they
serve, under the conditions a fleet of them meets on this machine (their event loops, the bus,
the gateway, Redis and the client on the same cores), rather than the steps of an engine alone.

A fresh deployment (a redis-server, the real gateway, N `kvserve worker`s on `threads` torch
threads each, every one writing its steps with --step-log) is driven by `kvserve bench serve`
through a set of calibration workloads (random lengths alone and in parallel, shared prefixes,
long prompts), which are not the fleet benchmark's workloads (those are held out for
`kvserve bench fleet --validate`); then the workers' step logs are read back.
"""

from __future__ import annotations

from pathlib import Path

from kvserve.services.bench.lib.fleet_deploy import Deployment, Routing, Workers
from kvserve.services.bench.lib.process import run_bench_serve
from kvserve.shared.engine.sim.profile import StepShape
from kvserve.shared.engine.sim.step_log import read_steps

# bench serve's arguments of each calibration workload: (full, quick).
WORKLOADS: list[tuple[list[str], list[str]]] = [
    (["--workload", "random", "--input-len", "512", "--output-len", "64", "--range-ratio",
      "0.9", "--num-requests", "48", "--request-rate", "2"],
     ["--workload", "random", "--input-len", "256", "--output-len", "16", "--range-ratio",
      "0.5", "--num-requests", "8", "--request-rate", "4"]),
    (["--workload", "random", "--input-len", "128", "--output-len", "96", "--range-ratio",
      "0.9", "--num-requests", "64", "--request-rate", "inf", "--max-concurrency", "24"],
     ["--workload", "random", "--input-len", "64", "--output-len", "24", "--num-requests",
      "12", "--request-rate", "inf", "--max-concurrency", "8"]),
    (["--workload", "shared-prefix", "--groups", "4", "--prompts-per-group", "8",
      "--prefix-len", "1024", "--question-len", "96", "--output-len", "32",
      "--request-rate", "1"],
     ["--workload", "shared-prefix", "--groups", "2", "--prompts-per-group", "3",
      "--prefix-len", "256", "--question-len", "32", "--output-len", "8",
      "--request-rate", "4"]),
    (["--workload", "random", "--input-len", "1800", "--output-len", "16", "--range-ratio",
      "0.15", "--num-requests", "12", "--request-rate", "0.25"],
     []),
]  # fmt: skip


def served_steps(
    model: Path, workers: int, threads: int, log_dir: Path, quick: bool = False, seed: int = 0
) -> list[tuple[StepShape, float]]:
    """Every step the workers ran through the calibration workloads (RuntimeError when a
    bench serve run fails)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    for old in log_dir.glob("steps-*.jsonl"):  # a step log appends: start from none
        old.unlink()
    deployment = Deployment(
        model, Routing("round-robin"), Workers(workers, threads=threads), log_dir
    ).start()
    try:
        for i, (full, small) in enumerate(WORKLOADS):
            argv = small if quick else full
            if argv:
                _bench_serve(deployment.url, argv, log_dir / f"workload-{i}", seed + i)
    finally:
        deployment.stop()
    return [step for name in deployment.worker_names() for step in _steps(deployment, name)]


def _steps(deployment: Deployment, name: str) -> list[tuple[StepShape, float]]:
    path = deployment.step_log(name)
    return read_steps(path) if path.is_file() else []


def _bench_serve(url: str, argv: list[str], out: Path, seed: int) -> None:
    run_bench_serve(url, [*argv, "--seed", str(seed), "--no-plots", "--out", str(out)])
