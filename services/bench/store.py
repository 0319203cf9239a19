"""`kvserve bench store`: the prefix store's formats, cross-instance reuse through Redis, and the
store's raw throughput.

- formats: stored bytes per token and quality for each store format against raw fp16, measured
  on the model's real K/V by `store_quality.format_quality` (every earlier block of a text or a
  greedy continuation has made the round trip through the codec): mean KLD of the next-token
  distributions over --text-tokens of prose, teacher-forced greedy agreement over --num-prompts
  chat prompts x --gen-tokens reference tokens; and what zstd saves and costs each format's
  load, with the link speed below which it pays.
- ttft: for each --prefix-tokens length and --kv-dtypes cache dtype, engine A computes the
  prefix and publishes it to Redis in each --format; then, per repeat, for each format a fresh
  engine B with an empty device cache answers prefix + a new question, loading the prefix from
  Redis, and a fresh engine B' without a store answers the same request by recomputing, then a
  prefix + another question from its device cache (the device hit). Both B and B' serve one
  short warm-up request first. One table line per (length, dtype, format): TTFT medians, the
  speedup, store / device, stored bytes per token, and the medians of B's breakdown:
  `contains` round trip, the pipelined load (gets, verification, decompression,
  dequantization; `decode_cpu_s` sums the worker threads' time, also given per loaded block),
  copy into the cache. The JSON's `ttft_runs` holds every combination; its top-level ttft keys
  are the first's.
- throughput: put_many / get_many of --blocks real blocks (encoded in the first --format)
  against the Redis at --redis, batches of --batch: blocks/s and MB/s.
- breakeven: TTFT loading a cached prefix from Redis against recomputing it, and what the cost
  rule chose, over --breakeven-lengths and --breakeven-formats (store_breakeven.py).
- load: the store connector alone loading the first --prefix-tokens prefix's blocks from Redis
  into a KV cache, for each frame format, cache dtype and load pipeline setting in
  store_load.LOAD_ARMS (no model step): the load's time and where it goes.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from kvserve.services.bench.lib.flags import add_model, add_sizes, comma_list
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    KV_DTYPES,
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    StoreConfig,
)

PARTS = ("formats", "ttft", "throughput", "breakeven", "load")
SIZES = {"repeats": 3, "text-tokens": 1024, "gen-tokens": 128, "num-prompts": 8, "blocks": 256,
         "batch": 32}  # fmt: skip


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    p.add_argument("--parts", default=",".join(PARTS[:4]), help=f"comma list of {PARTS}")
    p.add_argument("--formats", default="fp16,bf16,int8,fp8,compact")
    p.add_argument(
        "--format",
        default="native",
        help="ttft: comma list of store formats; throughput: the first",
    )
    p.add_argument(
        "--kv-dtypes",
        default="auto",
        help=f"ttft: comma list of KV cache dtypes ({', '.join(KV_DTYPES)}; auto: the model's)",
    )
    p.add_argument(
        "--prefix-tokens", default="2048", help="ttft: comma list of prefix lengths in tokens"
    )
    add_sizes(p, SIZES)
    p.add_argument("--plot", type=Path, default=None, help="PNG: formats and TTFT panels")
    p.add_argument("--breakeven-formats", default="native,int8", help="breakeven: formats")
    p.add_argument(
        "--breakeven-lengths",
        default="16,64,256,1024,2048,4096",
        help="breakeven: cached-prefix lengths in tokens",
    )
    p.add_argument("--breakeven-plot", type=Path, default=None, help="PNG: the breakeven curves")


class Checked(NamedTuple):
    """The parsed options: the parts, the formats part's formats, and the ttft part's grid."""

    parts: list[str]
    formats: list[str]
    ttft_formats: list[str]
    kv_dtypes: list[str]
    prefix_tokens: list[int]


def _check(args: argparse.Namespace) -> Checked:
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad or not parts:
        raise CliError(f"--parts: unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    formats = [x for x in args.formats.split(",") if x]
    ttft_formats = [x.strip() for x in args.format.split(",") if x.strip()]
    codec_formats = [f for f in STORE_FORMATS if f != "auto"]
    wrong = [f for f in [*formats, *ttft_formats] if f not in codec_formats]
    breakeven = [x for x in args.breakeven_formats.split(",") if x]
    wrong += [f for f in breakeven if f not in codec_formats]
    if wrong or not breakeven or not ttft_formats:
        raise CliError(f"--formats/--format/--breakeven-formats: unknown {wrong}; choose from "
                       f"{codec_formats}")  # fmt: skip
    kv_dtypes = comma_list(args.kv_dtypes, KV_DTYPES, "--kv-dtypes")
    lengths = args.breakeven_lengths.split(",")
    if not all(x.isdigit() and 16 <= int(x) <= 8192 for x in lengths):
        raise CliError("--breakeven-lengths: comma-separated token counts in 16..8192")
    if args.repeats < 1 or args.blocks < 1 or args.batch < 1:
        raise CliError("--repeats, --blocks and --batch >= 1")
    prefix_tokens = _prefix_tokens(args, "ttft" in parts)
    return Checked(parts, formats, ttft_formats, kv_dtypes, prefix_tokens)


def _prefix_tokens(args: argparse.Namespace, ttft: bool) -> list[int]:
    """--prefix-tokens' lengths, each >= 64 and (when the ttft part runs) leaving the model's
    context window room for a question."""
    from kvserve.services.bench.store_ttft import QUESTION_ROOM

    items = [x.strip() for x in args.prefix_tokens.split(",") if x.strip()]
    hi = _max_positions(args.model) - QUESTION_ROOM if ttft else None
    if not items or not all(x.isdigit() and int(x) >= 64 for x in items):
        bounds = ">= 64" if hi is None else f"in 64..{hi}"
        raise CliError(f"--prefix-tokens: comma-separated token counts {bounds}")
    if hi is not None and any(int(x) > hi for x in items):
        raise CliError(f"--prefix-tokens: comma-separated token counts in 64..{hi} (the model's "
                       f"{hi + QUESTION_ROOM} positions less room for a question)")  # fmt: skip
    return [int(x) for x in items]


def _max_positions(model: str) -> int:
    """The model's context window, from its config (no weights)."""
    from kvserve.shared.model.gguf_file import gguf_model_config, open_gguf
    from kvserve.shared.model.loader import resolve_model_path

    p = resolve_model_path(model)
    if p.is_file():
        return gguf_model_config(open_gguf(str(p.resolve()))).max_position_embeddings
    return ModelConfig.from_json_file(p / "config.json").max_position_embeddings


def engine_factory(args: argparse.Namespace) -> Callable[..., Any]:
    """make(store=None, num_blocks=512, kv_dtype="auto"): a fresh engine on one loaded copy of
    the weights."""
    import torch
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.model.loader import load_weights
    from kvserve.shared.model.tokenizer import KVTokenizer

    weights = load_weights(args.model, torch.float32)
    tokenizer = KVTokenizer.from_path(args.model)

    def make(
        store: StoreConfig | None = None, num_blocks: int = 512, kv_dtype: str = "auto"
    ) -> Engine:
        cfg = EngineConfig(
            model_path=args.model,
            cache=CacheConfig(num_blocks=num_blocks, kv_dtype=kv_dtype, populate="eager"),
            store=store or StoreConfig(),
        )
        return Engine(cfg, tokenizer=tokenizer, weights=weights)

    return make


def run(args: argparse.Namespace) -> int:
    checked = _check(args)
    parts = checked.parts
    make = engine_factory(args)
    result: dict[str, Any] = {}
    if "formats" in parts:
        result.update(_formats(make(), checked.formats, args))
    if "ttft" in parts:
        from kvserve.services.bench.store_ttft import cross_instance_ttft

        grid = checked.prefix_tokens, checked.kv_dtypes, checked.ttft_formats
        result.update(cross_instance_ttft(make, args.repeats, args.redis, *grid))
    if "throughput" in parts:
        from kvserve.services.bench.store_throughput import throughput

        first = argparse.Namespace(**{**vars(args), "format": checked.ttft_formats[0]})
        result.update(throughput(make(), first))
    if "breakeven" in parts:
        from kvserve.services.bench import store_breakeven

        result.update(store_breakeven.run(make, args))
        if args.breakeven_plot:
            store_breakeven.save_plot(args.breakeven_plot, result["breakeven"])
    if "load" in parts:
        from kvserve.services.bench.store_load import load_bench

        result.update(load_bench(make, args.redis, checked.prefix_tokens[0], args.repeats))
    if args.plot is not None and set(parts) - {"breakeven", "load"}:
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
    print(f"{'format':>8} {'B/token':>9} {'vs fp16':>8} {'KLD':>9} {'agree':>7} enc/dec ms"
          "  zstd: saves, +ms/block, pays below")  # fmt: skip
    for fmt in formats:
        q = format_quality(engine, fmt, text, prompts, refs)
        rows[fmt] = q
        zstd = (
            f"  {q['zstd_saved']:.1%}, +{q['zstd_extra_ms']:.2f}, "
            f"{q['zstd_pays_below_gbps']:.2f} Gb/s"
            if "zstd_saved" in q
            else "  (always compressed)"
        )
        print(
            f"{fmt:>8} {q['bytes_per_token']:>9.0f} {q['ratio_vs_fp16']:>8.3f} {q['kld']:>9.5f} "
            f"{q['agree']:>7.4f} {q.get('encode_ms', 0):.2f}/{q.get('decode_ms', 0):.2f}{zstd}",
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
    # The TTFT panel widens with its groups of bars (one per ttft combination).
    widths = [
        5.5 if p == "formats" else max(5.5, 1.3 * len(result.get("ttft_runs", [1]))) for p in panels
    ]
    fig, axes = pyplot().subplots(
        1, len(panels), figsize=(sum(widths), 4), squeeze=False, width_ratios=widths
    )
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
    """Device hit, load from Redis and recompute median TTFTs, a group of bars per
    (prefix length, kv dtype, format)."""
    runs = result.get("ttft_runs", [result])
    bars = (
        ("ttft_device_s", "device-cache hit", "tab:blue"),
        ("ttft_store_s", "load from Redis", "tab:green"),
        ("ttft_recompute_s", "recompute", "tab:gray"),
    )
    width = 0.8 / len(bars)
    for j, (key, label, color) in enumerate(bars):
        x = [i + (j - 1) * width for i in range(len(runs))]
        vals = [run[key] for run in runs]
        ax.bar(x, vals, width, label=label, color=color)
        for xi, v in zip(x, vals, strict=True):
            ax.text(xi, v, f"{v:.2f}", ha="center", va="bottom", fontsize=7)
    labels = [
        f"{r['prefix_tokens']} {r.get('kv_dtype', 'auto')}\n{r['ttft_format']}\n"
        f"{r['speedup']:.1f}x / {r['store_vs_device']:.2f}x"
        for r in runs
    ]
    ax.set_xticks(range(len(runs)), labels, fontsize=7)
    ax.set_yscale("log")  # the device hit and the load beside a recompute 10-100x longer
    ax.set_ylabel("TTFT (s), median (log)")
    ax.set_title(
        "Prefix on a fresh engine: TTFT (tokens, kv dtype, format, x recompute / x device hit)"
    )
    ax.legend(fontsize=7)
