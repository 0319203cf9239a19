"""`kvserve bench prefix`: what prefix caching buys, measured in one run on the engine.

1. TTFT of a shared system prompt (default 2,048 tokens) plus a 32-token question, cold (a
   system prompt never seen) vs warm (another question with the same system prompt ran first),
   median of --repeats. Target: >= 20x (95% reduction).
2. SGLang's generated-shared-prefix workload, scaled down: G groups x P requests, a per-group
   prefix, distinct questions, fixed output length (EOS ignored), all submitted at once: output
   tok/s and mean TTFT with prefix caching on vs off. Target: >= 3x throughput.
3. Overhead at a 0% hit rate: workload W1 of `bench engine` (all prompts unique), throughput with
   caching on vs off. Target: within 2%.
4. TTFT against the cached prefix length (0 .. 4,096) for a fixed 32-token suffix (plot).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.engine_timing import first_token_s
from kvserve.services.bench.lib.flags import add_model, add_seed, add_sizes, check_sizes
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.bench.workloads.batch import WorkloadSpec, make_requests
from kvserve.services.bench.workloads.tokens import random_tokens
from kvserve.services.cli_support import CliError
from kvserve.shared.config import CacheConfig, EngineConfig, SchedulerConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

PARTS = ("ttft", "gsp", "w1", "sweep")
SIZES = {"system-len": 2048, "question-len": 32, "repeats": 3, "gsp-groups": 8,
         "gsp-per-group": 8, "gsp-prefix-len": 1024, "gsp-question-len": 64,
         "gsp-output-len": 64}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    add_sizes(p, SIZES)
    p.add_argument("--w1-requests", type=int, default=128, help="0 skips the overhead arm")
    p.add_argument("--sweep", default="0,512,1024,2048,3072,4096", help="cached prefix lengths")
    add_seed(p)
    p.add_argument("--plot", type=Path, default=None)
    p.add_argument("--parts", default="ttft,gsp,w1,sweep", help="which measurements to run")


class Bench:
    """Engines on one loaded copy of the weights; a fresh engine per arm."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.weights: LoadedWeights = load_weights(model)
        self.tokenizer = KVTokenizer.from_path(model)
        self.vocab = self.weights.config.vocab_size
        self._ids = 0

    def engine(self, caching: bool, max_num_seqs: int = 128) -> Engine:
        cfg = EngineConfig(
            model_path=self.model,
            cache=CacheConfig(
                enable_prefix_caching=caching, memory_budget_bytes=4 << 30, populate="eager"
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs),
        )
        return Engine(cfg, tokenizer=self.tokenizer, weights=self.weights)

    def rid(self) -> str:
        self._ids += 1
        return f"b{self._ids}"

    def tokens(self, rng: random.Random, n: int) -> list[int]:
        return random_tokens(rng, n, self.vocab)

    def warm(self, engine: Engine, rng: random.Random) -> None:
        """One short request first: the kernels warm before anything is timed."""
        first_token_s(engine, self.rid(), self.tokens(rng, 64))

    def ttft(self, engine: Engine, prompt: list[int]) -> float:
        return first_token_s(engine, self.rid(), prompt)


def system_prompt_ttft(b: Bench, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    engine = b.engine(caching=True)
    cold, warm = [], []
    b.warm(engine, rng)
    for _ in range(args.repeats):
        system = b.tokens(rng, args.system_len)
        q1, q2 = (b.tokens(rng, args.question_len) for _ in range(2))
        cold.append(b.ttft(engine, system + q1))
        warm.append(b.ttft(engine, system + q2))
    c, w = statistics.median(cold), statistics.median(warm)
    print(
        f"system prompt {args.system_len} + question {args.question_len}: TTFT cold "
        f"{c:.3f}s (range {min(cold):.3f}-{max(cold):.3f}), warm {w:.3f}s "
        f"(range {min(warm):.3f}-{max(warm):.3f}): {c / w:.1f}x, reduction {1 - w / c:.1%}"
    )
    return {"ttft_cold_s": c, "ttft_warm_s": w, "ttft_reduction": 1 - w / c, "ttft_speedup": c / w}


def run_all_at_once(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, rids: list[str]
) -> dict[str, float]:
    """Submit everything, run to completion: output tok/s and mean TTFT."""
    t0 = time.perf_counter()
    for rid, p in zip(rids, prompts, strict=True):
        engine.add_request(rid, p, params)
    first: dict[str, float] = {}
    tokens = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            n = sum(len(d.token_ids) for d in out.completions)
            tokens += n
            if n and out.request_id not in first:
                first[out.request_id] = time.perf_counter() - t0
    wall = time.perf_counter() - t0
    return {
        "tok_s": tokens / wall,
        "mean_ttft_s": statistics.mean(first.values()),
        "wall_s": wall,
        "tokens": tokens,
    }


def shared_prefix(b: Bench, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    prefixes = [b.tokens(rng, args.gsp_prefix_len) for _ in range(args.gsp_groups)]
    prompts = [
        p + b.tokens(rng, args.gsp_question_len)
        for p in prefixes
        for _ in range(args.gsp_per_group)
    ]
    params = SamplingParams(max_tokens=args.gsp_output_len, ignore_eos=True)
    res = {}
    for caching in (True, False):
        engine = b.engine(caching)
        b.warm(engine, rng)
        res[caching] = run_all_at_once(engine, prompts, params, [b.rid() for _ in prompts])
        _print_gsp(args, caching, res[caching], engine.prefix_cache_stats)
    speedup = res[True]["tok_s"] / res[False]["tok_s"]
    print(
        f"shared-prefix throughput speedup {speedup:.2f}x, TTFT "
        f"{res[False]['mean_ttft_s'] / res[True]['mean_ttft_s']:.2f}x lower"
    )
    return {"gsp_on": res[True], "gsp_off": res[False], "gsp_speedup": speedup}


def _print_gsp(
    args: argparse.Namespace, caching: bool, res: dict[str, float], hit: dict[str, Any]
) -> None:
    print(
        f"shared-prefix {args.gsp_groups}x{args.gsp_per_group} caching "
        f"{'on ' if caching else 'off'}: {res['tok_s']:.1f} tok/s, mean TTFT "
        f"{res['mean_ttft_s']:.2f}s, wall {res['wall_s']:.1f}s, "
        f"hits {hit['hits_tokens']}/{hit['queries_tokens']} tokens"
    )


def zero_hit_overhead(b: Bench, args: argparse.Namespace) -> dict[str, Any]:
    spec = WorkloadSpec(args.w1_requests, 32, 512, 16, 256, args.seed)
    requests = make_requests(spec, b.vocab)
    res = {}
    for caching in (False, True):
        engine = b.engine(caching)
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
        t0 = time.perf_counter()
        for r, p in zip(requests, params, strict=True):
            engine.add_request(b.rid(), r.prompt, p)
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(d.token_ids) for o in engine.step() for d in o.completions)
        res[caching] = tokens / (time.perf_counter() - t0)
    overhead = 1 - res[True] / res[False]
    print(
        f"0% hit rate (W1, {args.w1_requests} requests): caching off {res[False]:.1f} tok/s, "
        f"on {res[True]:.1f} tok/s, overhead {overhead:+.2%}"
    )
    return {"w1_off_tok_s": res[False], "w1_on_tok_s": res[True], "zero_hit_overhead": overhead}


def ttft_sweep(b: Bench, rng: random.Random, args: argparse.Namespace) -> dict[str, Any]:
    lengths = [int(x) for x in args.sweep.split(",") if x]
    engine = b.engine(caching=True)
    b.warm(engine, rng)
    warm, cold = [], []
    for n in lengths:
        prefix = b.tokens(rng, n)
        suffix = b.tokens(rng, args.question_len)
        cold.append(b.ttft(engine, prefix + suffix))  # computes and caches the prefix
        other = b.tokens(rng, args.question_len)
        warm.append(b.ttft(engine, prefix + other))
        print(
            f"cached prefix {n:5d} + {args.question_len}: TTFT warm {warm[-1]:.3f}s, "
            f"cold {cold[-1]:.3f}s"
        )
    return {"sweep_lengths": lengths, "sweep_warm_s": warm, "sweep_cold_s": cold}


def save_plot(path: Path, sweep: dict[str, Any]) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    ax.plot(sweep["sweep_lengths"], sweep["sweep_cold_s"], "o-", label="cold (computed)")
    ax.plot(sweep["sweep_lengths"], sweep["sweep_warm_s"], "o-", label="warm (cached prefix)")
    ax.set_xlabel("prefix length (tokens), + 32-token suffix")
    ax.set_ylabel("TTFT (s)")
    ax.set_title("kvserve TTFT vs cached prefix length (CPU, SmolLM2-135M fp32)")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path, dpi=120)


def check_args(args: argparse.Namespace) -> None:
    """Bad numbers are a one-line error, before any model is loaded."""
    try:
        sweep = [int(x) for x in args.sweep.split(",") if x]
    except ValueError as e:
        raise CliError(f"--sweep must be comma-separated integers, got {args.sweep!r}") from e
    check_sizes(args, list(SIZES))
    if args.w1_requests < 0 or any(n < 0 for n in sweep):
        raise CliError("--w1-requests and --sweep lengths must be >= 0")
    unknown = set(args.parts.split(",")) - set(PARTS)
    if unknown:
        raise CliError(f"--parts: unknown {sorted(unknown)}; choose from ttft,gsp,w1,sweep")


def run(args: argparse.Namespace) -> int:
    check_args(args)
    b = Bench(args.model)
    rng = random.Random(args.seed)
    parts = set(args.parts.split(","))
    summary: dict[str, Any] = {}
    if "ttft" in parts:
        summary |= system_prompt_ttft(b, rng, args)
    if "gsp" in parts:
        summary |= shared_prefix(b, rng, args)
    if "w1" in parts and args.w1_requests:
        summary |= zero_hit_overhead(b, args)
    if "sweep" in parts:
        sweep = ttft_sweep(b, rng, args)
        summary |= sweep
        if args.plot:
            save_plot(args.plot, sweep)
    print(json.dumps(summary))
    return 0
