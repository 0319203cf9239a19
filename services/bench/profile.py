"""`kvserve bench profile --workload NAME [workload options] [engine options]`: where an engine
step's time goes under a serving workload.

The requests `kvserve bench serve` would send (same workload options, same token ids) go straight
into an in-process Engine configured as `kvserve serve` configures it (the store defaults to
`memory://`, as the `kvserve` arm of `bench compare` runs); a trace's arrival times are kept,
other workloads arrive at once; no HTTP, no tokenizer. Every step is timed, and so is each part
of it, by wrapping the bound methods of this one engine (nothing is changed for other engines):

  linear        every projection (QKV, O, gate/up, down, LM head)
  attention     prefill attention, paged decode attention, writing K/V into the cache
  norm          the RMSNorms
  other model   the rest of the forward pass (embedding, RoPE, residuals, SiLU x up, copies)
  engine        the rest of the step (scheduling, metadata, sampling, prefix index, store)

Steps are split into `prefill` (some sequence computes a prompt chunk; decodes may ride along)
and `decode` (one token per sequence). The wrappers add a little time to every call they wrap.
Decode steps run their layers from Python here, as steps with prompt chunks do: the engine
otherwise runs a pure decode step's layers in one C++ call (kernels/cpu_decode_step.py), which
has no parts to time and saves the interpreter's time between the kernels, so a profiled decode
step is slower than an unprofiled one. The last line printed is one JSON object; `--out DIR`
also gets profile.json with every step.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.engine_timing import timed_steps
from kvserve.services.bench.lib.flags import add_model
from kvserve.services.cli_support import CliError

COMPONENTS = ("linear", "attention", "norm", "other model", "engine")
# `kvserve bench serve` options that only an HTTP client has.
CLIENT_OPTIONS = {
    "help", "base_url", "request_rate", "max_concurrency", "out", "slo", "model", "api_key",
    "vocab_size", "timeout", "warmup_requests", "no_plots", "send_user", "slowdown",
}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvserve.services.bench import serve
    from kvserve.services.engine_options import add_engine_arguments

    tmp = argparse.ArgumentParser(add_help=False)
    serve.add_arguments(tmp)
    g = p.add_argument_group("workload (as `kvserve bench serve`)")
    for action in tmp._actions:
        if action.dest not in CLIENT_OPTIONS:
            g._add_action(action)
    add_model(p, resolved=False)
    p.add_argument("--store", default="memory://", help="prefix store URL, or none")
    p.add_argument("--store-format", default="native")
    p.add_argument("--out", default=None, metavar="DIR", help="write DIR/profile.json")
    add_engine_arguments(p)


@dataclass
class StepTiming:
    kind: str  # "prefill" | "decode"
    seconds: float
    num_seqs: int
    num_tokens: int
    parts: dict[str, float]  # component -> seconds, COMPONENTS order


class StepTimer:
    """Accumulates time per part within the current step; `take()` ends the step."""

    def __init__(self) -> None:
        self.acc: dict[str, float] = defaultdict(float)

    def wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        acc = self.acc

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[key] += time.perf_counter() - t0

        return timed

    def take(self, step_s: float) -> dict[str, float]:
        a = self.acc
        attention = a["prefill_attention"] + a["decode_attention"] + a["store_kv"]
        model = a["forward"] + a["logits"]
        parts = {
            "linear": a["linear"],
            "attention": attention,
            "norm": a["norm"],
            "other model": max(0.0, model - a["linear"] - attention - a["norm"]),
            "engine": max(0.0, step_s - model),
        }
        self.acc.clear()
        return parts


def instrument(engine: Any, timer: StepTimer) -> None:
    """Wrap this engine's model parts, attention functions and step in `timer`'s clocks."""
    from kvserve.shared.model.linear import Linear
    from kvserve.shared.model.llama import RMSNorm

    model = engine.model_runner.model
    model.decode_in_cpp = False  # every layer from Python, where the clocks are
    for module in model.modules():
        if isinstance(module, Linear):
            module.forward = timer.wrap("linear", module.forward)  # type: ignore[method-assign]
        elif isinstance(module, RMSNorm):
            module.forward = timer.wrap("norm", module.forward)  # type: ignore[method-assign]
    model.forward = timer.wrap("forward", model.forward)
    model.compute_logits = timer.wrap("logits", model.compute_logits)
    b = engine.model_runner.backend
    engine.model_runner.backend = replace(
        b,
        store_kv=timer.wrap("store_kv", b.store_kv),
        prefill_attention=timer.wrap("prefill_attention", b.prefill_attention),
        paged_decode_attention=timer.wrap("decode_attention", b.paged_decode_attention),
    )


def _engine(args: argparse.Namespace) -> Any:
    from kvserve.services.engine_options import engine_config
    from kvserve.shared.config import default_model_path
    from kvserve.shared.engine.engine import Engine

    args.model = args.model or str(default_model_path())
    if not Path(args.model).is_file():
        raise CliError(f"--model: no such file {args.model}")
    return Engine(engine_config(args))


class Arrivals:
    """The requests of `sessions` in arrival order (at once when a session has none)."""

    def __init__(self, sessions: list[Any]) -> None:
        self.pending = sorted(
            ((s.arrival_s or 0.0, i, s.turns[0]) for i, s in enumerate(sessions)),
            key=lambda p: (p[0], p[1]),
        )

    def submit_due(self, engine: Any, now: float) -> None:
        """Add every request whose arrival time has come."""
        from kvserve.shared.sampling_params import SamplingParams

        while self.pending and self.pending[0][0] <= now:
            _, i, turn = self.pending.pop(0)
            params = SamplingParams(max_tokens=turn.output_len, ignore_eos=True)
            engine.add_request(f"profile-{i}", turn.tokens, params)

    def next_at(self) -> float:
        return self.pending[0][0]


def run_workload(engine: Any, sessions: list[Any], timer: StepTimer) -> list[StepTiming]:
    """Submit each request at its arrival time (at once when it has none) and step until every
    request has finished; returns every step's timing."""
    arrivals = Arrivals(sessions)
    steps: list[StepTiming] = []
    t0 = time.perf_counter()
    with timed_steps(engine) as records:
        while arrivals.pending or engine.has_unfinished_requests():
            arrivals.submit_due(engine, time.perf_counter() - t0)
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, arrivals.next_at() - (time.perf_counter() - t0)))
                continue
            done = len(records)
            engine.step()
            if len(records) == done:  # nothing was scheduled
                timer.take(0.0)
                continue
            r = records[-1]
            kind = "decode" if r.decode_only else "prefill"
            steps.append(
                StepTiming(kind, r.seconds, r.num_seqs, r.num_tokens, timer.take(r.seconds))
            )
    return steps


def summarize(steps: list[StepTiming], wall_s: float) -> dict[str, Any]:
    """Totals per step kind and overall: steps, tokens, seconds, and each component's seconds
    and share of the step time."""
    out: dict[str, Any] = {"wall_s": wall_s}
    for kind in ("prefill", "decode", "all"):
        chosen = [s for s in steps if kind in ("all", s.kind)]
        total = sum(s.seconds for s in chosen)
        parts = {c: sum(s.parts[c] for s in chosen) for c in COMPONENTS}
        out[kind] = {
            "steps": len(chosen),
            "tokens": sum(s.num_tokens for s in chosen),
            "seconds": total,
            "mean_step_ms": 1e3 * total / len(chosen) if chosen else None,
            "mean_seqs": sum(s.num_seqs for s in chosen) / len(chosen) if chosen else None,
            "parts_s": parts,
            "shares": {c: (v / total if total else 0.0) for c, v in parts.items()},
        }
    out["idle_s"] = max(0.0, wall_s - out["all"]["seconds"])
    return out


def table(summary: dict[str, Any]) -> str:
    head = f"{'':<12}" + "".join(f"{c:>14}" for c in (*COMPONENTS, "step total"))
    lines = [head, "-" * len(head)]
    for kind in ("prefill", "decode", "all"):
        row = summary[kind]
        if not row["steps"]:
            continue
        cells = [f"{row['parts_s'][c]:8.1f} s {row['shares'][c]:3.0%}" for c in COMPONENTS]
        lines.append(
            f"{kind:<12}" + "".join(f"{c:>14}" for c in cells) + f"{row['seconds']:12.1f} s"
        )
    for kind in ("prefill", "decode"):
        row = summary[kind]
        if row["steps"]:
            lines.append(
                f"{kind}: {row['steps']} steps, {row['tokens']} tokens, mean step "
                f"{row['mean_step_ms']:.1f} ms over {row['mean_seqs']:.1f} sequences"
            )
    lines.append(
        f"wall {summary['wall_s']:.1f} s, idle (waiting for arrivals) {summary['idle_s']:.1f} s"
    )
    return "\n".join(lines)


def _check(args: argparse.Namespace) -> None:
    from kvserve.services.bench import serve

    client_defaults = {"base_url": "http://in-process", "vocab_size": None, "timeout": 1.0,
                       "warmup_requests": 0, "max_concurrency": None, "send_user": False,
                       "slowdown": 1.0}  # fmt: skip
    serve.validate(argparse.Namespace(**{**vars(args), **client_defaults}))
    if args.workload in ("multi-round", "agentic"):
        raise CliError(
            f"--workload {args.workload} needs the server's answers; profile random, "
            "shared-prefix, multi-tenant or mooncake"
        )
    if args.threads is not None and args.threads < 1:
        raise CliError("--threads must be >= 1")


def run(args: argparse.Namespace) -> int:
    import torch
    from kvserve.services.bench import serve
    from kvserve.shared.sampling_params import SamplingParams

    _check(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    engine = _engine(args)
    sessions = serve.build_workload(args, engine.model_config.vocab_size)
    warmup = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.generate([sessions[0].turns[0].tokens[:8]], warmup)
    timer = StepTimer()
    instrument(engine, timer)
    t0 = time.perf_counter()
    steps = run_workload(engine, sessions, timer)
    summary = summarize(steps, time.perf_counter() - t0)
    engine.close()
    print(table(summary), flush=True)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        record = {"summary": summary, "steps": [asdict(s) for s in steps]}
        (out / "profile.json").write_text(json.dumps(record) + "\n")
    print(json.dumps(summary), flush=True)
    return 0
