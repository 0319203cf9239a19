"""`kvserve generate PROMPT`: run the engine in-process and stream the generated text to stdout
(timings to stderr). Applies the model's chat template unless --raw."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING

from kvserve.services.cli_support import CliError
from kvserve.services.engine_options import (
    add_kernel_arguments,
    add_speculative_arguments,
    speculative_config,
)
from kvserve.shared.config import (
    DEFAULT_STORE,
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    StoreConfig,
    default_model_path,
)

if TYPE_CHECKING:
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.sampling_params import SamplingParams

# The sampling options, each named for the SamplingParams field it sets (so an error's `param`
# names its option); --stop, repeatable, sets `stop`.
SAMPLING_OPTIONS = (
    "max_tokens", "temperature", "top_p", "top_k", "seed", "beam_width", "length_penalty"
)  # fmt: skip


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate a completion for one prompt")
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--beam-width", type=int, default=1, help="beam search with K beams")
    p.add_argument("--length-penalty", type=float, default=1.0)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--raw", action="store_true", help="send the prompt as is, no chat template")
    p.add_argument("--model", default=str(default_model_path()), help="GGUF file or HF dir")
    add_kernel_arguments(p)
    p.add_argument(
        "--store",
        default="none",
        metavar="URL",
        help="prefix store: memory://, file:///dir, redis://host:port/db, redis+cluster://..., "
        "'default' (disk tier under the cache directory) or 'none' (the default here)",
    )
    p.add_argument("--store-format", choices=STORE_FORMATS, default="auto")
    add_speculative_arguments(p)
    p.add_argument(
        "--timings",
        action="store_true",
        help="print where start-up time went, as one JSON line on stderr (bench startup)",
    )
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    started_at = time.time()
    t0 = time.perf_counter()
    from kvserve.shared.engine.engine import Engine

    if not args.prompt:
        raise CliError("prompt must not be empty")
    params = _sampling_params(args)
    store = _store_url(args.store)
    speculative = speculative_config(args)
    imports_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = Engine(
        EngineConfig(
            model_path=args.model,
            cache=CacheConfig(kv_dtype=args.kv_dtype, populate="lazy"),
            store=StoreConfig(url=store, format=args.store_format),
            attention_backend=args.attention_backend,
            speculative=speculative,
        )
    )
    load_s = time.perf_counter() - t0
    with engine:
        ttft, total = _generate(engine, args, params, load_s)
    if args.timings:
        timings = {
            "handler_at": started_at,
            "imports_s": imports_s,
            "engine_s": {**engine.startup_s, "total": load_s},
            "first_step_s": ttft,
            "rest_s": total - ttft,
            "done_at": time.time(),
        }
        print(json.dumps({"timings": timings}), file=sys.stderr)
    return 0


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    from kvserve.shared.sampling_params import InvalidRequestError, SamplingParams

    fields = {name: getattr(args, name) for name in SAMPLING_OPTIONS}
    try:
        return SamplingParams(**fields, stop=tuple(args.stop))
    except InvalidRequestError as e:
        raise CliError(f"--{e.param.replace('_', '-')}: {e}") from e


def _store_url(url: str) -> str | None:
    """--store as the engine takes it (None: no store); CliError for a URL it cannot open."""
    from kvserve.shared.store.backends import check_store_url

    store = None if url == "none" else url
    if store is not None and store != DEFAULT_STORE:
        try:
            check_store_url(store)
        except ValueError as e:
            raise CliError(f"--store: {e}") from e
    return store


def _generate(
    engine: Engine, args: argparse.Namespace, params: SamplingParams, load_s: float
) -> tuple[float, float]:
    """Stream the completion to stdout; (seconds to the first token, seconds in all)."""
    from kvserve.shared.sampling_params import InvalidRequestError

    tok = engine.tokenizer
    ids = (
        tok.encode(args.prompt)
        if args.raw
        else tok.encode_chat([{"role": "user", "content": args.prompt}])
    )
    try:
        engine.add_request("cli", ids, params)
    except InvalidRequestError as e:
        raise CliError(f"{e.param}: {e}") from e
    t1 = time.perf_counter()
    first: float | None = None
    n_out = cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            cached = out.num_cached_tokens
            for d in out.completions:
                if d.token_ids and first is None:
                    first = time.perf_counter() - t1
                n_out += len(d.token_ids)
                sys.stdout.write(d.text)
                sys.stdout.flush()
    total = time.perf_counter() - t1
    sys.stdout.write("\n")
    spec = engine.spec_decode_stats
    drafts = (
        f", drafts accepted {spec['num_accepted_tokens']}/{spec['num_draft_tokens']}"
        if engine.config.speculative is not None
        else ""
    )
    print(
        f"[load {load_s:.2f}s, prompt {len(ids)} tokens ({cached} cached), "
        f"ttft {first or 0:.3f}s, "
        f"{n_out} tokens in {total:.2f}s, {n_out / total if total else 0:.1f} tok/s{drafts}]",
        file=sys.stderr,
    )
    return first or 0.0, total
