"""`kvserve bench fleet --validate`: the same workload through real workers and through simulated
ones on the profile given, at each worker count, `--repeats` times each (real and simulated
alternating, so a slow spell of the machine falls on both); each metric's median over the
repeats is compared, and the real runs' own spread is reported beside it (what the same real
run varies by: the error no simulator can be asked to beat). The real workers' step logs also
say how the profile's step times compare with the steps they ran."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.fleet_deploy import Routing
from kvserve.services.bench.sweeps import fleet_report as report


def validate_runs(
    args: argparse.Namespace, arms: dict[str, Routing], workers: list[int], qps: float
) -> dict[str, Any]:
    """Per worker count: the median real and simulated rows, the errors, the real runs'
    spread, the step check. The first arm at `qps`."""
    from kvserve.services.bench.sweeps.fleet import sweep
    from kvserve.shared.engine.sim.profile import CostProfile

    profile = CostProfile.load(args.simulate)
    arm, routing = next(iter(arms.items()))
    results: dict[str, Any] = {}
    for n in workers:
        reals, sims, logs = [], [], []
        for k in range(args.repeats):
            tag = f"-{k}"
            reals.append(sweep(args, {arm: routing}, n, [qps], False, tag)[arm][0])
            sims.append(sweep(args, {arm: routing}, n, [qps], True, tag)[arm][0])
            run_dir = Path(args.out) / f"real-{n}w{tag}" / arm / f"qps-{qps:g}"
            logs += sorted(run_dir.glob("steps-*.jsonl"))
        results[str(n)] = compare(reals, sims) | {"steps": report.step_model_check(profile, logs)}
    return results


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
