"""The engine's steady-state decode step, measured: `decode_step` runs `batch` sequences of
`context`-token random prompts past their prefill and times pure decode steps, each followed
(outside it) by the machine measurements it is to be divided by, so that both see the machine
in the same state. Where the steps' layers ran as the one C++ call (kernels/cpu_decode_step.py),
that call's time by part as well."""

from __future__ import annotations

import contextlib
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch
from kvserve.kernels import cpu_decode_step
from kvserve.services.bench.lib.engine_timing import StepRecord, synchronizer, timed_steps
from kvserve.services.bench.workloads.tokens import random_tokens
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.sampling_params import SamplingParams

PROBE_BATCHES = (1, 8, 32)
PROBE_WARMUP_STEPS = 1

Paired = Mapping[str, Callable[[], object]]  # measurements timed beside each step, by name


@dataclass(frozen=True)
class DecodeProbe:
    batch: int
    step_ms: float  # median over the timed steps
    mean_context: float  # KV tokens each sequence reads per step, averaged over the timed steps
    # The paired measurements by name, each timed once after every timed step.
    paired_s: dict[str, tuple[float, ...]] = field(default_factory=dict)
    # Means over the timed steps of the layers' one C++ call by part (None: the steps did not
    # take it), in ms.
    layers_ms: cpu_decode_step.LayerSeconds | None = None
    # With the layers' parts: the LM head's mean time, and the median host work of as many
    # steps again, run one after the other (the rest of a step: its inputs, the embedding,
    # sampling, outputs, scheduling), in ms.
    lm_head_ms: float | None = None
    host_ms: float | None = None


def probe_max_tokens(batch: int, context: int, steps: int, step_budget: int) -> int:
    """Enough tokens that no probe sequence finishes before the timed decode steps end: early
    sequences decode while the later ones are still prefilling."""
    prefill_steps = -(-batch * context // step_budget)
    return 2 * prefill_steps + PROBE_WARMUP_STEPS + 2 * steps + 2  # timed, then the host's


def _count_tokens(outputs: list[RequestOutput], emitted: dict[str, int]) -> None:
    for out in outputs:
        if out.request_id in emitted:
            emitted[out.request_id] += sum(len(c.token_ids) for c in out.completions)


def _start_decoding(
    engine: Engine, batch: int, context: int, steps: int, seed: int
) -> dict[str, int]:
    """`batch` probe requests of `context`-token random prompts, prefilled and past a few
    untimed decode steps; their tokens emitted so far, by request id."""
    rng = random.Random(seed)
    budget = engine.scheduler.config.max_num_batched_tokens
    params = SamplingParams(
        max_tokens=probe_max_tokens(batch, context, steps, budget), ignore_eos=True
    )
    emitted = {f"probe-b{batch}-{i}": 0 for i in range(batch)}
    vocab = engine.model_config.vocab_size
    for rid in emitted:
        engine.add_request(rid, random_tokens(rng, context, vocab), params)
    while min(emitted.values()) == 0:
        _count_tokens(engine.step(), emitted)
    for _ in range(PROBE_WARMUP_STEPS):
        _count_tokens(engine.step(), emitted)
    return emitted


def _timed_decode(
    engine: Engine, emitted: dict[str, int], context: int, steps: int, paired: Paired
) -> tuple[list[StepRecord], list[float], dict[str, tuple[float, ...]]]:
    """`steps` timed steps, each followed by every paired measurement: the records, the mean
    context of each step, and the paired seconds by name."""
    contexts: list[float] = []
    paired_s: dict[str, list[float]] = {name: [] for name in paired}
    with timed_steps(engine, synchronizer(engine.config.device)) as records:
        for _ in range(steps):
            contexts.append(context + statistics.fmean(emitted.values()))
            _count_tokens(engine.step(), emitted)
            for name, measure in paired.items():
                t0 = time.perf_counter()
                measure()
                paired_s[name].append(time.perf_counter() - t0)
    return records, contexts, {name: tuple(ts) for name, ts in paired_s.items()}


def decode_step(
    engine: Engine, batch: int, context: int, steps: int, seed: int, paired: Paired | None = None
) -> DecodeProbe:
    """Median time of `steps` pure decode steps of `batch` sequences whose prompts are
    `context` tokens, after every prompt is prefilled and a few untimed decode steps.
    `paired` (machine measurements the step is compared with) are timed after each timed step,
    outside it, so that both see the machine in the same state."""
    emitted = _start_decoding(engine, batch, context, steps, seed)
    on_cpu = torch.device(engine.config.device).type == "cpu"  # where the C++ call can run
    if on_cpu:
        cpu_decode_step.timing(True)
    with _timed_lm_head(engine) as head_s:
        records, contexts, times = _timed_decode(engine, emitted, context, steps, paired or {})
    timed = cpu_decode_step.timing(False) if on_cpu else None
    layers_ms = head_ms = host_ms = None
    if timed is not None and sum(timed.layers) > 0:
        layers_ms = cpu_decode_step.LayerSeconds(*(t * 1e3 / len(records) for t in timed.layers))
        head_ms = (sum(head_s) + timed.lm_head) * 1e3 / len(records)
        host_ms = _host_work(engine, emitted, steps)
    for rid in emitted:
        engine.abort_request(rid)
    if any(r.num_seqs != batch or not r.decode_only for r in records):
        raise RuntimeError(f"decode probe at batch {batch} ran steps that were not pure decode")
    ms = statistics.median(r.seconds for r in records) * 1e3
    return DecodeProbe(batch, ms, statistics.fmean(contexts), times, layers_ms, head_ms, host_ms)


def _host_work(engine: Engine, emitted: dict[str, int], steps: int) -> float | None:
    """The median host work of `steps` more decode steps, one after the other with nothing
    measured between them (the paired measurements leave the caches cold): each step's wall
    time less its layers' time by the C++ call's own clock and its LM head's (the call's
    clock where the whole step was one call). None where a step did not take the C++ call."""
    host = []
    try:
        with _timed_lm_head(engine) as head_s:
            for _ in range(steps):
                cpu_decode_step.timing(True)  # zeroed: this step's layers alone
                before = len(head_s)
                t0 = time.perf_counter()
                _count_tokens(engine.step(), emitted)
                wall = time.perf_counter() - t0
                timed = cpu_decode_step.timing(True)
                layers = sum(timed.layers) if timed is not None else 0.0
                if timed is None or layers <= 0:
                    return None
                host.append(wall - layers - timed.lm_head - sum(head_s[before:]))
    finally:
        cpu_decode_step.timing(False)
    return statistics.median(host) * 1e3


@contextlib.contextmanager
def _timed_lm_head(engine: Engine) -> Iterator[list[float]]:
    """The seconds of each of the steps' LM head calls within the block (the model's
    `compute_logits`, wrapped only while the block runs; the paired measurements call the
    head's kernel directly, uncounted)."""
    model = engine.model_runner.model
    compute_logits = model.compute_logits
    seconds: list[float] = []

    def timed(hidden: torch.Tensor) -> torch.Tensor:
        t0 = time.perf_counter()
        logits = compute_logits(hidden)
        seconds.append(time.perf_counter() - t0)
        return logits

    model.compute_logits = timed  # type: ignore[method-assign]
    try:
        yield seconds
    finally:
        del model.compute_logits  # the class's method again
