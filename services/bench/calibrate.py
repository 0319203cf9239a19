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
import contextlib
import dataclasses
import datetime
import gc
import json
import os
import random
import re
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import redis
import torch
from kvserve.services.bench.lib.cost_fit import CLASSES, StepFit, fit_step_cost, store_cost
from kvserve.services.bench.lib.engine_timing import first_token_s
from kvserve.services.bench.lib.flags import add_gguf, add_seed
from kvserve.services.bench.lib.host import describe_cpu
from kvserve.services.bench.lib.redis_server import RedisServer, redis_binaries_present
from kvserve.services.bench.workloads.tokens import random_tokens
from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    StoreConfig,
    default_model_path,
)
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.connector import FetchResult
from kvserve.shared.engine.model_runner import StepOutput
from kvserve.shared.engine.scheduler import Batch
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
from kvserve.shared.sampling_params import SamplingParams
from kvserve.shared.store.redis import split_store_query

SUFFIX = 16  # tokens of its own each decode sequence has after the shared prefix
RTT_PROBES = 20
KV_DTYPE = "float32"  # the engine's KV cache: the model's dtype
TERM_UNITS = {
    "base_s": "",
    "per_token_s": "x new tokens",
    "per_prefill_pair_s": "x prompt (query, key) pairs",
    "per_decode_context_s": "x decode context tokens",
    "per_sampled_row_s": "x sampled rows",
    "mixed_step_s": "x [step has a prompt chunk]",
}


@dataclass(frozen=True)
class Grid:
    """The requests a calibration runs (token counts)."""

    prompts: tuple[int, ...]  # fresh prompts, one at a time
    together: tuple[tuple[int, ...], ...]  # fresh prompts arriving at once
    cached: tuple[int, ...]  # cached prefixes of the prefix hits
    suffixes: tuple[int, ...]  # the new part of a prefix hit
    contexts: tuple[int, ...]  # decode contexts
    batches: tuple[int, ...]  # decode batch sizes
    unique_tokens: int  # the largest decode batch x context whose sequences share no prefix
    decode_steps: int
    mixed: tuple[tuple[int, int], ...]  # (decodes, context) running while prompts arrive
    arrivals: tuple[int, ...]  # the prompts that arrive, one every ARRIVAL_GAP steps
    write_tokens: int  # a write: one prompt chunk's blocks
    load_tokens: int  # a load: this prompt's blocks
    store_repeats: int  # timed writes and loads, after one untimed each
    rounds: int  # runs of the step grid (each step's fastest run is fitted)


ARRIVAL_GAP = 6
FULL = Grid(
    prompts=(16, 32, 64, 128, 256, 512, 1024, 2048),
    together=((64, 96, 128, 160), (200, 300, 400)),
    cached=(256, 512, 1024, 2048),
    suffixes=(16, 64, 256, 512),
    contexts=(64, 256, 1024, 2048),
    batches=(1, 2, 4, 8, 16, 32, 64),
    unique_tokens=4096,
    decode_steps=8,
    mixed=((4, 256), (16, 512), (32, 1024)),
    arrivals=(64, 256, 512, 1024),
    write_tokens=512,
    load_tokens=1024,
    store_repeats=3,
    rounds=2,
)
QUICK = Grid(
    prompts=(16, 128, 512),
    together=((64, 96),),
    cached=(256,),
    suffixes=(16, 128),
    contexts=(64, 256),
    batches=(1, 4, 16),
    unique_tokens=1024,
    decode_steps=4,
    mixed=((4, 256),),
    arrivals=(64, 256),
    write_tokens=256,
    load_tokens=256,
    store_repeats=2,
    rounds=2,
)


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
                   help="store frames (auto: int8 for Redis)")  # fmt: skip
    add_gguf(p)
    p.add_argument("--quick", action="store_true", help="a small grid, for tests (a rough profile)")
    p.add_argument("--name", default=None, help="profile name (default: cpu-<machine label>)")
    add_seed(p)


# ---- recording and driving the engine ------------------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    shape: StepShape
    seconds: float


@contextlib.contextmanager
def recorded_steps(engine: Engine) -> Iterator[list[StepRecord]]:
    """Within the block every call of the engine's model runner is recorded with its batch's
    shape (taken before the call) and its wall seconds; the runner's bound `run` is replaced
    only while the block runs."""
    runner = engine.model_runner
    run = runner.run
    records: list[StepRecord] = []

    def timed(batch: Batch) -> StepOutput:
        rows = [(s.num_new_tokens, s.seq.num_computed_tokens, s.samples) for s in batch.scheduled]
        t0 = time.perf_counter()
        out = run(batch)
        records.append(StepRecord(StepShape.of_rows(rows), time.perf_counter() - t0))
        return out

    runner.run = timed  # type: ignore[method-assign]
    try:
        yield records
    finally:
        runner.run = run  # type: ignore[method-assign]


@dataclass(frozen=True)
class Arrival:
    at_step: int  # steps of the run taken before the request is added
    prompt: list[int]
    max_tokens: int


class Driver:
    """Runs requests on one engine: random prompt ids from one seeded generator, unique ids."""

    def __init__(self, engine: Engine, rng: random.Random) -> None:
        self.engine = engine
        self.rng = rng
        self.requests = 0

    def tokens(self, n: int) -> list[int]:
        return random_tokens(self.rng, n, self.engine.model_config.vocab_size)

    def run(self, arrivals: list[Arrival]) -> None:
        """Add each request once its `at_step` steps have been taken; step until every
        request has finished."""
        pending = sorted(arrivals, key=lambda a: a.at_step)
        steps = 0
        while pending or self.engine.has_unfinished_requests():
            while pending and pending[0].at_step <= steps:
                a = pending.pop(0)
                self.requests += 1
                params = SamplingParams(max_tokens=a.max_tokens, ignore_eos=True)
                self.engine.add_request(f"cal-{self.requests}", a.prompt, params)
            self.engine.step()
            steps += 1

    def prompt(self, prompt: list[int]) -> None:
        """One prompt alone, to its first token."""
        self.run([Arrival(0, prompt, 1)])

    def cached_prefix(self, context: int) -> list[int]:
        """A prefix of `context` - SUFFIX tokens (whole blocks), computed and cached."""
        prefix = self.tokens(context - SUFFIX)
        self.prompt(prefix)
        return prefix

    def decodes(self, prefix: list[int], batch: int, max_tokens: int) -> list[Arrival]:
        """`batch` requests at once: `prefix` (cached) and SUFFIX tokens of their own."""
        return [Arrival(0, prefix + self.tokens(SUFFIX), max_tokens) for _ in range(batch)]


# ---- the grid --------------------------------------------------------------------------------


def warm_up(d: Driver) -> None:
    """A prompt and decode batches of 1..8: the kernels warm, and the engine's per-size
    thread choice (StepThreads) has timed both of its options for every small step."""
    prefix = d.cached_prefix(64)
    for batch in (1, 2, 4, 8):
        d.run(d.decodes(prefix, batch, 8))


def fresh_prompts(d: Driver, grid: Grid) -> None:
    for n in grid.prompts:
        d.prompt(d.tokens(n))
    for group in grid.together:
        d.run([Arrival(0, d.tokens(n), 1) for n in group])


def prefix_hits(d: Driver, grid: Grid) -> None:
    for cached in grid.cached:
        prefix = d.tokens(cached)
        d.prompt(prefix)
        for n in grid.suffixes:
            d.prompt(prefix + d.tokens(n))


def decode_batches(d: Driver, grid: Grid) -> None:
    """At each context, a batch of decodes of each size: sequences with a context of their own
    (computed and cached first, so that the batch decodes together) where batch x context is
    at most `grid.unique_tokens`, else sequences sharing a cached prefix, each with a suffix
    of its own (a system prompt's requests; the attention reads the shared blocks once)."""
    steps = grid.decode_steps + 1
    for context in grid.contexts:
        prefix = d.cached_prefix(context)
        for batch in grid.batches:
            if batch * context <= grid.unique_tokens:
                prompts = [d.tokens(context) for _ in range(batch)]
                d.run([Arrival(0, p, 1) for p in prompts])
                d.run([Arrival(0, p, steps) for p in prompts])
            else:
                d.run(d.decodes(prefix, batch, steps))


def mixed_steps(d: Driver, grid: Grid) -> None:
    """Decodes running while fresh prompts arrive, then a prefix hit on their own prefix."""
    for batch, context in grid.mixed:
        prefix = d.cached_prefix(context)
        arrivals = d.decodes(prefix, batch, ARRIVAL_GAP * (len(grid.arrivals) + 3))
        at = [ARRIVAL_GAP * (i + 1) for i in range(len(grid.arrivals) + 1)]
        prompts = [d.tokens(n) for n in grid.arrivals] + [prefix + d.tokens(grid.suffixes[-1])]
        d.run(arrivals + [Arrival(s, p, 1) for s, p in zip(at, prompts, strict=True)])


PARTS = (fresh_prompts, prefix_hits, decode_batches, mixed_steps)


def grid_round(d: Driver, grid: Grid) -> list[StepRecord]:
    """Every step of one run of the grid's requests, in order."""
    with recorded_steps(d.engine) as records:
        for part in PARTS:
            t0, before = time.perf_counter(), len(records)
            part(d, grid)
            name = part.__name__.replace("_", " ")
            print(f"  {name}: {len(records) - before} steps, {time.perf_counter() - t0:.1f} s")
    return records


def measure_steps(engine: Engine, grid: Grid, seed: int) -> list[StepRecord]:
    """The grid's steps, after an unrecorded warm-up, run `grid.rounds` times on fresh
    prompts (the same shapes each time: the scheduler's choices depend on token counts only):
    each step's shape with the least of its rounds' seconds, since whatever else runs on the
    machine only ever adds time."""
    d = Driver(engine, random.Random(seed))
    warm_up(d)
    rounds = []
    for r in range(grid.rounds):
        print(f"round {r + 1} of {grid.rounds}:", flush=True)
        rounds.append(grid_round(d, grid))
    shapes = [s.shape for s in rounds[0]]
    if any([s.shape for s in other] != shapes for other in rounds[1:]):
        raise RuntimeError("a round of the same requests ran other steps than the first")
    return [StepRecord(shape, min(r[i].seconds for r in rounds)) for i, shape in enumerate(shapes)]


# ---- the store ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoreMeasure:
    """What the store part measured (times in seconds)."""

    rtt_s: float  # median presence round trip of one block
    write_s: float  # median: a prompt chunk's blocks, from its step's end until flushed
    write_blocks: int
    load_s: float  # median FetchResult load time (gets, verification, decode, cache writes)
    load_blocks: int
    contains_s: float  # median presence of a load's whole prompt (the fetch's first stage)
    frame_bytes_per_token: float
    format: str

    def cost(self) -> StoreCost:
        """The profile's store figures: per-block costs with the round trip taken off."""
        return store_cost(self.rtt_s, self.load_s, self.load_blocks, self.write_s,
                          self.write_blocks, self.frame_bytes_per_token)  # fmt: skip


def timed_write(engine: Engine, rid: str, prompt: list[int]) -> float:
    """Seconds from the end of the prompt's one step (which published its full blocks) until
    the store holds them all."""
    first_token_s(engine, rid, prompt)
    t0 = time.perf_counter()
    if not engine.kv.flush():
        raise RuntimeError("the store did not take the blocks within 30 s")
    return time.perf_counter() - t0


def round_trip_s(engine: Engine, prompt: list[int]) -> float:
    """The median of RTT_PROBES presence questions for the prompt's first block."""
    first = engine.kv.prefix_hashes(prompt, None)[:1]
    times = []
    for _ in range(RTT_PROBES):
        t0 = time.perf_counter()
        engine.kv.stored(first)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def timed_load(engine: Engine, rid: str, prompt: list[int], blocks: int) -> FetchResult:
    """The store lookup of a prompt whose first `blocks` blocks the store holds; RuntimeError
    unless all of them were loaded."""
    first_token_s(engine, rid, prompt)
    f = engine.kv.last_fetch
    if f is None or f.decision != "load" or f.loaded != blocks:
        got = "no lookup" if f is None else f"{f.decision}, {f.loaded} loaded"
        raise RuntimeError(f"the store load of {blocks} blocks did not happen ({got})")
    return f


def measure_store(make: Callable[[], Engine], grid: Grid) -> StoreMeasure:
    """Engine A writes prompts' blocks (timed, one untimed first) and the prefixes to load;
    a fresh engine B loads each prefix for the same prompt plus a suffix (one untimed
    first). Both engines are closed."""
    a = make()
    d = Driver(a, random.Random(1))
    n = grid.store_repeats + 1
    writes = [timed_write(a, f"w{i}", d.tokens(grid.write_tokens)) for i in range(n)][1:]
    prefixes = [d.tokens(grid.load_tokens) for _ in range(n)]
    for i, p in enumerate(prefixes):
        first_token_s(a, f"p{i}", p)
    a.kv.flush()
    rtt = round_trip_s(a, prefixes[0])
    conn = a.kv.connector
    assert conn is not None
    frame_bytes = conn.encoded_bytes / conn.encoded_tokens
    fmt = a.config.store.frame_format
    prompts = [p + d.tokens(SUFFIX) for p in prefixes]
    a.close()
    del a, d  # A's cache goes before B's is made
    b = make()
    blocks = grid.load_tokens // b.block_size
    loads = [timed_load(b, f"l{i}", p, blocks) for i, p in enumerate(prompts)]
    b.close()
    return StoreMeasure(
        rtt_s=rtt,
        write_s=statistics.median(writes),
        write_blocks=grid.write_tokens // b.block_size,
        load_s=statistics.median(f.timings["load_s"] for f in loads[1:]),
        load_blocks=blocks,
        contains_s=statistics.median(f.timings["contains_s"] for f in loads[1:]),
        frame_bytes_per_token=frame_bytes,
        format=fmt,
    )


@contextlib.contextmanager
def redis_url(given: str | None) -> Iterator[str]:
    """The given URL, or a redis-server of its own (stopped after the block)."""
    if given is not None:
        yield given
        return
    if not redis_binaries_present():
        raise CliError("redis-server is not on PATH: install it or pass --redis URL")
    server = RedisServer()
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def flush_db(url: str) -> None:
    """FLUSHDB on the db the store URL names (its store-only query parameters dropped)."""
    try:
        with redis.Redis.from_url(split_store_query(url)[2]) as client:
            client.flushdb()
    except redis.RedisError as e:
        raise CliError(f"--redis {url}: FLUSHDB failed: {e}") from None


# ---- the profile -------------------------------------------------------------------------------


def machine_label(threads: int) -> str:
    """The CPU model in lower-case words joined by '-', and the thread count ("amd-epyc-2t")."""
    model = describe_cpu().split(" (")[0]
    return "-".join(re.findall(r"[a-z0-9]+", model.lower())) + f"-{threads}t"


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
        name=args.name or f"cpu-{machine_label(args.threads)}",
        source="measured",
        machine=f"{describe_cpu()}, {args.threads} torch threads",
        reference=f"kvserve bench calibrate {today} {commit()}",
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
    if args.threads < 1:
        raise CliError(f"--threads must be >= 1, got {args.threads}")
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
    engine = model.engine(model.config)
    print(f"engine: {engine.kv.num_blocks} blocks of {engine.block_size}, {args.threads} threads")
    records = measure_steps(engine, grid, args.seed)
    fit = fit_step_cost([r.shape for r in records], [r.seconds for r in records])
    described = modelled(engine, args.gguf.stem, StoreConfig().host_tier_bytes)
    engine.close()
    del engine
    gc.collect()
    return fit, described


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
