"""`kvserve bench calibrate --out PROFILE.json`: fit the cost profile that simulated workers run
on (DESIGN.md section 2.2) from this machine's real engine.

1. Steps: the engine `kvserve serve` builds (the file's quantized weights, a 2 GiB KV budget,
   blocks of 16, the default scheduler: 512-token chunks and step budget) on --threads torch
   threads runs real requests (random prompt ids, EOS ignored, fixed max_tokens): fresh
   prompts of 16..2048 tokens, alone and several at once; prefix hits (a prompt, then the same
   prompt with a suffix, so the suffix's chunks run over a cached context of 256..2048);
   batches of 1..64 decodes at contexts ~64..2048, 8 decode steps each (up to 4,096 tokens
   in all, each sequence with a context of its own; larger batches share a cached prefix,
   each sequence with a suffix of its own); and mixed steps (prompts arriving while decodes
   run). A warm-up runs first, unrecorded. Every call of the model runner is recorded with its
   batch's StepShape and its wall seconds. The grid runs twice on fresh prompts, which gives
   the same steps, and each step's faster time is kept (other processes only ever add time).
2. Fit: the six StepCost terms by non-negative least squares on relative error
   (lib/cost_fit.py); the error of the fitted model on the steps it was fitted on, per class of
   step (decode-only, prompt-only, mixed).
3. Store: through the StoreConnector of engines on the Redis at --redis (default: a
   redis-server of its own on a free port, stopped at the end; the db is FLUSHed first, a given
   one too) in --store-format: writing a prompt's blocks (from the end of the step that
   published them until `flush` returns), a presence round trip (median), and a fresh engine
   loading a stored run of blocks for the same prompt (the FetchResult's load time). Per block:
   (time - round trip) / blocks; frame bytes per token as encoded.
4. The profile (source "measured") is written to --out and to the `cpu` profile's path
   (<cache dir>/profiles/cpu.json), with the fit's points and errors under "fit".
--quick runs a small grid (for tests; its profile is rough, and it too becomes `cpu`). The
last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import json
import os
import re
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from kvserve.services.bench.lib.calibration_steps import FULL, QUICK, Grid, measure_steps
from kvserve.services.bench.lib.calibration_store import (
    StoreMeasure,
    flush_db,
    measure_store,
    redis_url,
)
from kvserve.services.bench.lib.cost_fit import CLASSES, StepFit, fit_step_cost
from kvserve.services.bench.lib.flags import add_gguf, add_seed
from kvserve.services.bench.lib.host import describe_cpu
from kvserve.services.bench.lib.process import StartError
from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    StoreConfig,
    default_model_path,
)
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.sim.profile import (
    CostProfile,
    EngineShape,
    ModelledModel,
    StepCost,
    StepShape,
    StoreCost,
    calibrated_path,
)
from kvserve.shared.engine.startup import kept_formats
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.tokenizer import KVTokenizer

KV_DTYPE = "float32"  # the engine's KV cache: the model's dtype
TERM_UNITS = {
    "base_s": "",
    "per_token_s": "x new tokens",
    "per_prefill_pair_s": "x prompt (query, key) pairs",
    "per_decode_context_s": "x decode context tokens",
    "per_sampled_row_s": "x sampled rows",
    "mixed_step_s": "x [step has a prompt chunk]",
}


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, metavar="PATH", help="the profile (JSON)")
    p.add_argument("--threads", type=int, default=_default_threads(), help="default: all cores")
    p.add_argument(
        "--redis",
        default=None,
        metavar="URL",
        help="the Redis to measure the store on; its db is FLUSHed (FLUSHDB) first, so give "
        "one whose keys may go (default: a redis-server of its own, stopped at the end)",
    )
    p.add_argument("--store-format", choices=STORE_FORMATS, default="auto",
                   help="store frames (auto: the KV cache's own format)")  # fmt: skip
    add_gguf(p)
    p.add_argument("--quick", action="store_true", help="a small grid, for tests (a rough profile)")
    p.add_argument("--served", action="store_true", help=SERVED_HELP)
    p.add_argument("--workers", type=int, default=1,
                   help="--served: real workers serving at once (--threads each)")  # fmt: skip
    p.add_argument("--name", default=None, help="profile name (default: cpu-<machine label>)")
    add_seed(p)


SERVED_HELP = (
    "fit on the steps real workers run while they serve calibration workloads through the "
    "gateway (kvserve worker --step-log), the conditions a fleet of --workers meets on this "
    "machine, instead of an engine's steps alone"
)


# ---- the profile -------------------------------------------------------------------------------


def machine_label(threads: int) -> str:
    """The CPU model in lower-case words joined by '-', and the thread count ("amd-epyc-2t")."""
    model = describe_cpu().split(" (")[0]
    return "-".join(re.findall(r"[a-z0-9]+", model.lower())) + f"-{threads}t"


def served_label(args: argparse.Namespace) -> str:
    """How the steps were measured, in the profile's name: "-served-2w" or nothing."""
    return f"-served-{args.workers}w" if args.served else ""


def commit() -> str:
    """The source tree's git commit (short), or "unknown commit" outside a checkout."""
    try:
        done = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown commit"
    return done.stdout.strip() if done.returncode == 0 else "unknown commit"


def modelled(engine: Engine, name: str, host_tier_bytes: int) -> tuple[ModelledModel, EngineShape]:
    """The engine's model (named `name`) and its KV capacity and scheduler limits, with a host
    tier of `host_tier_bytes` in its blocks."""
    mc, sched = engine.model_config, engine.config.scheduler
    model = ModelledModel(
        name, mc.num_layers, mc.num_kv_heads, mc.head_dim, KV_DTYPE, engine.max_model_len
    )
    shape = EngineShape(
        num_blocks=engine.kv.num_blocks,
        block_size=engine.block_size,
        host_tier_blocks=host_tier_bytes // (engine.block_size * model.kv_bytes_per_token),
        max_num_seqs=sched.max_num_seqs,
        max_num_batched_tokens=sched.max_num_batched_tokens,
        max_prefill_chunk=sched.max_prefill_chunk,
    )
    return model, shape


def build_profile(
    args: argparse.Namespace,
    model: tuple[ModelledModel, EngineShape],
    step: StepCost,
    store: StoreCost,
) -> CostProfile:
    """The measured profile: --name (default cpu-<machine label>), this machine, today."""
    today = datetime.datetime.now(datetime.UTC).date().isoformat()
    return CostProfile(
        name=args.name or f"cpu-{machine_label(args.threads)}{served_label(args)}",
        source="measured",
        machine=f"{describe_cpu()}, {args.threads} torch threads"
        + (f" per worker, {args.workers} served" if args.served else ""),
        reference=f"kvserve bench calibrate{' --served' if args.served else ''} {today} {commit()}",
        model=model[0],
        engine=model[1],
        step=step,
        store=store,
    )


def fit_extra(fit: StepFit, store: StoreMeasure, args: argparse.Namespace) -> dict[str, Any]:
    """The profile's "fit" section: every step fitted, the errors, the store's measurements."""
    points = [
        {**asdict(s), "measured_s": m, "predicted_s": p}
        for s, m, p in zip(fit.shapes, fit.measured, fit.predicted, strict=True)
    ]
    return {
        "threads": args.threads,
        "grid": "quick" if args.quick else "full",
        "errors": {k: asdict(e) for k, e in fit.errors.items()},
        "store": asdict(store),
        "points": points,
    }


def print_report(profile: CostProfile, fit: StepFit, store: StoreMeasure) -> None:
    """The coefficients, the fit's error per class of step, the store's figures."""
    print(f"profile {profile.name}: {profile.machine}")
    print("step cost (seconds = the sum of the terms):")
    for name, value in asdict(profile.step).items():
        print(f"  {name:<22} {value:10.4g}  {TERM_UNITS[name]}")
    print("fit error, |predicted - measured| / measured:")
    print(f"  {'class':<8} {'steps':>6} {'mean':>7} {'p90':>7}")
    for cls in (*CLASSES, "all"):
        if (e := fit.errors.get(cls)) is not None:
            print(f"  {cls:<8} {e.points:>6} {e.mean:>7.1%} {e.p90:>7.1%}")
    s = profile.store
    print(
        f"store ({store.format}): round trip {s.rtt_s * 1e3:.2f} ms, load "
        f"{s.load_s_per_block * 1e3:.3f} ms/block ({store.load_blocks} blocks in "
        f"{store.load_s * 1e3:.1f} ms), write {s.write_s_per_block * 1e3:.3f} ms/block "
        f"({store.write_blocks} in {store.write_s * 1e3:.1f} ms), "
        f"{s.frame_bytes_per_token:,.0f} B/token"
    )


def write_profile(profile: CostProfile, extra: dict[str, Any], out: Path) -> list[Path]:
    """The profile at `out` and at the `cpu` profile's path (folders made); both paths."""
    text = profile.to_json(extra)
    paths = [out, calibrated_path()]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return paths


# ---- run ---------------------------------------------------------------------------------------


def check_args(args: argparse.Namespace) -> None:
    """Bad options are a one-line error, before anything is loaded."""
    if args.threads < 1 or args.workers < 1:
        raise CliError("--threads and --workers must be >= 1")
    args.gguf = args.gguf or default_model_path()
    if not args.gguf.is_file():
        raise CliError(f"--gguf: no model file at {args.gguf} (run `kvserve fetch-model`)")


@dataclass(frozen=True)
class Model:
    """One load of the model, shared by every engine of the run."""

    config: EngineConfig  # the engine `kvserve serve` builds, on --threads threads
    weights: LoadedWeights
    tokenizer: KVTokenizer

    @classmethod
    def load(cls, args: argparse.Namespace) -> Model:
        config = EngineConfig(
            model_path=str(args.gguf),
            num_threads=args.threads,
            cache=CacheConfig(populate="eager"),
        )
        weights = load_weights(args.gguf, torch.float32, kept_formats(config))
        return cls(config, weights, KVTokenizer.from_path(args.gguf))

    def engine(self, config: EngineConfig) -> Engine:
        return Engine(config, tokenizer=self.tokenizer, weights=self.weights)

    def store_engine(self, url: str, fmt: str, grid: Grid) -> Engine:
        """An engine on the store at `url`, with room for every block of the store's part."""
        tokens = (grid.store_repeats + 1) * (grid.write_tokens + grid.load_tokens)
        cache = CacheConfig(
            num_blocks=tokens // self.config.cache.block_size + 64, populate="eager"
        )
        store = StoreConfig(url=url, format=fmt)
        return self.engine(dataclasses.replace(self.config, cache=cache, store=store))


def measure_engine(
    model: Model, grid: Grid, args: argparse.Namespace
) -> tuple[StepFit, tuple[ModelledModel, EngineShape]]:
    """The fit of the serving engine's steps, and what the profile says of that engine; the
    engine is closed (its cache freed) before this returns."""
    if args.served:
        steps = served(args)
        lazy = dataclasses.replace(model.config, cache=CacheConfig(populate="lazy"))
        engine = model.engine(lazy)
    else:
        engine = model.engine(model.config)
        print(
            f"engine: {engine.kv.num_blocks} blocks of {engine.block_size}, {args.threads} threads"
        )
        steps = [(r.shape, r.seconds) for r in measure_steps(engine, grid, args.seed)]
    fit = fit_step_cost([shape for shape, _ in steps], [seconds for _, seconds in steps])
    described = modelled(engine, args.gguf.stem, StoreConfig().host_tier_bytes)
    engine.close()
    del engine
    gc.collect()
    return fit, described


def served(args: argparse.Namespace) -> list[tuple[StepShape, float]]:
    """The steps --workers real workers ran serving the calibration workloads."""
    from kvserve.services.bench.lib.calibration_served import served_steps

    log_dir = args.out.parent / f"{args.out.stem}-served"
    print(f"serving the calibration workloads: {args.workers} worker(s) x {args.threads} threads")
    try:
        steps = served_steps(args.gguf, args.workers, args.threads, log_dir, args.quick, args.seed)
    except (RuntimeError, StartError) as e:
        raise CliError(f"--served: {e}") from None
    print(f"{len(steps)} served steps (logs in {log_dir})")
    return steps


def run(args: argparse.Namespace) -> int:
    check_args(args)
    t0, busy = time.perf_counter(), os.getloadavg()[0]
    grid = QUICK if args.quick else FULL
    model = Model.load(args)
    fit, described = measure_engine(model, grid, args)
    with redis_url(args.redis) as url:
        flush_db(url)
        store = measure_store(lambda: model.store_engine(url, args.store_format, grid), grid)
    profile = build_profile(args, described, fit.step, store.cost())
    wall = time.perf_counter() - t0
    extra = {"fit": fit_extra(fit, store, args) | {"wall_s": wall, "load_average": busy}}
    paths = write_profile(profile, extra, args.out)
    print_report(profile, fit, store)
    print(f"load average before the run: {busy:.2f} (other processes' work slows the steps)")
    print(f"wrote {paths[0]} and {paths[1]} in {wall:.0f} s")
    summary = {
        "name": profile.name,
        "step": asdict(profile.step),
        "store": asdict(profile.store),
        "errors": {k: asdict(e) for k, e in fit.errors.items()},
        "steps": len(fit.shapes),
        "wall_s": wall,
        "load_average": busy,
        "out": str(paths[0]),
        "profile": str(paths[1]),
    }
    print(json.dumps(summary))
    return 0
