"""The engine's command-line options, shared by `kvserve serve`, `prefill`, `decode` and
`bench profile`: the flags, their checks, and the EngineConfig they make. torch is imported only
when an engine is loaded."""

from __future__ import annotations

import argparse
from typing import Any

from kvserve.services.cli_support import CliError, check_at_least_one
from kvserve.shared.config import (
    KV_DTYPES,
    MATMUL_DTYPES,
    MAX_SPECULATIVE_TOKENS,
    MODEL_DTYPES,
    POPULATE_MODES,
    SIM_PAYLOADS,
    SPECULATIVE_METHODS,
    WEIGHT_MODES,
    SpeculativeConfig,
    StoreConfig,
)

# --attention-backend's choices (EngineConfig.attention_backend)
ATTENTION_BACKENDS = ("auto", "torch", "cpu", "triton")


def add_kernel_arguments(p: argparse.ArgumentParser) -> None:
    """--kv-dtype and --attention-backend: the kernels' choices, offered by every command that
    runs the engine (`generate` as well)."""
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The engine options `serve`, `prefill` and `decode` share."""
    p.add_argument("--num-blocks", type=int, default=None, help="KV-cache blocks")
    p.add_argument("--block-size", type=int, default=16)
    add_kernel_arguments(p)
    p.add_argument(
        "--kv-populate",
        choices=POPULATE_MODES,
        default="background",
        help="when the KV cache's memory becomes resident: before the engine serves (eager), "
        "while it serves (background), or as blocks are written (lazy)",
    )
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=MODEL_DTYPES, default="float32")
    p.add_argument(
        "--matmul-dtype",
        choices=MATMUL_DTYPES,
        default="auto",
        help="dtype of the linear layers' matmuls alone (auto: --dtype); bfloat16 with "
        "--dtype float32 uses the CPU's bf16 instructions, the KV cache stays float32",
    )
    p.add_argument(
        "--weights",
        choices=WEIGHT_MODES,
        default="auto",
        help="the linear layers' weights: the GGUF file's own quantized blocks (file; auto: "
        "where a kernel serves them, else fp32), expanded to --dtype (fp32), or expanded with "
        "bfloat16 matmuls (bf16)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for the engine's compute (default: one per core)",
    )
    p.add_argument(
        "--quarantine-after",
        type=int,
        default=2,
        metavar="K",
        help="fail a request instead of running it again once K of its runs failed (steps "
        "of this engine that failed as a whole, or in a fleet workers that died running it)",
    )
    p.add_argument(
        "--host-tier-mb",
        type=int,
        default=StoreConfig.host_tier_bytes >> 20,
        help="the host-RAM tier (blocks evicted from the device cache, kept for reuse), MiB",
    )
    add_fault_injection_argument(p)
    add_speculative_arguments(p)
    add_async_scheduling_argument(p)
    p.add_argument("--log-level", default=None)


def add_async_scheduling_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="make a step's outputs (text, deltas, their delivery) while the next step's model "
        "call runs (default: on)",
    )


# The speculative decoding options: (dest, flag); their defaults are SpeculativeConfig's.
SPECULATIVE_OPTIONS = (
    ("num_speculative_tokens", "--num-speculative-tokens"),
    ("prompt_lookup_max", "--prompt-lookup-max"),
    ("prompt_lookup_min", "--prompt-lookup-min"),
)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    """Speculative decoding by n-gram lookup (vLLM's option names), off by default."""
    d = SpeculativeConfig()
    g = p.add_argument_group("speculative decoding")
    g.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default=None,
        help="draft tokens by n-gram lookup in the sequence's own tokens (no draft model), "
        "verified in one forward pass; default: off",
    )
    g.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=None,
        metavar="K",
        help=f"drafts per sequence and step, 1..{MAX_SPECULATIVE_TOKENS} "
        f"(default {d.num_speculative_tokens})",
    )
    g.add_argument(
        "--prompt-lookup-max",
        type=int,
        default=None,
        metavar="N",
        help=f"the longest n-gram looked up (default {d.prompt_lookup_max})",
    )
    g.add_argument(
        "--prompt-lookup-min",
        type=int,
        default=None,
        metavar="N",
        help=f"the shortest n-gram looked up (default {d.prompt_lookup_min}, or the longest's "
        "length when that is shorter)",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig of --speculative and its options (None: off); CliError, naming
    the flag, for a value or combination that cannot run."""
    method = getattr(args, "speculative", None)
    given = [(dest, flag) for dest, flag in SPECULATIVE_OPTIONS if getattr(args, dest) is not None]
    if method is None:
        if given:
            raise CliError(f"{given[0][1]} needs --speculative ngram")
        return None
    if getattr(args, "simulate", None) is not None:
        raise CliError("--speculative needs the real model: it does not run with --simulate")
    k = args.num_speculative_tokens
    if k is not None and not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise CliError(f"--num-speculative-tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, got {k}")
    check_at_least_one(args, ("prompt_lookup_max", "prompt_lookup_min"))
    options = {dest: getattr(args, dest) for dest, _ in given}
    hi = options.get("prompt_lookup_max", SpeculativeConfig.prompt_lookup_max)
    if "prompt_lookup_min" not in options:  # the default, down to a shorter longest n-gram
        options["prompt_lookup_min"] = min(SpeculativeConfig.prompt_lookup_min, hi)
    lo = options["prompt_lookup_min"]
    if lo > hi:
        raise CliError(f"--prompt-lookup-min ({lo}) must be <= --prompt-lookup-max ({hi})")
    return SpeculativeConfig(method, **options)


def speculative_flags(args: argparse.Namespace) -> list[str]:
    """The speculative decoding options as given, for a worker's command line."""
    if getattr(args, "speculative", None) is None:
        return []
    out = ["--speculative", args.speculative]
    for dest, flag in SPECULATIVE_OPTIONS:
        if getattr(args, dest) is not None:
            out += [flag, str(getattr(args, dest))]
    return out


def add_fault_injection_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--enable-fault-injection",
        action="store_true",
        help="accept requests that ask for a fault (`kvserve_fault`): tests and chaos runs only",
    )


def add_sim_arguments(p: argparse.ArgumentParser) -> None:
    """A simulated engine's options (DESIGN.md section 2.2)."""
    g = p.add_argument_group("simulation")
    g.add_argument(
        "--simulate",
        metavar="PROFILE",
        default=None,
        help="simulate the engine: the forward pass replaced by the time the cost profile gives "
        "(gpu: a published GPU profile; cpu: this machine's `kvserve bench calibrate`; or a "
        "file); KV capacity and scheduler limits come from the profile, the tokenizer from "
        "--model",
    )
    g.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="a simulated engine runs this many times slower than modelled (to fit many on "
        "few cores)",
    )
    g.add_argument(
        "--sim-payload",
        choices=SIM_PAYLOADS,
        default="auto",
        help="the KV cache in the modelled model's true geometry (true) or a small one with "
        "modelled store transfers (small); auto: true when it fits in 4 GiB",
    )


def check_engine_arguments(args: argparse.Namespace) -> None:
    """Refuse bad engine options before anything starts (logging included)."""
    from kvserve.shared.config import EngineConfig

    check_at_least_one(
        args, ("block_size", "max_num_seqs", "num_blocks", "threads", "quarantine_after")
    )
    if args.host_tier_mb < 0:
        raise CliError("--host-tier-mb must be >= 0")
    try:
        EngineConfig(dtype=args.dtype, matmul_dtype=args.matmul_dtype, weights=args.weights)
    except ValueError as e:
        raise CliError(str(e)) from e
    check_sim_arguments(args)
    speculative_config(args)


def check_sim_arguments(args: argparse.Namespace) -> None:
    """A profile that cannot be used, or a bad time scale, is a one-line error."""
    from kvserve.shared.engine.sim.profile import CostProfile, ProfileError

    if getattr(args, "simulate", None) is None:
        return
    if not 0 < args.time_scale < float("inf"):
        raise CliError(f"--time-scale must be a positive number, got {args.time_scale}")
    try:
        CostProfile.load(args.simulate)
    except ProfileError as e:
        raise CliError(str(e)) from None


def sim_config(args: argparse.Namespace) -> Any:
    """The SimConfig of --simulate, --time-scale and --sim-payload (None: a real engine)."""
    from kvserve.shared.config import SimConfig

    if getattr(args, "simulate", None) is None:
        return None
    return SimConfig(args.simulate, time_scale=args.time_scale, payload=args.sim_payload)


def engine_config(args: argparse.Namespace) -> Any:
    """The EngineConfig the options describe (with --model, --store and --store-format);
    CliError for a combination the config refuses."""
    from kvserve.shared.config import (
        CacheConfig,
        EngineConfig,
        FaultConfig,
        SchedulerConfig,
        StoreConfig,
    )

    store = None if args.store == "none" else args.store
    try:
        return EngineConfig(
            model_path=args.model,
            dtype=args.dtype,
            matmul_dtype=args.matmul_dtype,
            weights=args.weights,
            device=args.device,
            attention_backend=args.attention_backend,
            # a simulated engine computes nothing: one thread unless told otherwise
            num_threads=args.threads or (1 if getattr(args, "simulate", None) else None),
            cache=CacheConfig(
                block_size=args.block_size,
                num_blocks=args.num_blocks,
                kv_dtype=args.kv_dtype,
                enable_prefix_caching=not args.no_prefix_caching,
                populate=args.kv_populate,
            ),
            scheduler=SchedulerConfig(
                max_num_batched_tokens=args.max_num_batched_tokens,
                max_num_seqs=args.max_num_seqs,
            ),
            store=StoreConfig(
                url=store, format=args.store_format, host_tier_bytes=args.host_tier_mb << 20
            ),
            simulate=sim_config(args),
            faults=FaultConfig(
                quarantine_after=args.quarantine_after, injection=args.enable_fault_injection
            ),
            speculative=speculative_config(args),
            async_scheduling=args.async_scheduling,
        )
    except ValueError as e:
        raise CliError(str(e)) from e


def load_engine(config: Any, tokenizer: Any = None) -> Any:
    """An AsyncEngine over a new Engine, loaded on the engine's own thread (blocking: loads the
    model; run it in a thread)."""
    from kvserve.shared.engine.async_engine import AsyncEngine
    from kvserve.shared.engine.engine import Engine

    return AsyncEngine.build(lambda: Engine(config, tokenizer=tokenizer))
