"""`kvserve bench engine`: kvserve's Engine against Hugging Face transformers on the same fp32
weights, and against what this machine can do.

Workload W1: N requests (default 128), prompt lengths uniform in 32..512 tokens, output lengths
uniform in 16..256 (EOS ignored), all submitted at once. Prompt token ids are drawn uniformly
from the vocabulary above its special ids (workloads/tokens.py) with a fixed seed; both arms get
the same ids.

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

`--device cuda`: both arms run on the GPU (the same fp32 weights; each timed region ends with a
torch.cuda.synchronize), and so do the decode probes. The machine figures, the figures paired
with the probes, the ratios that divide by them, the layers' C++ call by part and `--threads`
describe the CPU: they are not measured and are reported as absent (None, "-").
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar

import torch
from kvserve.kernels import cpu_decode_step
from kvserve.services.bench.engine_report import (
    TARGET_RATIO,
    print_report,
    save_plot,
    save_results,
)
from kvserve.services.bench.lib.decode_probe import (
    PROBE_BATCHES,
    DecodeProbe,
    Paired,
    decode_step,
    probe_max_tokens,
)
from kvserve.services.bench.lib.engine_timing import (
    ArmResult,
    StepRecord,
    synchronizer,
    timed_steps,
)
from kvserve.services.bench.lib.flags import add_model, add_seed, add_sizes
from kvserve.services.bench.lib.hf_generate import run_hf
from kvserve.services.bench.lib.machine import (
    FP32_BYTES,
    KernelChain,
    LinearChain,
    llama_linear_shapes,
)
from kvserve.services.bench.lib.roofline import (
    EngineSide,
    Roofline,
    absent_figures,
    measure_roofline,
    paired_figures,
    roofline_ratios,
)
from kvserve.services.bench.workloads.batch import BenchRequest, WorkloadSpec, make_requests
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
from kvserve.shared.engine.startup import kept_formats
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.sampling_params import SamplingParams

T = TypeVar("T")


def _default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def on_cpu(args: argparse.Namespace) -> bool:
    return torch.device(args.device).type == "cpu"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p, resolved=False)
    add_sizes(p, {"num-requests": 128, "min-prompt": 32, "max-prompt": 512, "min-output": 16,
                  "max-output": 256})  # fmt: skip
    add_seed(p)
    p.add_argument("--hf-batch-size", type=int, default=16)
    p.add_argument("--skip-hf", action="store_true", help="run only the kvserve arm")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, cuda or cuda:N: both arms and the decode probes run there; off the CPU the "
        "machine figures, the ratios to them and --threads are skipped",
    )
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


# ---- arm 1: kvserve -------------------------------------------------------------------------


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
        device=args.device,
        num_threads=args.threads if on_cpu(args) else None,
    )


def run_kvserve(engine: Engine, requests: list[BenchRequest]) -> tuple[ArmResult, list[StepRecord]]:
    """All requests submitted at once, stepped to completion; wall time includes submission."""
    engine.generate([requests[0].prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))
    sync = synchronizer(engine.config.device)
    sync()
    generated = 0
    with timed_steps(engine, sync) as steps:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(max_tokens=r.output_len, ignore_eos=True)
            engine.add_request(f"w1-{i}", r.prompt, params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                generated += sum(len(c.token_ids) for c in out.completions)
        sync()
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


# ---- the run --------------------------------------------------------------------------------


def _timed_phase(label: str, fn: Callable[[], T]) -> T:
    t0 = time.perf_counter()
    result = fn()
    print(f"[{label}: {time.perf_counter() - t0:.1f} s]", flush=True)
    return result


def _pairs(
    engine: Engine, chain: LinearChain, args: argparse.Namespace
) -> tuple[KernelChain, dict[int, Paired]]:
    """The engine's own linear kernels, and by probe batch the measurements paired with each
    step: a bandwidth sample and those kernels alone (batch 1 and 8), the bare chain (32)."""
    ones = torch.ones((args.bandwidth_mib << 20) // FP32_BYTES)
    kernels = KernelChain.of_model(engine.model_runner.model)
    hidden = chain.weights[0].shape[1]
    pairs: dict[int, Paired] = {
        b: {
            "bandwidth": ones.sum,
            "kernel_linear": functools.partial(kernels.forward, torch.randn(b, hidden)),
        }
        for b in PROBE_BATCHES[:2]
    }
    pairs[PROBE_BATCHES[2]] = {
        "bare_linear": functools.partial(chain.forward, torch.randn(32, hidden))
    }
    return kernels, pairs


def _probe(engine: Engine, batch: int, args: argparse.Namespace, paired: Paired) -> DecodeProbe:
    seed = args.seed + batch
    return decode_step(engine, batch, args.probe_context, args.probe_steps, seed, paired)


def measure_engine(
    model_path: Path,
    weights: LoadedWeights,
    requests: list[BenchRequest],
    chain: LinearChain | None,
    args: argparse.Namespace,
) -> EngineSide:
    """Arm 1, then the decode probes on the same (by then idle) engine, each step paired with
    the machine figures it is divided by: a bandwidth sample and the engine's linear kernels
    alone (batch 1), the bare linear chain at the same batch (batch 32). Without `chain` (off
    the CPU) the steps are paired with nothing."""
    engine = Engine(engine_config(model_path, requests, args, weights.config), weights=weights)
    with kv_event_drain(engine, args.kv_events) as events:
        kv, steps = _timed_phase("kvserve arm", functools.partial(run_kvserve, engine, requests))
    if args.kv_events:
        print(f"KV events: {events['events']} encoded, {events['bytes']} bytes", flush=True)
    if chain is not None:
        kernels, pairs = _pairs(engine, chain, args)
    else:
        kernels = KernelChain.of_model(engine.model_runner.model)  # for its weight bytes
        pairs = {b: {} for b in PROBE_BATCHES}
    b1, b8, b32 = (
        _timed_phase(f"decode probe b{b}", functools.partial(_probe, engine, b, args, pairs[b]))
        for b in PROBE_BATCHES
    )
    return EngineSide(kv, steps, b1, b8, b32, args.weights, kernels.weight_bytes, args.kv_dtype)


def _check_device(name: str) -> str:
    """`--device` as torch names it ("cpu" for any CPU); CliError unless it is the CPU or a
    CUDA device this machine has."""
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise CliError(f"--device must be cpu or cuda[:N], got {name!r}") from e
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise CliError(f"--device must be cpu or cuda[:N], got {name!r}")
    if not torch.cuda.is_available():
        raise CliError(f"--device {name}: CUDA is not available here")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise CliError(f"--device {name}: this machine has {torch.cuda.device_count()} GPUs")
    return str(device)


def _check(args: argparse.Namespace) -> tuple[WorkloadSpec, Path, frozenset[str]]:
    """The workload, the model and the formats the engine would keep; CliError on bad ones.
    `args.device` becomes torch's name for it."""
    spec = WorkloadSpec.from_args(args)
    if min(args.hf_batch_size, args.threads, args.probe_steps, args.repeats) < 1:
        raise CliError("--hf-batch-size, --threads, --probe-steps and --repeats must be >= 1")
    args.device = _check_device(args.device)
    if args.weights == "file" and not on_cpu(args):
        raise CliError("--weights file: the file's blocks run on the CPU only")
    model_path = Path(args.model) if args.model else default_model_path()
    try:  # the formats the engine would keep with these settings
        config = EngineConfig(model_path=str(model_path), weights=args.weights, device=args.device)
        keep = kept_formats(config)
    except ValueError as e:
        raise CliError(str(e)) from e
    return spec, model_path, keep


def run(args: argparse.Namespace) -> int:
    spec, model_path, keep = _check(args)
    cpu = on_cpu(args)
    if cpu:
        torch.set_num_threads(args.threads)
    load = functools.partial(load_weights, model_path, torch.float32, keep)
    weights = _timed_phase("load weights", load)
    model: ModelConfig = weights.config
    requests = make_requests(spec, model.vocab_size)
    chain, roof = None, None  # the machine's figures: CPU measurements
    if cpu:
        chain = LinearChain(llama_linear_shapes(model))  # the bare chain, before W1, beside b32
        roof = _timed_phase("machine", functools.partial(measure_roofline, chain, args))
    side = measure_engine(model_path, weights, requests, chain, args)
    del chain, weights  # the engine is gone; let the HF arm have the memory
    gc.collect()
    if torch.device(args.device).type == "cuda":
        torch.cuda.empty_cache()
    hf = None
    if not args.skip_hf:
        run_arm = functools.partial(run_hf, model_path, requests, args.hf_batch_size, args.device)
        hf = _timed_phase("hf arm", run_arm)
    summary = build_summary(spec, args, roof, model, side, hf)
    if args.plot:
        save_plot(Path(args.plot), summary, side.steps)
    save_results(Path(args.out), summary, side.steps)
    print_report(summary)
    return 0


# ---- the summary ----------------------------------------------------------------------------


def layer_parts(side: EngineSide) -> dict[str, float | None]:
    """Per probe, the layers' C++ call by part, the LM head and the rest of the step (host
    work), means over its steps; None without the C++ call."""
    parts: dict[str, float | None] = {}
    for probe in side.probes:
        for part in cpu_decode_step.LayerSeconds._fields:
            ms = getattr(probe.layers_ms, part) if probe.layers_ms else None
            parts[f"engine_{part}_b{probe.batch}_ms"] = ms
        parts[f"engine_lm_head_b{probe.batch}_ms"] = probe.lm_head_ms
        parts[f"engine_host_b{probe.batch}_ms"] = probe.host_ms
    return parts


def _arms(args: argparse.Namespace, side: EngineSide, hf: ArmResult | None) -> dict[str, Any]:
    kv = side.kvserve
    ratio = kv.tok_s / hf.tok_s if hf else None
    device = {} if on_cpu(args) else {"device": args.device}  # on the CPU as before the option
    return {
        **device,
        "hf_batch_size": args.hf_batch_size,
        "threads": args.threads if on_cpu(args) else None,
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
    }


def _probes(side: EngineSide) -> dict[str, Any]:
    steps = {f"engine_step_b{p.batch}_ms": p.step_ms for p in side.probes}
    contexts = {f"engine_context_b{p.batch}": p.mean_context for p in side.probes}
    return {"weights": side.weights, "kv_dtype": side.kv_dtype,
            "weight_bytes": side.weight_bytes, **steps, **contexts}  # fmt: skip


def build_summary(
    spec: WorkloadSpec,
    args: argparse.Namespace,
    roof: Roofline | None,
    model: ModelConfig,
    side: EngineSide,
    hf: ArmResult | None,
) -> dict[str, Any]:
    """Every number of the run, keyed as engine.json and the last stdout line have them;
    without `roof` (off the CPU) the machine figures and what divides by them are None."""
    if roof is None:
        return {
            **asdict(spec),
            **_arms(args, side, hf),
            **absent_figures(model),
            **_probes(side),
            **layer_parts(side),
        }
    paired = paired_figures(args, side.b1, side.b8, side.b32)
    return {
        **asdict(spec),
        **_arms(args, side, hf),
        **asdict(roof),
        **_probes(side),
        **layer_parts(side),
        **paired,
        **roofline_ratios(roof, model, side, paired),
    }
