"""`kvserve bench store`: the prefix store's formats, cross-instance reuse through Redis, and the
store's raw throughput.

- formats: stored bytes per token and quality for each store format against raw fp16, measured
  on the model's real K/V by `store_quality.format_quality` (every earlier block of a text or a
  greedy continuation has made the round trip through the codec): mean KLD of the next-token
  distributions over --text-tokens of prose, teacher-forced greedy agreement over --num-prompts
  chat prompts x --gen-tokens reference tokens.
- ttft: engine A computes a --prefix-tokens prefix and publishes it to Redis (--format); then,
  per repeat, a fresh engine B with an empty device cache answers prefix + a new question,
  loading the prefix from Redis, and a fresh engine B' without a store answers the same request
  by recomputing, then a prefix + another question from its device cache (the device hit).
  Both B and B' serve one short warm-up request first. TTFT medians, the speedup, store /
  device, and B's breakdown: `contains` round trip, the pipelined load (gets, verification,
  decompression, dequantization; `decode_cpu_s` sums the worker threads' time), copy into the
  cache.
- throughput: put_many / get_many of --blocks real blocks (encoded in --format) against the
  Redis at --redis, batches of --batch: blocks/s and MB/s.
- breakeven: TTFT loading a cached prefix from Redis against recomputing it, and what the cost
  rule chose, over --breakeven-lengths and --breakeven-formats (store_breakeven.py).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.services.bench.lib.flags import add_model, add_sizes
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    StoreConfig,
)

PARTS = ("formats", "ttft", "throughput", "breakeven")
SIZES = {"prefix-tokens": 2048, "repeats": 3, "text-tokens": 1024, "gen-tokens": 128,
         "num-prompts": 8, "blocks": 256, "batch": 32}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    p.add_argument("--formats", default="fp16,bf16,int8,fp8,compact")
    p.add_argument("--format", default="native", help="store format for ttft and throughput")
    add_sizes(p, SIZES)
    p.add_argument("--plot", type=Path, default=None, help="PNG: formats and TTFT panels")
    p.add_argument("--breakeven-formats", default="native,int8", help="breakeven: formats")
    p.add_argument(
        "--breakeven-lengths",
        default="16,64,256,1024,2048,4096",
        help="breakeven: cached-prefix lengths in tokens",
    )
    p.add_argument("--breakeven-plot", type=Path, default=None, help="PNG: the breakeven curves")


def _check(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise CliError(f"--parts: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    formats = [x for x in args.formats.split(",") if x]
    codec_formats = [f for f in STORE_FORMATS if f != "auto"]
    wrong = [f for f in [*formats, args.format] if f not in codec_formats]
    breakeven = [x for x in args.breakeven_formats.split(",") if x]
    wrong += [f for f in breakeven if f not in codec_formats]
    if wrong or not breakeven:
        raise CliError(f"--formats/--format/--breakeven-formats: unknown {wrong}; choose from "
                       f"{codec_formats}")  # fmt: skip
    lengths = args.breakeven_lengths.split(",")
    if not all(x.isdigit() and 16 <= int(x) <= 8192 for x in lengths):
        raise CliError("--breakeven-lengths: comma-separated token counts in 16..8192")
    if args.prefix_tokens < 64 or args.repeats < 1 or args.blocks < 1 or args.batch < 1:
        raise CliError("--prefix-tokens >= 64, --repeats, --blocks and --batch >= 1")
    return parts, formats


def engine_factory(args: argparse.Namespace) -> Callable[..., Any]:
    """make(store=None, num_blocks=512): a fresh engine on one loaded copy of the weights."""
    import torch
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.model.loader import load_weights
    from kvserve.shared.model.tokenizer import KVTokenizer

    weights = load_weights(args.model, torch.float32)
    tokenizer = KVTokenizer.from_path(args.model)

    def make(store: StoreConfig | None = None, num_blocks: int = 512) -> Engine:
        cfg = EngineConfig(
            model_path=args.model,
            cache=CacheConfig(num_blocks=num_blocks, populate="eager"),
            store=store or StoreConfig(),
        )
        return Engine(cfg, tokenizer=tokenizer, weights=weights)

    return make


def run(args: argparse.Namespace) -> int:
    parts, formats = _check(args)
    make = engine_factory(args)
    result: dict[str, Any] = {}
    if "formats" in parts:
        result.update(_formats(make(), formats, args))
    if "ttft" in parts:
        from kvserve.services.bench.store_ttft import cross_instance_ttft

        result.update(cross_instance_ttft(make, args))
    if "throughput" in parts:
        from kvserve.services.bench.store_throughput import throughput

        result.update(throughput(make(), args))
    if "breakeven" in parts:
        from kvserve.services.bench import store_breakeven

        result.update(store_breakeven.run(make, args))
        if args.breakeven_plot:
            store_breakeven.save_plot(args.breakeven_plot, result["breakeven"])
    if args.plot is not None and set(parts) - {"breakeven"}:
        save_plot(args.plot, result)
    print(json.dumps(result))
    return 0


# ---- formats ---------------------------------------------------------------------------------


def _formats(engine: Any, formats: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.services.bench.lib.store_quality import (
        format_quality,
        raw_fp16_bytes_per_token,
        reference_greedy,
    )
    from kvserve.services.bench.workloads.text import chat_prompts, reference_text

    text = reference_text(engine.tokenizer, args.text_tokens)
    prompts = chat_prompts(engine.tokenizer, args.num_prompts)
    refs = reference_greedy(engine, prompts, args.gen_tokens)
    fp16 = raw_fp16_bytes_per_token(engine)
    rows: dict[str, dict[str, float]] = {}
    print(f"raw fp16: {fp16} B/token")
    print(f"{'format':>8} {'B/token':>9} {'vs fp16':>8} {'KLD':>9} {'agree':>7} enc/dec ms")
    for fmt in formats:
        q = format_quality(engine, fmt, text, prompts, refs)
        rows[fmt] = q
        print(
            f"{fmt:>8} {q['bytes_per_token']:>9.0f} {q['ratio_vs_fp16']:>8.3f} {q['kld']:>9.5f} "
            f"{q['agree']:>7.4f} {q.get('encode_ms', 0):.2f}/{q.get('decode_ms', 0):.2f}",
            flush=True,
        )
    return _formats_summary(fp16, rows)


def _formats_summary(fp16: int, rows: dict[str, dict[str, float]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "raw_fp16_bytes_per_token": fp16,
        "bytes_per_token": {f: r["bytes_per_token"] for f, r in rows.items()},
        "formats": rows,
    }
    for fmt in ("int8", "compact"):
        if fmt in rows:
            out[f"ratio_{fmt}_vs_fp16"] = rows[fmt]["ratio_vs_fp16"]
    if "int8" in rows:
        out["kld_int8"] = rows["int8"]["kld"]
    if "compact" in rows:
        out["kld_compact"] = rows["compact"]["kld"]
        out["agree_compact"] = rows["compact"]["agree"]
    return out


# ---- plot ------------------------------------------------------------------------------------


def save_plot(path: Path, result: dict[str, Any]) -> None:
    """Bytes per token against KLD for each format, and TTFT store vs recompute, from a
    summary (either panel is left out when its part did not run)."""
    panels = [p for p in ("formats", "ttft_store_s") if p in result]
    if not panels:
        return
    fig, axes = pyplot().subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        (_formats_panel if panel == "formats" else _ttft_panel)(ax, result)
    save_figure(fig, path)


def _formats_panel(ax: Any, result: dict[str, Any]) -> None:
    fp16 = result["raw_fp16_bytes_per_token"]
    for fmt, row in result["formats"].items():
        x, y = row["bytes_per_token"] / fp16, max(row["kld"], 1e-7)
        ax.scatter(x, y)
        ax.annotate(
            f"{fmt} ({row['agree']:.1%})", (x, y), textcoords="offset points", xytext=(5, 5)
        )
    ax.set_yscale("log")
    ax.set_xlabel("stored bytes per token / raw fp16")
    ax.set_ylabel("mean KLD vs exact cache (log)")
    ax.set_title("Store formats (label: greedy agreement)")


def _ttft_panel(ax: Any, result: dict[str, Any]) -> None:
    vals = [result["ttft_device_s"], result["ttft_store_s"], result["ttft_recompute_s"]]
    ax.bar(
        ["device-cache hit", "load from Redis", "recompute"],
        vals,
        color=["tab:blue", "tab:green", "tab:gray"],
    )
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f} s", ha="center", va="bottom")
    ax.set_ylabel("TTFT (s), median")
    ax.set_title(f"{result['prefix_tokens']}-token prefix, fresh engine: {result['speedup']:.1f}x")
