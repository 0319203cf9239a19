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
  rule chose, over --breakeven-lengths and --breakeven-formats (services/bench/breakeven.py).
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
import uuid
from pathlib import Path
from typing import Any

from kvserve.services.cli_support import CliError
from kvserve.shared.config import (
    STORE_FORMATS,
    CacheConfig,
    EngineConfig,
    StoreConfig,
    default_model_path,
)

PARTS = ("formats", "ttft", "throughput", "breakeven")
QUESTIONS = [
    "\n\nQuestion: which topic above is the longest?",
    "\n\nQuestion: summarise the first paragraph.",
    "\n\nQuestion: name one keyword mentioned above.",
    "\n\nQuestion: what is this text about?",
    "\n\nQuestion: is there any code above?",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--redis", default="redis://127.0.0.1:6379/15")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    p.add_argument("--formats", default="fp16,bf16,int8,fp8,compact")
    p.add_argument("--format", default="native", help="store format for ttft and throughput")
    p.add_argument("--prefix-tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--text-tokens", type=int, default=1024)
    p.add_argument("--gen-tokens", type=int, default=128)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--batch", type=int, default=32)
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


def run(args: argparse.Namespace) -> int:
    parts, formats = _check(args)
    import torch
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.model.loader import load_weights
    from kvserve.shared.model.tokenizer import KVTokenizer

    weights = load_weights(args.model, torch.float32)
    tokenizer = KVTokenizer.from_path(args.model)

    def engine(store: StoreConfig | None = None, num_blocks: int = 512) -> Engine:
        cfg = EngineConfig(
            model_path=args.model,
            cache=CacheConfig(num_blocks=num_blocks, populate="eager"),
            store=store or StoreConfig(),
        )
        return Engine(cfg, tokenizer=tokenizer, weights=weights)

    result: dict[str, Any] = {}
    if "formats" in parts:
        result.update(_formats(engine(), formats, args))
    if "ttft" in parts:
        result.update(_ttft(engine, args))
    if "throughput" in parts:
        result.update(_throughput(engine(), args))
    if "breakeven" in parts:
        from kvserve.services.bench import breakeven

        result.update(breakeven.run(engine, args))
        if args.breakeven_plot:
            breakeven.save_plot(args.breakeven_plot, result["breakeven"])
    if args.plot is not None and set(parts) - {"breakeven"}:
        save_plot(args.plot, result)
    print(json.dumps(result))
    return 0


# ---- formats ---------------------------------------------------------------------------------


def _formats(engine: Any, formats: list[str], args: argparse.Namespace) -> dict[str, Any]:
    from kvserve.services.bench.kvquant import PROMPTS, reference_text
    from kvserve.services.bench.store_quality import (
        format_quality,
        raw_fp16_bytes_per_token,
        reference_greedy,
    )

    text = reference_text(engine.tokenizer, args.text_tokens)
    prompts = [
        list(engine.tokenizer.encode_chat([{"role": "user", "content": p}]))
        for p in PROMPTS[: args.num_prompts]
    ]
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
    out: dict[str, Any] = {
        "raw_fp16_bytes_per_token": fp16,
        "bytes_per_token": {f: r["bytes_per_token"] for f, r in rows.items()},
        "formats": rows,
    }
    for fmt, key in (("int8", "int8"), ("compact", "compact")):
        if fmt in rows:
            out[f"ratio_{key}_vs_fp16"] = rows[fmt]["ratio_vs_fp16"]
    if "int8" in rows:
        out["kld_int8"] = rows["int8"]["kld"]
    if "compact" in rows:
        out["kld_compact"] = rows["compact"]["kld"]
        out["agree_compact"] = rows["compact"]["agree"]
    return out


# ---- cross-instance TTFT ---------------------------------------------------------------------


def _first_token_s(engine: Any, rid: str, ids: list[int]) -> float:
    from kvserve.shared.sampling_params import SamplingParams

    t0 = time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, ignore_eos=True))
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.completions[0].token_ids:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


def _ttft(make: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Engine A computes a long prefix and publishes it to Redis; then, each repeat, a fresh
    engine B answers a question after that prefix with the prefix loaded from the store, and
    a fresh store-less engine C recomputes it. Medians of both TTFTs."""
    from kvserve.services.bench.kvquant import reference_text

    ns = f"bench-{uuid.uuid4().hex[:12]}"
    url = f"{args.redis}?namespace={ns}&timeout=5"
    store = StoreConfig(url=url, format=args.format, host_tier_bytes=2 << 30)
    num_blocks = args.prefix_tokens // 16 + 8 + 16
    a = make(store, num_blocks=num_blocks)
    prefix = reference_text(a.tokenizer, args.prefix_tokens)
    questions = [list(a.tokenizer.encode(q)) for q in QUESTIONS]
    t0 = time.perf_counter()
    _first_token_s(a, "publish", prefix + questions[0])
    a.kv.connector.flush()
    bytes_per_token = float(a.store_stats()["bytes_per_token"])
    a.close()
    publish_s = time.perf_counter() - t0
    print(
        f"engine A computed and published {len(prefix)} tokens in {publish_s:.2f}s "
        f"({bytes_per_token:,.0f} B/token in the store, {args.format})"
    )
    warm = list(a.tokenizer.encode("A short warm-up request, unrelated to the prefix."))
    loads, recomputes, devices, rows = [], [], [], []
    for r in range(args.repeats):
        ids = prefix + questions[(r + 1) % len(questions)]
        t_load, row = _ttft_from_store(make(store, num_blocks=num_blocks), warm, ids)
        c = make(None, num_blocks=num_blocks)
        _first_token_s(c, "warm", warm)
        t_re = _first_token_s(c, "q", ids)
        # C's device cache now holds the prefix: the same kind of prompt as a device hit.
        t_dev = _first_token_s(c, "dev", prefix + questions[(r + 2) % len(questions)])
        del c
        loads.append(t_load)
        recomputes.append(t_re)
        devices.append(t_dev)
        rows.append(row)
        print(
            f"repeat {r}: store {t_load:.3f}s ({row['cached_tokens']} tokens from Redis) vs "
            f"recompute {t_re:.3f}s vs device hit {t_dev:.3f}s; breakdown "
            + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_s")),
            flush=True,
        )
    out = _ttft_summary(loads, recomputes, rows, args.format, len(prefix))
    out["store_bytes_per_token"] = bytes_per_token
    out["ttft_device_s"] = statistics.median(devices)
    out["ttft_device_range_s"] = [min(devices), max(devices)]
    out["store_vs_device"] = out["ttft_store_s"] / out["ttft_device_s"]
    print(
        f"TTFT median: device hit {out['ttft_device_s']:.3f}s; store / device "
        f"{out['store_vs_device']:.2f}x"
    )
    return out


def _ttft_from_store(b: Any, warm: list[int], ids: list[int]) -> tuple[float, dict[str, Any]]:
    """Engine B's TTFT for `ids` after a warm-up request, and where the time went; closes B."""
    _first_token_s(b, "warm", warm)
    t_load = _first_token_s(b, "q", ids)
    f = b.kv.last_fetch
    row = {
        "ttft_s": t_load,
        "cached_tokens": b.prefix_cache_stats["hits_tokens_store"],
        **(f.timings if f is not None else {}),
        "copy_in_s": b.kv.copy_in_s,
    }
    b.close()
    return t_load, row


def _ttft_summary(
    loads: list[float],
    recomputes: list[float],
    rows: list[dict[str, Any]],
    fmt: str,
    prefix_tokens: int,
) -> dict[str, Any]:
    med_l, med_r = statistics.median(loads), statistics.median(recomputes)
    print(f"TTFT median: store {med_l:.3f}s, recompute {med_r:.3f}s, speedup {med_r / med_l:.1f}x")
    return {
        "ttft_store_s": med_l,
        "ttft_recompute_s": med_r,
        "speedup": med_r / med_l,
        "ttft_store_range_s": [min(loads), max(loads)],
        "ttft_recompute_range_s": [min(recomputes), max(recomputes)],
        "ttft_breakdown": rows,
        "ttft_format": fmt,
        "prefix_tokens": prefix_tokens,
    }


# ---- store throughput ------------------------------------------------------------------------


def _throughput(engine: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Put and get rates of --blocks real frames (the K/V of a prefill in --format, repeated
    under fresh keys) against Redis in batches of --batch."""
    items = _real_frames(engine, args)
    nbytes = sum(len(v) for _, v in items)
    put_s, get_s, got = asyncio.run(_put_then_get(args, items))
    if got != len(items):
        raise RuntimeError(f"get_many returned {got} of {len(items)} blocks")
    mb = nbytes / 1e6
    out = {
        "put_blocks_per_s": len(items) / put_s,
        "put_mb_per_s": mb / put_s,
        "get_blocks_per_s": len(items) / get_s,
        "get_mb_per_s": mb / get_s,
        "throughput_format": args.format,
        "frame_bytes": nbytes / len(items),
    }
    print(
        f"store throughput ({args.format}, {nbytes / len(items) / 1e3:.0f} kB/block, batch "
        f"{args.batch}): put {out['put_blocks_per_s']:.0f} blocks/s {out['put_mb_per_s']:.0f} "
        f"MB/s, get {out['get_blocks_per_s']:.0f} blocks/s {out['get_mb_per_s']:.0f} MB/s"
    )
    return out


def _real_frames(engine: Any, args: argparse.Namespace) -> list[tuple[Any, bytes]]:
    """--blocks (hash, frame) pairs: the encoded blocks of a real prefill (at most 256),
    repeated under fresh random keys."""
    from kvserve.services.bench.kvquant import reference_text
    from kvserve.shared.sampling_params import SamplingParams
    from kvserve.shared.store.codec import encode_block
    from kvserve.shared.store.hashing import BlockHash, block_hashes

    n_tokens = 16 * min(args.blocks, 256)
    ids = reference_text(engine.tokenizer, n_tokens + 1)
    engine.generate([ids], SamplingParams(max_tokens=1))
    meta, root = engine.kv.identity.meta, engine.root_hash()
    hashes = block_hashes(root, ids[:n_tokens], 16)
    assert engine.kv.pool.index is not None
    blocks = [engine.kv.pool.index.block_of(h) for h in hashes]
    data = engine.runner.cache.read_blocks([b for b in blocks if b is not None])
    frames = []
    for i, (_, d) in enumerate(zip(hashes, data, strict=True)):  # every block is cached
        k, v = d.to_float()
        parent = hashes[i - 1] if i else root
        toks = ids[i * 16 : (i + 1) * 16]
        frames.append(encode_block(meta, toks, k, v, args.format, parent))
    return [
        (BlockHash(uuid.uuid4().bytes + uuid.uuid4().bytes), frames[i % len(frames)])
        for i in range(args.blocks)
    ]


async def _put_then_get(
    args: argparse.Namespace, items: list[tuple[Any, bytes]]
) -> tuple[float, float, int]:
    """(seconds to put all, seconds to get all, how many came back), in --batch batches, in a
    namespace of their own that is deleted at the end."""
    from kvserve.shared.store.backends import open_store

    ns = f"bench-{uuid.uuid4().hex[:12]}"
    store = open_store(f"{args.redis}?namespace={ns}&timeout=10")
    try:
        t0 = time.perf_counter()
        for i in range(0, len(items), args.batch):
            await store.put_many(items[i : i + args.batch])
        t1 = time.perf_counter()
        got = 0
        for i in range(0, len(items), args.batch):
            vals = await store.get_many([h for h, _ in items[i : i + args.batch]])
            got += sum(v is not None for v in vals)
        t2 = time.perf_counter()
        await store.delete([h for h, _ in items])
        return t1 - t0, t2 - t1, got
    finally:
        await store.close()


def save_plot(path: Path, result: dict[str, Any]) -> None:
    """Bytes per token against KLD for each format, and TTFT store vs recompute, from a
    summary (either panel is left out when its part did not run)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [p for p in ("formats", "ttft_store_s") if p in result]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel == "formats":
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
        else:
            vals = [result["ttft_device_s"], result["ttft_store_s"], result["ttft_recompute_s"]]
            ax.bar(
                ["device-cache hit", "load from Redis", "recompute"],
                vals,
                color=["tab:blue", "tab:green", "tab:gray"],
            )
            for i, v in enumerate(vals):
                ax.text(i, v, f"{v:.2f} s", ha="center", va="bottom")
            ax.set_ylabel("TTFT (s), median")
            ax.set_title(
                f"{result['prefix_tokens']}-token prefix, fresh engine: {result['speedup']:.1f}x"
            )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
