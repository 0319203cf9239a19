"""`kvserve bench fleet --validate`: the same workload through real workers and through simulated
ones on the profile given, at each worker count, `--repeats` times each (real and simulated
alternating, so a slow spell of the machine falls on both); each metric's median over the
repeats is compared, and the real runs' own spread is reported beside it (what the same real
run varies by: the error no simulator can be asked to beat). The real workers' step logs also
say how the profile's step times compare with the steps they ran."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.fleet_deploy import Routing
from kvserve.services.bench.sweeps import fleet_report as report

Sweep = Callable[..., dict[str, list[dict[str, Any]]]]


def validate_runs(
    args: argparse.Namespace,
    arms: dict[str, Routing],
    workers: list[int],
    qps: float,
    sweep: Sweep,
) -> dict[str, Any]:
    """Per worker count: the median real and simulated rows, the errors, the real runs'
    spread, the step check. The first arm at `qps`; `sweep` runs one deployment (fleet.sweep)."""
    from kvserve.shared.engine.sim.profile import CostProfile

    profile = CostProfile.load(args.simulate)
    arm, routing = next(iter(arms.items()))
    results: dict[str, Any] = {}
    for n in workers:
        reals, sims, logs = [], [], []
        for k in range(args.repeats):
            tag = f"-{k}"
            sim_args = args
            if args.calibrate_each:
                local = local_profile(args, profile, n, tag)
                sim_args = argparse.Namespace(**{**vars(args), "simulate": local})
            reals.append(sweep(args, {arm: routing}, n, [qps], False, tag)[arm][0])
            sims.append(sweep(sim_args, {arm: routing}, n, [qps], True, tag)[arm][0])
            run_dir = Path(args.out) / f"real-{n}w{tag}" / arm / f"qps-{qps:g}"
            logs += sorted(run_dir.glob("steps-*.jsonl"))
        results[str(n)] = compare(reals, sims) | {"steps": report.step_model_check(profile, logs)}
    return results


def local_profile(args: argparse.Namespace, base: Any, n: int, tag: str) -> str:
    """`base` with its step costs fitted on the steps `n` real workers ran serving the
    calibration workloads just now (never the validated workload): the machine's speed drifts
    from one minute to the next, so the profile is taken beside the runs it is checked on.
    Returns the profile's path."""
    from kvserve.services.bench.lib.calibration_served import served_steps
    from kvserve.services.bench.lib.cost_fit import fit_step_cost
    from kvserve.shared.config import default_model_path

    out = Path(args.out) / f"calibration-{n}w{tag}"
    threads = args.worker_threads or max(1, (os.cpu_count() or 1) // n)
    model = Path(args.gguf or default_model_path())
    steps = served_steps(model, n, threads, out, seed=args.seed)
    fit = fit_step_cost([shape for shape, _ in steps], [seconds for _, seconds in steps])
    profile = dataclasses.replace(base, name=f"{base.name}-local", step=fit.step)
    errors = {name: dataclasses.asdict(e) for name, e in fit.errors.items()}
    path = out / "profile.json"
    path.write_text(profile.to_json({"fit": {"steps": len(steps), "errors": errors}}))
    print(f"[calibrated {n}w{tag}] {len(steps)} steps, mean error {fit.errors['all'].mean:.1%}")
    return str(path)


def compare(reals: list[dict[str, Any]], sims: list[dict[str, Any]]) -> dict[str, Any]:
    """The median rows, their errors and the real runs' spread ((max - min) / median per
    validated metric); a failed run fails the comparison."""
    if any("error" in r for r in reals + sims):
        failed = [r["error"] for r in reals + sims if "error" in r]
        return {"real": {}, "sim": {}, "errors": {"within_targets": False}, "failed": failed}
    real, sim = median_row(reals), median_row(sims)
    return {
        "real": real,
        "sim": sim,
        "errors": report.relative_errors(real, sim),
        "real_spread": spread(reals),
        "repeats": len(reals),
        "real_runs": reals,
        "sim_runs": sims,
    }


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per validated metric, the median over the rows that have it."""
    out: dict[str, Any] = {}
    for metric in report.VALIDATED:
        values = [r[metric] for r in rows if r.get(metric) is not None]
        out[metric] = statistics.median(values) if values else None
    return out


def spread(rows: list[dict[str, Any]]) -> dict[str, float | None]:
    """(max - min) / median of each validated metric over the rows."""
    out: dict[str, float | None] = {}
    for metric in report.VALIDATED:
        values = [r[metric] for r in rows if r.get(metric) is not None]
        mid = statistics.median(values) if values else 0
        out[metric] = (max(values) - min(values)) / mid if mid else None
    return out
