"""`kvserve bench store --parts ttft`: a prefix computed by one engine, served to fresh ones.

For each --prefix-tokens length and each --kv-dtypes cache dtype (every engine of the pair has
that cache): engine A computes the prefix and publishes it to Redis once per --format, each in a
namespace of its own; then, per repeat, for each format a fresh engine B with an empty device
cache answers prefix + a new question, loading the prefix from Redis, and one fresh engine B'
without a store answers the same request by recomputing, then a prefix + another question from
its device cache (the device hit; neither depends on the format). Every B and B' serves one
short warm-up request first. Per (length, dtype, format): TTFT medians, the speedup, store /
device, stored bytes per token, and the medians of B's breakdown (see store.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.bench.lib.bench_namespace import drop_namespace, fresh_namespace
from kvserve.services.bench.lib.engine_timing import first_token_s
from kvserve.services.bench.workloads.text import reference_text
from kvserve.shared.config import StoreConfig

QUESTIONS = [
    "\n\nQuestion: which topic above is the longest?",
    "\n\nQuestion: summarise the first paragraph.",
    "\n\nQuestion: name one keyword mentioned above.",
    "\n\nQuestion: what is this text about?",
    "\n\nQuestion: is there any code above?",
]
WARM_UP = "A short warm-up request, unrelated to the prefix."
# Positions a prefix leaves free: a question (about a dozen tokens) and the first token.
QUESTION_ROOM = 32
Make = Callable[..., Any]  # make(store, num_blocks=..., kv_dtype=...) -> a fresh Engine


@dataclass
class Published:
    """The prefix engine A left in the store, and what the later engines need to ask for it."""

    store: StoreConfig
    namespace: str
    num_blocks: int
    kv_dtype: str
    prefix: list[int]
    questions: list[list[int]]
    warm: list[int]
    bytes_per_token: float


@dataclass
class Repeats:
    """Each repeat's TTFTs from the store, and B's breakdown, for one format."""

    loads: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class Baseline:
    """Each repeat's TTFTs recomputed and from the device cache, shared by the formats."""

    recomputes: list[float] = field(default_factory=list)
    devices: list[float] = field(default_factory=list)


def publish(make: Make, redis: str, fmt: str, kv_dtype: str, prefix_tokens: int) -> Published:
    """Engine A (a `kv_dtype` cache) computes the prefix (and a question) and publishes it in
    `fmt` in a namespace of its own; it is closed once its writes are flushed."""
    ns = fresh_namespace("bench")
    url = f"{redis}?namespace={ns}&timeout=5"
    store = StoreConfig(url=url, format=fmt, host_tier_bytes=2 << 30)
    num_blocks = prefix_tokens // 16 + 8 + 16
    a = make(store, num_blocks=num_blocks, kv_dtype=kv_dtype)
    prefix = reference_text(a.tokenizer, prefix_tokens)
    questions = [list(a.tokenizer.encode(q)) for q in QUESTIONS]
    t0 = time.perf_counter()
    first_token_s(a, "publish", prefix + questions[0])
    a.kv.flush()
    bytes_per_token = float(a.store_stats()["bytes_per_token"])
    a.close()
    print(
        f"engine A ({kv_dtype} cache) computed and published {len(prefix)} tokens in "
        f"{time.perf_counter() - t0:.2f}s ({bytes_per_token:,.0f} B/token in the store, {fmt})"
    )
    warm = list(a.tokenizer.encode(WARM_UP))
    return Published(store, ns, num_blocks, kv_dtype, prefix, questions, warm, bytes_per_token)


def cross_instance_ttft(
    make: Make,
    repeats: int,
    redis: str,
    prefix_tokens: list[int],
    kv_dtypes: list[str],
    formats: list[str],
) -> dict[str, Any]:
    """Every (prefix length, kv dtype, format): the store's, recomputing's and the device
    hit's TTFT medians over `repeats` fresh engines, printed as a table. `ttft_runs` holds one
    summary per combination; the first's keys are also at the top level."""
    runs = [
        run
        for n in prefix_tokens
        for kv_dtype in kv_dtypes
        for run in _combination(make, repeats, redis, n, kv_dtype, formats)
    ]
    _print_table(runs)
    return {**runs[0], "ttft_runs": runs}


def _combination(
    make: Make, repeats: int, redis: str, prefix_tokens: int, kv_dtype: str, formats: list[str]
) -> list[dict[str, Any]]:
    """One prefix length and kv dtype: the prefix published once per format, then each repeat
    a load per format and one recompute and device hit. A summary per format."""
    pubs = {fmt: publish(make, redis, fmt, kv_dtype, prefix_tokens) for fmt in formats}
    loads = {fmt: Repeats() for fmt in formats}
    base = Baseline()
    for r in range(repeats):
        for fmt, pub in pubs.items():
            _load_repeat(make, pub, r, fmt, loads[fmt])
        _baseline_repeat(make, pubs[formats[0]], r, base)
    for pub in pubs.values():
        drop_namespace(redis, pub.namespace)
    return [_summary(loads[fmt], base, pub, fmt) for fmt, pub in pubs.items()]


def _request(pub: Published, r: int, shift: int) -> list[int]:
    qs = pub.questions
    return pub.prefix + qs[(r + shift) % len(qs)]


def _load_repeat(make: Make, pub: Published, r: int, fmt: str, runs: Repeats) -> None:
    b = make(pub.store, num_blocks=pub.num_blocks, kv_dtype=pub.kv_dtype)
    t_load, row = _ttft_from_store(b, pub.warm, _request(pub, r, 1))
    runs.loads.append(t_load)
    runs.rows.append(row)
    print(
        f"repeat {r} {len(pub.prefix)} tokens {pub.kv_dtype} cache {fmt}: store {t_load:.3f}s "
        f"({row['cached_tokens']} tokens from Redis, {row['decision']}); breakdown "
        + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_s")),
        flush=True,
    )


def _baseline_repeat(make: Make, pub: Published, r: int, base: Baseline) -> None:
    c = make(None, num_blocks=pub.num_blocks, kv_dtype=pub.kv_dtype)
    first_token_s(c, "warm", pub.warm)
    t_re = first_token_s(c, "q", _request(pub, r, 1))
    # C's device cache now holds the prefix: the same kind of prompt as a device hit.
    t_dev = first_token_s(c, "dev", _request(pub, r, 2))
    c.close()
    base.recomputes.append(t_re)
    base.devices.append(t_dev)
    print(
        f"repeat {r} {len(pub.prefix)} tokens {pub.kv_dtype} cache: recompute {t_re:.3f}s, "
        f"device hit {t_dev:.3f}s",
        flush=True,
    )


def _ttft_from_store(b: Any, warm: list[int], ids: list[int]) -> tuple[float, dict[str, Any]]:
    """Engine B's TTFT for `ids` after a warm-up request, and where the time went; closes B."""
    first_token_s(b, "warm", warm)
    t_load = first_token_s(b, "q", ids)
    f = b.kv.last_fetch
    row = {
        "ttft_s": t_load,
        "cached_tokens": b.prefix_cache_stats["hits_tokens_store"],
        "decision": f.decision if f is not None else "none",
        "blocks_loaded": f.loaded if f is not None else 0,
        **(f.timings if f is not None else {}),
        "copy_in_s": b.kv.copy_in_s,
    }
    b.close()
    return t_load, row


def _summary(runs: Repeats, base: Baseline, pub: Published, fmt: str) -> dict[str, Any]:
    """One combination's figures: TTFT medians and ranges, ratios, stored bytes per token,
    the median of each breakdown timing, decoding CPU time per loaded block."""
    loads, recomputes, devices = runs.loads, base.recomputes, base.devices
    med_l, med_r, med_d = (statistics.median(x) for x in (loads, recomputes, devices))
    keys = [k for k in dict.fromkeys(k for row in runs.rows for k in row) if k.endswith("_s")]
    breakdown = {
        k: statistics.median(row[k] for row in runs.rows if k in row) for k in keys if k != "ttft_s"
    }
    per_block = [
        1e3 * row["decode_cpu_s"] / row["blocks_loaded"]
        for row in runs.rows
        if row["blocks_loaded"] and "decode_cpu_s" in row
    ]
    return {
        "prefix_tokens": len(pub.prefix),
        "kv_dtype": pub.kv_dtype,
        "ttft_format": fmt,
        "ttft_store_s": med_l,
        "ttft_recompute_s": med_r,
        "ttft_device_s": med_d,
        "speedup": med_r / med_l,
        "store_vs_device": med_l / med_d,
        "ttft_store_range_s": [min(loads), max(loads)],
        "ttft_recompute_range_s": [min(recomputes), max(recomputes)],
        "ttft_device_range_s": [min(devices), max(devices)],
        "store_bytes_per_token": pub.bytes_per_token,
        "cached_tokens": statistics.median(row["cached_tokens"] for row in runs.rows),
        "ttft_breakdown_median_s": breakdown,
        "decode_cpu_ms_per_block": statistics.median(per_block) if per_block else None,
        "ttft_breakdown": runs.rows,
    }


def _print_table(runs: list[dict[str, Any]]) -> None:
    """One line per combination: TTFTs (median [min-max]), ratios, bytes per token, cached
    tokens, decoding CPU ms per block, then each breakdown timing's median."""
    print(
        f"{'prefix':>6} {'kv':>4} {'format':>7} {'store s [min-max]':>21} {'recomp s':>8} "
        f"{'device s':>8} {'speedup':>7} {'st/dev':>6} {'B/token':>8} {'cached':>6} "
        f"{'cpu ms/blk':>10} breakdown medians (s)"
    )
    for run in runs:
        lo, hi = run["ttft_store_range_s"]
        store = f"{run['ttft_store_s']:.3f} [{lo:.3f}-{hi:.3f}]"
        cpu = run["decode_cpu_ms_per_block"]
        print(
            f"{run['prefix_tokens']:>6} {run['kv_dtype']:>4} {run['ttft_format']:>7} {store:>21} "
            f"{run['ttft_recompute_s']:>8.3f} {run['ttft_device_s']:>8.3f} "
            f"{run['speedup']:>6.2f}x {run['store_vs_device']:>5.2f}x "
            f"{run['store_bytes_per_token']:>8,.0f} {run['cached_tokens']:>6.0f} "
            f"{'-' if cpu is None else f'{cpu:.3f}':>10} "
            + " ".join(f"{k} {v:.4f}" for k, v in run["ttft_breakdown_median_s"].items()),
            flush=True,
        )
