"""The steps part of `kvserve bench calibrate`: a grid of real requests on the engine `kvserve
serve` builds, every model-runner call recorded with its batch's StepShape and wall seconds."""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from kvserve.services.bench.workloads.tokens import random_tokens
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.model_runner import StepOutput
from kvserve.shared.engine.scheduler import Batch
from kvserve.shared.engine.sim.profile import (
    StepShape,
)
from kvserve.shared.sampling_params import SamplingParams

SUFFIX = 16  # tokens of its own each decode sequence has after the shared prefix


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

    def timed(batch: Batch, launched: Callable[[], None] | None = None) -> StepOutput:
        rows = [(s.num_new_tokens, s.seq.num_computed_tokens, s.samples) for s in batch.scheduled]
        t0 = time.perf_counter()
        out = run(batch, launched)
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
