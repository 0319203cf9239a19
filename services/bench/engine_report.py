"""The report of `kvserve bench engine`: the run in words with the verdicts against the
targets (printed, the summary's JSON line last), the plot, and engine.json."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvserve.kernels import cpu_decode_step
from kvserve.services.bench.lib.decode_probe import PROBE_BATCHES
from kvserve.services.bench.lib.engine_timing import StepRecord
from kvserve.services.bench.lib.plots import pyplot, save_figure

TARGET_RATIO = 5.0
TARGET_ROOFLINE_B1 = 0.8
TARGET_LINEAR_SHARE_B32 = 0.8


def _num(value: float | None, spec: str) -> str:
    """`value` formatted, "-" where it was not measured (off the CPU)."""
    return "-" if value is None else format(value, spec)


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} (target >= {target:g}: {'met' if value >= target else 'NOT met'})"


def print_report(summary: dict[str, Any]) -> None:
    """The run in words (the setting and machine, the measurements, the verdicts), then the
    summary as one JSON line. Off the CPU (a "device" key) the CPU's figures read "-"."""
    s = summary
    device = f", device {s['device']}" if "device" in s else ""
    print(
        f"workload W1: {s['num_requests']} requests, prompts {s['min_prompt']}..{s['max_prompt']}"
        f", outputs {s['min_output']}..{s['max_output']}, seed {s['seed']}, "
        f"threads {_num(s['threads'], 'd')}{device}"
    )
    print(
        f"machine: read bandwidth {_num(s['bandwidth_gb_s'], '.1f')} GB/s, "
        f"fp32 matmul {_num(s['matmul_gflop_s'], '.1f')} GFLOP/s"
        + (" (CPU figures: not measured on this device)" if device else "")
    )
    _print_measurements(s)
    print(f"ratio kvserve/hf = {_verdict(s['ratio'], TARGET_RATIO)}")
    print(f"roofline_b1 = {_verdict(s['roofline_b1'], TARGET_ROOFLINE_B1)}")
    print(f"roofline_b8 = {_verdict(s['roofline_b8'], TARGET_ROOFLINE_B1)}")
    print(
        f"linear_roofline_b1 = {_num(s['linear_roofline_b1'], '.3f')} "
        "(the linear kernels alone: the ceiling of roofline_b1 with these kernels)"
    )
    print(f"linear_roofline_b8 = {_num(s['linear_roofline_b8'], '.3f')}")
    print(f"linear_share_b32 = {_verdict(s['linear_share_b32'], TARGET_LINEAR_SHARE_B32)}")
    print(f"flop_frac_b32 = {_num(s['flop_frac_b32'], '.3f')}")
    print(json.dumps(s, sort_keys=True))


def _print_measurements(s: dict[str, Any]) -> None:
    print(
        f"bare linear layers ({s['linear_params'] / 1e6:.1f}M params): "
        f"b1 {_num(s['bare_linear_b1_ms'], '.2f')} ms, "
        f"b32 {_num(s['bare_linear_b32_ms'], '.2f')} ms"
    )
    print(
        f"engine decode step (--weights {s['weights']}: {s['weight_bytes'] / 1e6:.1f} MB of "
        "weights read a step): "
        f"b1 {s['engine_step_b1_ms']:.2f} ms, b8 {s['engine_step_b8_ms']:.2f} ms, "
        f"b32 {s['engine_step_b32_ms']:.2f} ms (context ~{s['probe_context']}); beside them: "
        f"bandwidth {_num(s['bandwidth_paired_b1_gb_s'], '.1f')} GB/s, "
        "the engine's linear kernels alone "
        f"b1 {_num(s['kernel_linear_b1_paired_ms'], '.2f')} ms, "
        f"b8 {_num(s['kernel_linear_b8_paired_ms'], '.2f')} ms, "
        f"bare linear b32 {_num(s['bare_linear_b32_paired_ms'], '.2f')} ms"
    )
    _print_layers(s)
    _print_arms(s)


def _print_layers(s: dict[str, Any]) -> None:
    for b in PROBE_BATCHES:
        parts = [s[f"engine_{part}_b{b}_ms"] for part in cpu_decode_step.LayerSeconds._fields]
        if None not in parts:
            linear, attention, other = parts
            print(
                f"  b{b} step's layers (means): linear projections {linear:.2f} ms, attention "
                f"{attention:.2f} ms, RoPE / KV writes / norms / activations {other:.2f} ms; "
                f"LM head {s[f'engine_lm_head_b{b}_ms']:.2f} ms; the rest of the step (host "
                f"work) {s[f'engine_host_b{b}_ms']:.3f} ms"
            )


def _print_arms(s: dict[str, Any]) -> None:
    print(
        f"kvserve: {s['kvserve_tokens']} tokens in {s['kvserve_wall_s']:.2f} s = "
        f"{s['kvserve_tok_s']:.1f} tok/s ({s['kvserve_steps']} steps)"
    )
    if s["hf_tok_s"] is None:
        print("hf: skipped")
    else:
        print(
            f"hf: {s['hf_useful_tokens']} useful tokens ({s['hf_generated_tokens']} generated) "
            f"in {s['hf_wall_s']:.2f} s = {s['hf_tok_s']:.1f} tok/s"
        )


def save_plot(path: Path, summary: dict[str, Any], steps: list[StepRecord]) -> None:
    """Output tok/s of each arm beside the kvserve engine's step times by batch size."""
    fig, (bars, scatter) = pyplot().subplots(1, 2, figsize=(11, 4.5))
    arms = {"kvserve": summary["kvserve_tok_s"], "hf": summary["hf_tok_s"]}
    arms = {name: v for name, v in arms.items() if v is not None}
    drawn = bars.bar(list(arms), list(arms.values()), color=["tab:blue", "tab:gray"][: len(arms)])
    bars.bar_label(drawn, fmt="%.1f")
    bars.set_ylabel("output tokens / s")
    where = f"threads {summary['threads']}" if "device" not in summary else summary["device"]
    bars.set_title(f"W1: {summary['num_requests']} requests, {where}")
    for kind, pick, color in (
        ("decode only", True, "tab:blue"),
        ("with prefill", False, "tab:red"),
    ):
        xs = [r.num_seqs for r in steps if r.decode_only == pick]
        ys = [r.seconds * 1e3 for r in steps if r.decode_only == pick]
        scatter.scatter(xs, ys, s=8, alpha=0.6, color=color, label=kind)
    scatter.set_xlabel("sequences in the step")
    scatter.set_ylabel("step time (ms)")
    scatter.set_title("kvserve engine steps")
    scatter.legend()
    save_figure(fig, path, dpi=120)


def save_results(out_dir: Path, summary: dict[str, Any], steps: list[StepRecord]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"summary": summary, "steps": [asdict(r) for r in steps]}
    (out_dir / "engine.json").write_text(json.dumps(data, indent=1) + "\n")
