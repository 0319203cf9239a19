"""The fleet benchmark's numbers: one run's row (from bench serve's requests and summary, the
gateway's router totals, Redis's counters and the queue-depth samples), the validation's
relative errors, the tables, the plots."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.plots import pyplot, save_figure

# The metrics --validate compares, and what it allows (the targets): relative error.
VALIDATED = {
    "output_tok_s": 0.10,
    "tpot_mean_s": 0.10,
    "ttft_p50_s": 0.20,
    "ttft_p90_s": 0.20,
    "hit_rate": 0.10,
}


def _pct(values: list[float], q: float) -> float | None:
    import numpy as np

    return float(np.percentile(values, q)) if values else None


def request_figures(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT and TPOT statistics of the requests that succeeded (modelled seconds)."""
    ok = [r for r in requests if r.get("success") and r.get("ttft_s") is not None]
    ttft = [float(r["ttft_s"]) for r in ok]
    tpot = [float(r["tpot_s"]) for r in ok if r.get("tpot_s") is not None]
    return {
        "ttft_p50_s": _pct(ttft, 50),
        "ttft_p90_s": _pct(ttft, 90),
        "ttft_p99_s": _pct(ttft, 99),
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "tpot_mean_s": sum(tpot) / len(tpot) if tpot else None,
        "tpot_p50_s": _pct(tpot, 50),
    }


def router_figures(router: Mapping[str, Any], modelled_s: float) -> dict[str, Any]:
    """The router's decision time, prediction error, events per modelled second and lag."""
    us = router.get("decision_us") or {}
    requests = router.get("requests") or 0
    events = sum((router.get("events") or {}).values())
    return {
        "router_decision_p50_us": us.get("p50"),
        "router_decision_p99_us": us.get("p99"),
        "router_error_tokens_per_request": (
            router.get("abs_error_tokens", 0) / requests if requests else None
        ),
        "router_decisions": router.get("decisions") or {},
        "kv_events_per_s": events / modelled_s if modelled_s > 0 else None,
        "kv_event_lag_max_s": (router.get("kv_event_lag_s") or {}).get("max"),
    }


def store_blocks(workers: Mapping[str, Any]) -> dict[str, int]:
    """The blocks every worker wrote to and loaded from the store (their connectors' counters,
    as their last heartbeat reported them)."""
    written = loaded = 0
    for stats in workers.values():
        store = stats.get("store") or {}
        written += int(store.get("published_blocks") or 0)
        loaded += int(store.get("fetched_blocks") or 0)
    return {"blocks_written": written, "blocks_loaded": loaded}


def lateness(workers: Mapping[str, Any]) -> float | None:
    """Simulated workers: the wall seconds their steps ran past their modelled end over the
    modelled seconds times the time scale (0: the host kept up; None: real workers)."""
    sims = [s["simulation"] for s in workers.values() if isinstance(s.get("simulation"), dict)]
    modelled = sum(float(s.get("modelled_s") or 0) for s in sims)
    return sum(float(s.get("late_s") or 0) for s in sims) / modelled if modelled else None


def row(
    summary: Mapping[str, Any],
    requests: list[dict[str, Any]],
    router: Mapping[str, Any],
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """One run's figures (every time in modelled seconds)."""
    cached = bool(summary.get("cached_tokens_reported"))
    out = {
        "output_tok_s": summary.get("output_tok_s"),
        "request_throughput": summary.get("request_throughput"),
        "num_requests": summary.get("num_requests"),
        "failed": summary.get("failed"),
        "hit_rate": summary.get("cached_fraction") if cached else None,
        "reused_fraction": summary.get("reused_fraction") if cached else None,
        **request_figures(requests),
        **router_figures(router, float(summary.get("duration_s") or 0.0)),
    }
    return out | dict(extra)


def relative_errors(real: Mapping[str, Any], sim: Mapping[str, Any]) -> dict[str, Any]:
    """Per validated metric: (simulated - real) / real under `{metric}_err`, and whether every
    one is within its target (`within_targets`)."""
    errors: dict[str, Any] = {}
    ok = True
    for metric, allowed in VALIDATED.items():
        r, s = real.get(metric), sim.get(metric)
        if r is None or s is None or r == 0:
            errors[f"{metric}_err"] = None
            continue
        err = (s - r) / r
        errors[f"{metric}_err"] = err
        ok = ok and abs(err) <= allowed
    errors["within_targets"] = ok
    return errors


def step_model_check(profile: Any, logs: list[Path]) -> dict[str, Any]:
    """The profile's step times against the steps real workers logged in a served run: per
    class of step (decode-only, with a prompt chunk), how many, the mean of measured /
    predicted and the mean relative error."""
    from kvserve.shared.engine.sim.step_log import read_steps

    classes: dict[str, list[float]] = {"decode": [], "prompt": []}
    for log in logs:
        for shape, seconds in read_steps(log):
            predicted = profile.step_seconds(shape)
            if predicted > 0:
                classes["prompt" if shape.prefill_chunks else "decode"].append(seconds / predicted)
    return {
        name: {
            "steps": len(ratios),
            "measured_over_predicted": sum(ratios) / len(ratios) if ratios else None,
            "mean_abs_err": sum(abs(r - 1) for r in ratios) / len(ratios) if ratios else None,
        }
        for name, ratios in classes.items()
    }


def _cell(v: Any, scale: float = 1.0, digits: int = 2) -> str:
    return "-" if v is None else f"{v * scale:.{digits}f}"


COLUMNS = (
    ("qps", "qps", 1.0, 2),
    ("out tok/s", "output_tok_s", 1.0, 1),
    ("TTFT p50 ms", "ttft_p50_s", 1e3, 0),
    ("p90 ms", "ttft_p90_s", 1e3, 0),
    ("p99 ms", "ttft_p99_s", 1e3, 0),
    ("TPOT ms", "tpot_mean_s", 1e3, 1),
    ("hit", "hit_rate", 1.0, 2),
    ("reused", "reused_fraction", 1.0, 2),
    ("queue", "queue_depth_mean", 1.0, 1),
    ("err tok/req", "router_error_tokens_per_request", 1.0, 0),
    ("failed", "failed", 1.0, 0),
)


def table(title: str, rows: Mapping[str, list[dict[str, Any]]]) -> str:
    """One line per arm and QPS."""
    widths = [max(len(c[0]), 7) for c in COLUMNS]
    head = f"{'arm':<22}" + "".join(f" {c[0]:>{w}}" for c, w in zip(COLUMNS, widths, strict=True))
    lines = [f"== {title}", head, "-" * len(head)]
    for arm, runs in rows.items():
        for r in runs:
            if "error" in r:
                lines.append(f"{arm:<22}  not run: {str(r['error']).splitlines()[0]}")
                continue
            cells = [_cell(r.get(key), scale, digits) for _, key, scale, digits in COLUMNS]
            lines.append(
                f"{arm:<22}" + "".join(f" {c:>{w}}" for c, w in zip(cells, widths, strict=True))
            )
    return "\n".join(lines)


def validation_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """Per worker count: each validated metric real, simulated, the error and the real runs'
    own spread (medians over the repeats); then how the real steps compare with the profile."""
    lines = [
        "== validation: simulated against real workers, medians of the repeats "
        "(error = (sim - real) / real; spread = the real runs' (max - min) / median)",
        f"{'workers':<8} {'metric':<14} {'real':>10} {'sim':>10} {'error':>8} {'target':>7} "
        f"{'spread':>7}",
    ]
    for workers, res in results.items():
        for metric, allowed in VALIDATED.items():
            real, sim = res["real"].get(metric), res["sim"].get(metric)
            err = res["errors"].get(f"{metric}_err")
            noise = (res.get("real_spread") or {}).get(metric)
            lines.append(
                f"{workers:<8} {metric:<14} {_cell(real, digits=4):>10} "
                f"{_cell(sim, digits=4):>10} {_cell(err, 100, 1) + '%':>8} "
                f"{allowed * 100:>6.0f}% {_cell(noise, 100, 0) + '%':>7}"
            )
        for kind, check in (res.get("steps") or {}).items():
            lines.append(
                f"{workers:<8} real {kind} steps: {check['steps']}, measured / profile "
                f"{_cell(check['measured_over_predicted'])} (mean |error| "
                f"{_cell(check['mean_abs_err'], 100, 1)}%)"
            )
        for why in res.get("failed", []):
            lines.append(f"{workers:<8} a run failed: {str(why).splitlines()[0]}")
    return "\n".join(lines)


def plot_ttft_vs_qps(path: Path, rows: Mapping[str, list[dict[str, Any]]], title: str) -> None:
    """P90 TTFT against QPS, a line per arm (llm-d's figure), log scale."""
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for i, (arm, runs) in enumerate(rows.items()):
        ok = [r for r in runs if "error" not in r and r.get("ttft_p90_s") is not None]
        ax.plot(
            [r["qps"] for r in ok], [r["ttft_p90_s"] for r in ok], "o-", label=arm, color=f"C{i}"
        )
    ax.set_xlabel("requests/s (modelled)")
    ax.set_ylabel("P90 TTFT (s)")
    ax.set_yscale("log")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)


def plot_throughput_vs_workers(
    path: Path, by_workers: Mapping[int, Mapping[str, list[dict[str, Any]]]], title: str
) -> None:
    """Output tok/s (the highest QPS run) against worker count, a line per arm."""
    arms = list(dict.fromkeys(a for rows in by_workers.values() for a in rows))
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    for i, arm in enumerate(arms):
        xs, ys = [], []
        for n, rows in sorted(by_workers.items()):
            ok = [r for r in rows.get(arm, []) if "error" not in r]
            if ok:
                xs.append(n)
                ys.append(max(r["output_tok_s"] or 0.0 for r in ok))
        ax.plot(xs, ys, "o-", label=arm, color=f"C{i}")
    ax.set_xlabel("workers")
    ax.set_ylabel("output tokens/s (modelled)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(title, fontsize=10)
    save_figure(fig, path)
