"""`kvserve bench engine`: kvserve's Engine against Hugging Face transformers on the same fp32
weights, and against what this machine can do.

Workload W1: N requests (default 128), prompt lengths uniform in 32..512 tokens, output lengths
uniform in 16..256 (EOS ignored), all submitted at once. Prompt token ids are drawn uniformly
from the vocabulary without the special ids (< 17) with a fixed seed; both arms get the same ids.

- kvserve: one Engine (fp32, default cache config, max_num_seqs and a KV budget large enough for
  every request at once; `--kv-dtype int8|fp8` for a quantized KV cache) run to completion;
  output tok/s = generated tokens / wall time. Each step is timed from outside (engine.step
  wrapped with perf_counter) with its batch size.
- hf: `AutoModelForCausalLM.from_pretrained(...).generate()` in static batches (default 16),
  left-padded, greedy, every row generating the batch's longest target; only each request's own
  target counts as output (the rest is padding waste). Output tok/s = useful tokens / wall time.

Then the machine, in the same run: read bandwidth, fp32 matmul FLOP/s, and the model's linear
layers alone as chained F.linear calls at batch 1 and 32; and the engine's steady-state decode
step at batch 1 and 32 (~256-token contexts), each timed step followed by the machine figures it
is divided by (at batch 1 a bandwidth sample and the engine's own linear kernels alone, at batch
32 the bare chain: both then see the machine in the same state); where the steps' layers ran as
the one C++ call (kernels/cpu_decode_step.py), its time by part: the linear projections,
attention, and the rest (RoPE, KV writes, norms, activations), means over the probe's steps;
the step's time outside it is the LM head, sampling and the engine. Printed ratios (targets, not
asserted):
  ratio              = kvserve tok/s / hf tok/s                                  (>= 5)
  roofline_b1        = (weight + KV bytes) / bandwidth / engine step at batch 1  (>= 0.8)
  linear_roofline_b1 = weight bytes / bandwidth / the engine's linear kernels alone at batch 1
                       (the ceiling of roofline_b1 with these kernels)
  linear_share_b32   = bare linear time at batch 32 / engine step at batch 32    (>= 0.8)
  flop_frac_b32      = 2 * params * 32 / engine step at batch 32 / matmul peak
The last line printed is one JSON object with every number; --out DIR also gets engine.json
(the same plus every recorded step), --plot PATH a PNG. `--kv-events`: the engine logs its tier
changes and a thread does with them every 50 ms what a worker's KV event publisher does (take,
merge, number, encode; all but the Redis write), to compare W1 with and without it.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from kvserve.kernels import cpu_decode_step
from kvserve.services.bench.machine import (
    FP32_BYTES,
    KernelChain,
    LinearChain,
    llama_linear_shapes,
    measure_machine,
    num_params,
)
from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    KV_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    default_model_path,
)
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.cache import kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.engine.outputs import RequestOutput
from kvserve.shared.engine.scheduler import Batch
from kvserve.shared.engine.startup import kept_formats
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.sampling_params import SamplingParams

FIRST_ORDINARY_TOKEN = 17  # ids below are special tokens in SmolLM2's vocabulary
PROBE_BATCHES = (1, 8, 32)
PROBE_WARMUP_STEPS = 1
TARGET_RATIO = 5.0
TARGET_ROOFLINE_B1 = 0.8
TARGET_LINEAR_SHARE_B32 = 0.8

T = TypeVar("T")


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="default: the default model")
    p.add_argument("--num-requests", type=int, default=128)
    p.add_argument("--min-prompt", type=int, default=32)
    p.add_argument("--max-prompt", type=int, default=512)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=256)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="run only the kvserve arm")
    p.add_argument("--threads", type=int, default=_default_threads(), help="default: all cores")
    p.add_argument("--probe-context", type=int, default=256, help="decode-step probe context")
    p.add_argument("--probe-steps", type=int, default=20, help="decode steps timed per probe")
    p.add_argument("--bandwidth-mib", type=int, default=1024, help="tensor summed for bandwidth")
    p.add_argument("--matmul-size", type=int, default=2048, help="n of the n^3 matmul peak")
    p.add_argument("--repeats", type=int, default=9, help="timed runs per bare-linear median")
    p.add_argument("--out", default="bench-out", metavar="DIR", help="writes DIR/engine.json")
    p.add_argument("--plot", default=None, metavar="PATH", help="write a PNG plot here")
    p.add_argument("--kv-events", action="store_true", help="publish KV events (no Redis)")
    p.add_argument(
        "--weights",
        choices=("auto", "fp32", "file"),
        default="auto",
        help="the kvserve arm's linear weights (as `serve --weights`; the HF arm runs fp32)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="the kvserve arm's KV cache (as `serve --kv-dtype`; auto: fp32)",
    )


# ---- workload ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    min_prompt: int
    max_prompt: int
    min_output: int
    max_output: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        spec = cls(
            args.num_requests,
            args.min_prompt,
            args.max_prompt,
            args.min_output,
            args.max_output,
            args.seed,
        )
        if spec.num_requests < 1 or spec.min_prompt < 1 or spec.min_output < 1:
            raise CliError("--num-requests, --min-prompt and --min-output must be >= 1")
        if spec.min_prompt > spec.max_prompt or spec.min_output > spec.max_output:
            raise CliError("each --min-* must be <= its --max-*")
        return spec


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int  # tokens to generate; EOS is ignored

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.output_len


def random_prompt(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_TOKEN, vocab_size) for _ in range(length)]


def make_requests(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The same requests for the same spec, whatever arm runs them. Lengths are drawn before
    any token id, so they do not depend on the vocabulary size."""
    rng = random.Random(spec.seed)
    n = spec.num_requests
    prompt_lens = [rng.randint(spec.min_prompt, spec.max_prompt) for _ in range(n)]
    output_lens = [rng.randint(spec.min_output, spec.max_output) for _ in range(n)]
    return [
        BenchRequest(random_prompt(rng, p, vocab_size), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


# ---- step timing (wraps the engine from outside) --------------------------------------------


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    num_seqs: int
    num_tokens: int
    num_prefill_seqs: int  # sequences with a prompt chunk of more than one token

    @classmethod
    def of(cls, batch: Batch, seconds: float) -> StepRecord:
        prefills = sum(1 for s in batch.scheduled if s.num_new_tokens > 1)
        return cls(seconds, len(batch.scheduled), batch.num_tokens, prefills)

    @property
    def decode_only(self) -> bool:
        return self.num_prefill_seqs == 0


@contextlib.contextmanager
def timed_steps(engine: Engine) -> Iterator[list[StepRecord]]:
    """Within the block every `engine.step()` is timed with perf_counter and recorded with the
    Batch its scheduler produced. Only the two bound methods are replaced, and put back after;
    the engine's code is untouched."""
    records: list[StepRecord] = []
    scheduler = engine.scheduler
    schedule, step = scheduler.schedule, engine.step
    last: list[Batch] = []

    def capture() -> Batch:
        batch = schedule()
        last.append(batch)
        return batch

    def timed() -> list[RequestOutput]:
        last.clear()
        t0 = time.perf_counter()
        outputs = step()
        seconds = time.perf_counter() - t0
        if last and last[-1]:
            records.append(StepRecord.of(last[-1], seconds))
        return outputs

    scheduler.schedule = capture  # type: ignore[method-assign]
    engine.step = timed  # type: ignore[method-assign]
    try:
        yield records
    finally:
        scheduler.schedule = schedule  # type: ignore[method-assign]
        engine.step = step  # type: ignore[method-assign]


# ---- arm 1: kvserve -------------------------------------------------------------------------


@dataclass(frozen=True)
class ArmResult:
    name: str
    wall_s: float
    useful_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens computed, waste included

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s


def probe_max_tokens(batch: int, context: int, steps: int, step_budget: int) -> int:
    """Enough tokens that no probe sequence finishes before the timed decode steps end: early
    sequences decode while the later ones are still prefilling."""
    prefill_steps = -(-batch * context // step_budget)
    return 2 * prefill_steps + PROBE_WARMUP_STEPS + steps + 2


def engine_config(
    model_path: Path, requests: list[BenchRequest], args: argparse.Namespace, model: ModelConfig
) -> EngineConfig:
    """Default cache config, except a KV budget that holds every request (and each decode
    probe) at once, and a running set as large as the workload."""
    sched = SchedulerConfig(max_num_seqs=max(128, len(requests), *PROBE_BATCHES))
    bs = CacheConfig().block_size
    probe_len = args.probe_context + probe_max_tokens(
        max(PROBE_BATCHES), args.probe_context, args.probe_steps, sched.max_num_batched_tokens
    )
    blocks = max(
        sum(-(-r.num_tokens // bs) for r in requests),
        max(PROBE_BATCHES) * -(-probe_len // bs),
    )
    kv_dtype = resolve_kv_dtype(args.kv_dtype, torch.float32)
    budget = (blocks + 1) * bs * kv_bytes_per_token(model, kv_dtype)
    cache = CacheConfig(
        memory_budget_bytes=max(CacheConfig().memory_budget_bytes, budget),
        populate="eager",
        kv_dtype=args.kv_dtype,
    )
    return EngineConfig(
        model_path=str(model_path),
        dtype="float32",
        weights=args.weights,
        cache=cache,
        scheduler=sched,
        num_threads=args.threads,
    )


def run_kvserve(engine: Engine, requests: list[BenchRequest]) -> tuple[ArmResult, list[StepRecord]]:
    """All requests submitted at once, stepped to completion; wall time includes submission."""
    engine.generate([requests[0].prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    generated = 0
    with timed_steps(engine) as steps:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(f"w1-{i}", r.prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                generated += sum(len(c.token_ids) for c in out.completions)
        wall = time.perf_counter() - t0
    useful = sum(r.output_len for r in requests)
    if generated != useful:
        raise RuntimeError(f"engine generated {generated} tokens, the workload asked {useful}")
    return ArmResult("kvserve", wall, useful, generated), steps


@contextlib.contextmanager
def kv_event_drain(engine: Engine, enabled: bool) -> Iterator[dict[str, int]]:
    """With `enabled`, a thread publishes the engine's KV events as a worker does, but into
    nothing: yields its running counts {"events", "bytes"}."""
    import threading

    from kvserve.services.workers.kv_events import merge
    from kvserve.shared.protocol import KVEvent, encode

    counts = {"events": 0, "bytes": 0}
    if not enabled:
        yield counts
        return
    engine.kv.events.enable()
    stop = threading.Event()

    def drain() -> None:
        while not stop.wait(0.05):
            for e in merge(engine.kv.events.take()):
                data = encode(KVEvent("w", "i", counts["events"], e.kind, e.tier, list(e.hashes)))
                counts["events"] += 1
                counts["bytes"] += len(data)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    try:
        yield counts
    finally:
        stop.set()
        thread.join()


# ---- the engine's decode step ---------------------------------------------------------------


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
    for rid in emitted:
        engine.add_request(rid, random_prompt(rng, context, engine.model_config.vocab_size), params)
    while min(emitted.values()) == 0:
        _count_tokens(engine.step(), emitted)
    for _ in range(PROBE_WARMUP_STEPS):
        _count_tokens(engine.step(), emitted)
    return emitted


def decode_step(
    engine: Engine,
    batch: int,
    context: int,
    steps: int,
    seed: int,
    paired: Mapping[str, Callable[[], object]] | None = None,
) -> DecodeProbe:
    """Median time of `steps` pure decode steps of `batch` sequences whose prompts are
    `context` tokens, after every prompt is prefilled and a few untimed decode steps.
    `paired` (machine measurements the step is compared with) are timed after each timed step,
    outside it, so that both see the machine in the same state."""
    emitted = _start_decoding(engine, batch, context, steps, seed)
    contexts: list[float] = []
    paired_s: dict[str, list[float]] = {name: [] for name in paired or {}}
    cpu_decode_step.timing(True)
    with timed_steps(engine) as records:
        for _ in range(steps):
            contexts.append(context + statistics.fmean(emitted.values()))
            _count_tokens(engine.step(), emitted)
            for name, measure in (paired or {}).items():
                t0 = time.perf_counter()
                measure()
                paired_s[name].append(time.perf_counter() - t0)
    layers = cpu_decode_step.timing(False)
    for rid in emitted:
        engine.abort_request(rid)
    if any(r.num_seqs != batch or not r.decode_only for r in records):
        raise RuntimeError(f"decode probe at batch {batch} ran steps that were not pure decode")
    ms = statistics.median(r.seconds for r in records) * 1e3
    times = {name: tuple(ts) for name, ts in paired_s.items()}
    layers_ms = None
    if layers is not None and sum(layers) > 0:
        layers_ms = cpu_decode_step.LayerSeconds(*(t * 1e3 / len(records) for t in layers))
    return DecodeProbe(batch, ms, statistics.fmean(contexts), times, layers_ms)


# ---- arm 2: Hugging Face transformers -------------------------------------------------------


def load_hf_model(model_path: Path) -> Any:
    import transformers

    extra: dict[str, Any]
    if model_path.is_file():
        where, extra = str(model_path.parent), {"gguf_file": model_path.name}
    else:  # safetensors only, as kvserve's own loader: never a pickled checkpoint
        where, extra = str(model_path), {"use_safetensors": True}
    model = transformers.AutoModelForCausalLM.from_pretrained(where, dtype=torch.float32, **extra)
    return model.eval()


def hf_pad_token_id(model: Any) -> int:
    """The model's pad id, else its (first) EOS id; rows never stop early (min_new_tokens)."""
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else 0


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate_batch(model: Any, batch: list[BenchRequest], pad_id: int) -> int:
    """Greedy generation of the batch's longest target for every row; returns tokens made."""
    ids, mask = left_padded([r.prompt for r in batch], pad_id)
    n = max(r.output_len for r in batch)
    out = model.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=False,
        max_new_tokens=n,
        min_new_tokens=n,
        pad_token_id=pad_id,
    )
    return int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def run_hf(model_path: Path, requests: list[BenchRequest], batch_size: int) -> ArmResult:
    model = load_hf_model(model_path)
    pad_id = hf_pad_token_id(model)
    hf_generate_batch(model, [BenchRequest(requests[0].prompt[:8], 2)], pad_id)  # warm-up
    generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        generated += hf_generate_batch(model, requests[start : start + batch_size], pad_id)
    wall = time.perf_counter() - t0
    return ArmResult("hf", wall, sum(r.output_len for r in requests), generated)


# ---- the machine and the roofline -----------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    bandwidth_gb_s: float
    matmul_gflop_s: float
    linear_params: int
    bare_linear_b1_ms: float
    bare_linear_b32_ms: float


def measure_roofline(chain: LinearChain, args: argparse.Namespace) -> Roofline:
    machine = measure_machine(args.bandwidth_mib << 20, args.matmul_size)
    return Roofline(
        machine.bandwidth_gb_s,
        machine.matmul_gflop_s,
        num_params(chain.shapes),
        chain.median_ms(PROBE_BATCHES[0], args.repeats),
        chain.median_ms(PROBE_BATCHES[1], args.repeats),
    )


def paired_figures(
    args: argparse.Namespace, b1: DecodeProbe, b8: DecodeProbe, b32: DecodeProbe
) -> dict[str, float]:
    """The machine figures measured beside the probes' steps: read bandwidth (best sample, as
    `memory_bandwidth_gb_s`), the engine's linear kernels alone at batch 1 and 8 and the bare
    chain at batch 32 (medians, as `median_ms`)."""
    nbytes = ((args.bandwidth_mib << 20) // FP32_BYTES) * FP32_BYTES
    return {
        "bandwidth_paired_b1_gb_s": nbytes / min(b1.paired_s["bandwidth"]) / 1e9,
        "kernel_linear_b1_paired_ms": statistics.median(b1.paired_s["kernel_linear"]) * 1e3,
        "bandwidth_paired_b8_gb_s": nbytes / min(b8.paired_s["bandwidth"]) / 1e9,
        "kernel_linear_b8_paired_ms": statistics.median(b8.paired_s["kernel_linear"]) * 1e3,
        "bare_linear_b32_paired_ms": statistics.median(b32.paired_s["bare_linear"]) * 1e3,
    }


def roofline_ratios(
    roof: Roofline,
    model: ModelConfig,
    side: EngineSide,
    paired: dict[str, float],
) -> dict[str, float]:
    """roofline_b1 and linear_share_b32 divide by the figures measured beside the steps (the
    read bandwidth of a shared machine drifts within minutes, so a figure taken at another
    time would not describe the steps); flop_frac_b32 by the matmul peak.
    linear_roofline_b1 is the engine's linear kernels alone against the same bandwidth: what
    roofline_b1 would be if a step did nothing but its projections. The weight bytes are those
    the engine's layers store (fp32 panels, or the file's quantized blocks); batch 8 likewise."""
    b32 = side.b32
    ratios = {}
    token_kv_bytes = kv_bytes_per_token(model, resolve_kv_dtype(side.kv_dtype, torch.float32))
    for probe in (side.b1, side.b8):
        b = probe.batch
        kv_bytes = probe.batch * probe.mean_context * token_kv_bytes
        bandwidth = paired[f"bandwidth_paired_b{b}_gb_s"] * 1e9
        ideal_s = (side.weight_bytes + kv_bytes) / bandwidth
        linear_ms = paired[f"kernel_linear_b{b}_paired_ms"]
        ratios[f"roofline_b{b}"] = ideal_s * 1e3 / probe.step_ms
        ratios[f"linear_roofline_b{b}"] = side.weight_bytes / bandwidth * 1e3 / linear_ms
    b32_flops = 2 * roof.linear_params * b32.batch / (b32.step_ms / 1e3)
    return {
        **ratios,
        "linear_share_b32": paired["bare_linear_b32_paired_ms"] / b32.step_ms,
        "flop_frac_b32": b32_flops / (roof.matmul_gflop_s * 1e9),
    }


# ---- report ---------------------------------------------------------------------------------


def _verdict(value: float | None, target: float) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f} (target >= {target:g}: {'met' if value >= target else 'NOT met'})"


def print_report(summary: dict[str, Any]) -> None:
    """The run in words (the setting and machine, the measurements, the verdicts), then the
    summary as one JSON line."""
    s = summary
    print(
        f"workload W1: {s['num_requests']} requests, prompts {s['min_prompt']}..{s['max_prompt']}"
        f", outputs {s['min_output']}..{s['max_output']}, seed {s['seed']}, "
        f"threads {s['threads']}"
    )
    print(
        f"machine: read bandwidth {s['bandwidth_gb_s']:.1f} GB/s, "
        f"fp32 matmul {s['matmul_gflop_s']:.1f} GFLOP/s"
    )
    _print_measurements(s)
    print(f"ratio kvserve/hf = {_verdict(s['ratio'], TARGET_RATIO)}")
    print(f"roofline_b1 = {_verdict(s['roofline_b1'], TARGET_ROOFLINE_B1)}")
    print(f"roofline_b8 = {_verdict(s['roofline_b8'], TARGET_ROOFLINE_B1)}")
    print(
        f"linear_roofline_b1 = {s['linear_roofline_b1']:.3f} "
        "(the linear kernels alone: the ceiling of roofline_b1 with these kernels)"
    )
    print(f"linear_roofline_b8 = {s['linear_roofline_b8']:.3f}")
    print(f"linear_share_b32 = {_verdict(s['linear_share_b32'], TARGET_LINEAR_SHARE_B32)}")
    print(f"flop_frac_b32 = {s['flop_frac_b32']:.3f}")
    print(json.dumps(s, sort_keys=True))


def _print_measurements(s: dict[str, Any]) -> None:
    print(
        f"bare linear layers ({s['linear_params'] / 1e6:.1f}M params): "
        f"b1 {s['bare_linear_b1_ms']:.2f} ms, b32 {s['bare_linear_b32_ms']:.2f} ms"
    )
    print(
        f"engine decode step (--weights {s['weights']}: {s['weight_bytes'] / 1e6:.1f} MB of "
        "weights read a step): "
        f"b1 {s['engine_step_b1_ms']:.2f} ms, b8 {s['engine_step_b8_ms']:.2f} ms, "
        f"b32 {s['engine_step_b32_ms']:.2f} ms (context ~{s['probe_context']}); beside them: "
        f"bandwidth {s['bandwidth_paired_b1_gb_s']:.1f} GB/s, "
        f"the engine's linear kernels alone b1 {s['kernel_linear_b1_paired_ms']:.2f} ms, "
        f"b8 {s['kernel_linear_b8_paired_ms']:.2f} ms, "
        f"bare linear b32 {s['bare_linear_b32_paired_ms']:.2f} ms"
    )
    for b in PROBE_BATCHES:
        parts = [s[f"engine_{part}_b{b}_ms"] for part in cpu_decode_step.LayerSeconds._fields]
        if None not in parts:
            linear, attention, other = parts
            print(
                f"  b{b} step's layers (means): linear projections {linear:.2f} ms, attention "
                f"{attention:.2f} ms, RoPE / KV writes / norms / activations {other:.2f} ms"
            )
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (bars, scatter) = plt.subplots(1, 2, figsize=(11, 4.5))
    arms = {"kvserve": summary["kvserve_tok_s"], "hf": summary["hf_tok_s"]}
    arms = {name: v for name, v in arms.items() if v is not None}
    drawn = bars.bar(list(arms), list(arms.values()), color=["tab:blue", "tab:gray"][: len(arms)])
    bars.bar_label(drawn, fmt="%.1f")
    bars.set_ylabel("output tokens / s")
    bars.set_title(f"W1: {summary['num_requests']} requests, threads {summary['threads']}")
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
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def save_results(out_dir: Path, summary: dict[str, Any], steps: list[StepRecord]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"summary": summary, "steps": [asdict(r) for r in steps]}
    (out_dir / "engine.json").write_text(json.dumps(data, indent=1) + "\n")


# ---- the run --------------------------------------------------------------------------------


def _timed_phase(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    result = fn()
    print(f"[{label}: {time.perf_counter() - t0:.1f} s]", flush=True)
    return result


@dataclass(frozen=True)
class EngineSide:
    kvserve: ArmResult
    steps: list[StepRecord]
    b1: DecodeProbe
    b8: DecodeProbe
    b32: DecodeProbe
    weights: str  # --weights
    weight_bytes: int  # read per decode step by the engine's linear layers
    kv_dtype: str = "auto"  # --kv-dtype


def measure_engine(
    model_path: Path,
    weights: LoadedWeights,
    requests: list[BenchRequest],
    chain: LinearChain,
    args: argparse.Namespace,
) -> EngineSide:
    """Arm 1, then the decode probes on the same (by then idle) engine, each step paired with
    the machine figures it is divided by: a bandwidth sample and the engine's linear kernels
    alone (batch 1), the bare linear chain at the same batch (batch 32)."""
    engine = Engine(engine_config(model_path, requests, args, weights.config), weights=weights)
    with kv_event_drain(engine, args.kv_events) as events:
        kv, steps = _timed_phase("kvserve arm", functools.partial(run_kvserve, engine, requests))
    if args.kv_events:
        print(f"KV events: {events['events']} encoded, {events['bytes']} bytes", flush=True)
    ones = torch.ones((args.bandwidth_mib << 20) // FP32_BYTES)
    kernels = KernelChain.of_model(engine.runner.model)
    hidden = chain.weights[0].shape[1]
    pairs: dict[int, dict[str, Callable[[], object]]] = {
        b: {
            "bandwidth": ones.sum,
            "kernel_linear": functools.partial(kernels.forward, torch.randn(b, hidden)),
        }
        for b in PROBE_BATCHES[:2]
    }
    pairs[PROBE_BATCHES[2]] = {
        "bare_linear": functools.partial(chain.forward, torch.randn(32, hidden))
    }
    b1, b8, b32 = (
        _timed_phase(
            f"decode probe b{b}",
            functools.partial(
                decode_step,
                engine,
                b,
                args.probe_context,
                args.probe_steps,
                args.seed + b,
                pairs[b],
            ),
        )
        for b in PROBE_BATCHES
    )
    return EngineSide(kv, steps, b1, b8, b32, args.weights, kernels.weight_bytes, args.kv_dtype)


def run(args: argparse.Namespace) -> int:
    spec = WorkloadSpec.from_args(args)
    if min(args.hf_batch_size, args.threads, args.probe_steps, args.repeats) < 1:
        raise CliError("--hf-batch-size, --threads, --probe-steps and --repeats must be >= 1")
    torch.set_num_threads(args.threads)
    model_path = Path(args.model) if args.model else default_model_path()
    try:  # the formats the engine would keep with these settings
        keep = kept_formats(EngineConfig(model_path=str(model_path), weights=args.weights))
    except ValueError as e:
        raise CliError(str(e)) from e
    load = functools.partial(load_weights, model_path, torch.float32, keep)
    weights = _timed_phase("load weights", load)
    model: ModelConfig = weights.config
    requests = make_requests(spec, model.vocab_size)
    chain = LinearChain(llama_linear_shapes(model))  # the bare chain, before W1 and beside b32
    roof = _timed_phase("machine", functools.partial(measure_roofline, chain, args))
    side = measure_engine(model_path, weights, requests, chain, args)
    del chain, weights  # the engine is gone; let the HF arm have the memory
    gc.collect()
    hf = None
    if not args.skip_hf:
        run_arm = functools.partial(run_hf, model_path, requests, args.hf_batch_size)
        hf = _timed_phase("hf arm", run_arm)
    summary = build_summary(spec, args, roof, model, side, hf)
    if args.plot:
        save_plot(Path(args.plot), summary, side.steps)
    save_results(Path(args.out), summary, side.steps)
    print_report(summary)
    return 0


def layer_parts(side: EngineSide) -> dict[str, float | None]:
    """Per probe, the layers' C++ call by part (means over its steps; None without it)."""
    parts: dict[str, float | None] = {}
    for probe in (side.b1, side.b8, side.b32):
        for part in cpu_decode_step.LayerSeconds._fields:
            ms = getattr(probe.layers_ms, part) if probe.layers_ms else None
            parts[f"engine_{part}_b{probe.batch}_ms"] = ms
    return parts


def build_summary(
    spec: WorkloadSpec,
    args: argparse.Namespace,
    roof: Roofline,
    model: ModelConfig,
    side: EngineSide,
    hf: ArmResult | None,
) -> dict[str, Any]:
    kv, b1, b8, b32 = side.kvserve, side.b1, side.b8, side.b32
    ratio = kv.tok_s / hf.tok_s if hf else None
    paired = paired_figures(args, b1, b8, b32)
    return {
        **asdict(spec),
        "hf_batch_size": args.hf_batch_size,
        "threads": args.threads,
        "probe_context": args.probe_context,
        "probe_steps": args.probe_steps,
        "kvserve_tok_s": kv.tok_s,
        "kvserve_wall_s": kv.wall_s,
        "kvserve_tokens": kv.useful_tokens,
        "kvserve_steps": len(side.steps),
        "hf_tok_s": hf.tok_s if hf else None,
        "hf_wall_s": hf.wall_s if hf else None,
        "hf_useful_tokens": hf.useful_tokens if hf else None,
        "hf_generated_tokens": hf.generated_tokens if hf else None,
        "ratio": ratio,
        "ratio_met": ratio >= TARGET_RATIO if ratio is not None else None,
        **asdict(roof),
        "weights": side.weights,
        "kv_dtype": side.kv_dtype,
        "weight_bytes": side.weight_bytes,
        "engine_step_b1_ms": b1.step_ms,
        "engine_step_b8_ms": b8.step_ms,
        "engine_step_b32_ms": b32.step_ms,
        "engine_context_b1": b1.mean_context,
        "engine_context_b8": b8.mean_context,
        "engine_context_b32": b32.mean_context,
        **layer_parts(side),
        **paired,
        **roofline_ratios(roof, model, side, paired),
    }
