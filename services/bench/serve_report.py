"""The serving benchmark's metrics of one run (`summarize`: throughput, goodput under SLOs,
latency statistics, cached and reused fractions; `spec_decode`: speculative decoding's
acceptance from the server's counters), its table and its plots."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.completions import RequestResult
from kvserve.services.bench.lib.plots import pyplot, save_figure

NOT_RATES = ("inf", "trace")
# The server's speculative decoding counters (kvserve:spec_decode_*_total, vLLM's names).
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _stats(values: list[float], name: str) -> dict[str, float | None]:
    import numpy as np

    if not values:
        return {f"{name}_mean_s": None, f"{name}_median_s": None, f"{name}_p99_s": None}
    a = np.asarray(values, dtype=float)
    return {
        f"{name}_mean_s": float(a.mean()),
        f"{name}_median_s": float(np.median(a)),
        f"{name}_p99_s": float(np.percentile(a, 99)),
    }


def _goodput(ok: list[RequestResult], slo: dict[str, float]) -> int:
    """Completed requests that meet every SLO given (TTFT; TPOT where there is one)."""

    def good(r: RequestResult) -> bool:
        if "ttft" in slo and (r.ttft_s is None or r.ttft_s > slo["ttft"]):
            return False
        return not ("tpot" in slo and r.tpot_s is not None and r.tpot_s > slo["tpot"])

    return sum(good(r) for r in ok)


def _tokens(ok: list[RequestResult]) -> dict[str, Any]:
    prompt_tokens = sum(r.prompt_len for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok)
    reusable = sum(r.reusable_tokens for r in ok)
    return {
        "prompt_tokens_total": prompt_tokens,
        "output_tokens_total": sum(r.output_tokens for r in ok),
        "cached_tokens_total": cached,
        "cached_fraction": cached / prompt_tokens if prompt_tokens else 0.0,
        "cached_tokens_reported": any(r.cached_tokens is not None for r in ok),
        "reusable_tokens_total": reusable,
        "reused_fraction": cached / reusable if reusable else None,
    }


def summarize(
    results: list[RequestResult], duration: float, slo: dict[str, float], rate: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    tokens = _tokens(ok)
    out_tokens, prompt_tokens = tokens["output_tokens_total"], tokens["prompt_tokens_total"]
    n_good = _goodput(ok, slo)
    d = max(duration, 1e-9)
    s: dict[str, Any] = {
        "request_rate": "trace" if rate is None else ("inf" if math.isinf(rate) else rate),
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": len(ok) / d,
        "output_tok_s": out_tokens / d,
        "total_tok_s": (out_tokens + prompt_tokens) / d,
        "goodput": n_good / d,
        "goodput_fraction": n_good / len(results) if results else 0.0,
        "slo": {k: v * 1000.0 for k, v in slo.items()},
        **tokens,
    }
    s |= _stats([r.ttft_s for r in ok if r.ttft_s is not None], "ttft")
    s |= _stats([r.tpot_s for r in ok if r.tpot_s is not None], "tpot")
    s |= _stats([x for r in ok for x in r.itl_s], "itl")
    s |= _stats([r.e2e_s for r in ok if r.e2e_s is not None], "e2e")
    s["errors"] = sorted({r.error for r in results if r.error})[:5]
    return s


def spec_counters(text: str) -> dict[str, float] | None:
    """The speculative decoding counters in Prometheus text (summed over workers), by
    SPEC_COUNTERS' names; None when the server exposes none of them."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name = sample.name.rsplit(":", 1)[-1].removeprefix("spec_decode_")
            if sample.name.endswith("_total") and name[: -len("_total")] in SPEC_COUNTERS:
                key = name[: -len("_total")]
                out[key] = out.get(key, 0.0) + sample.value
    return out or None


def spec_decode(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any]:
    """A run's speculative decoding figures from the counters read before and after it: draft
    tokens and accepted ones, the acceptance rate (accepted / drafted) and the mean accepted
    drafts per verification step; None where the server has no such counters or drafted
    nothing."""
    if before is None or after is None:
        grew = dict.fromkeys(SPEC_COUNTERS, 0.0)
    else:
        grew = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafted, accepted, steps = (
        grew["num_draft_tokens"],
        grew["num_accepted_tokens"],
        grew["num_drafts"],
    )
    reported = before is not None and after is not None
    return {
        "spec_decode_draft_tokens": round(drafted) if reported else None,
        "spec_decode_accepted_tokens": round(accepted) if reported else None,
        "spec_decode_acceptance_rate": accepted / drafted if drafted else None,
        "spec_decode_mean_accepted_tokens": accepted / steps if steps else None,
    }


def table(s: dict[str, Any]) -> str:
    def fmt(v: Any, ms: bool = False) -> str:
        if v is None:
            return "-"
        if ms:
            return f"{v * 1000:.1f}"
        return f"{v:.3f}" if isinstance(v, float) else str(v)

    rows = [
        ("request rate (req/s)", fmt(s["request_rate"])),
        ("requests: completed / failed", f"{s['completed']} / {s['failed']}"),
        ("duration (s)", fmt(s["duration_s"])),
        ("request throughput (req/s)", fmt(s["request_throughput"])),
        ("output throughput (tok/s)", fmt(s["output_tok_s"])),
        ("total throughput (tok/s)", fmt(s["total_tok_s"])),
        ("goodput (req/s)", fmt(s["goodput"])),
        ("prompt / cached tokens", f"{s['prompt_tokens_total']} / {s['cached_tokens_total']}"),
        ("reusable tokens / reused", f"{s['reusable_tokens_total']} / {fmt(s['reused_fraction'])}"),
    ]
    if s.get("spec_decode_draft_tokens"):
        rows.append((
            "spec decode: drafts accepted / rate / per step",
            f"{s['spec_decode_accepted_tokens']} of {s['spec_decode_draft_tokens']} / "
            f"{fmt(s['spec_decode_acceptance_rate'])} / "
            f"{fmt(s['spec_decode_mean_accepted_tokens'])}",
        ))  # fmt: skip
    for m in ("ttft", "tpot", "itl", "e2e"):
        vals = [fmt(s[f"{m}_{k}_s"], ms=True) for k in ("mean", "median", "p99")]
        rows.append((f"{m.upper()} mean / median / p99 (ms)", " / ".join(vals)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def plot(out: Path, runs: list[tuple[dict[str, Any], list[RequestResult]]]) -> list[str]:
    """ttft.png and tpot.png (a histogram per rate), and throughput_vs_rate.png for several
    rates; the names of the files written."""
    written = [_histogram(out, runs, metric, label)
               for metric, label in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"))]  # fmt: skip
    if len(runs) > 1:
        written.append(_throughput_vs_rate(out, [s for s, _ in runs]))
    return written


def _histogram(
    out: Path, runs: list[tuple[dict[str, Any], list[RequestResult]]], metric: str, label: str
) -> str:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for summary, results in runs:
        vals = [getattr(r, metric) * 1000 for r in results if getattr(r, metric) is not None]
        if vals:
            ax.hist(vals, bins=30, alpha=0.6, label=f"rate {summary['request_rate']}")
    ax.set_xlabel(label)
    ax.set_ylabel("requests")
    ax.set_title(f"{label.split()[0]} distribution")
    ax.legend()
    path = out / f"{metric.split('_')[0]}.png"
    save_figure(fig, path, dpi=100)
    return path.name


def _throughput_vs_rate(out: Path, summaries: list[dict[str, Any]]) -> str:
    finite = [(s["request_rate"], s) for s in summaries if s["request_rate"] not in NOT_RATES]
    fig, ax = pyplot().subplots(figsize=(6, 4))
    xs = [float(r) for r, _ in finite]
    ax.plot(xs, [s["output_tok_s"] for _, s in finite], "o-", label="output tok/s")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [s["ttft_median_s"] or 0 for _, s in finite], "s--", color="C1")
    ax2.set_ylabel("median TTFT (s)", color="C1")
    ax.set_title("throughput vs request rate")
    path = out / "throughput_vs_rate.png"
    save_figure(fig, path, dpi=100)
    return path.name
