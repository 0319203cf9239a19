"""`kvserve bench store --parts ttft`: a prefix computed by one engine, served to fresh ones.

Engine A computes a --prefix-tokens prefix and publishes it to Redis (--format); then, per
repeat, a fresh engine B with an empty device cache answers prefix + a new question, loading
the prefix from Redis, and a fresh engine B' without a store answers the same request by
recomputing, then a prefix + another question from its device cache (the device hit). Both B
and B' serve one short warm-up request first. TTFT medians, the speedup, store / device, and
B's breakdown (see store.py)."""

from __future__ import annotations

import argparse
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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
Make = Callable[..., Any]  # make(store, num_blocks=...) -> a fresh Engine


@dataclass
class Published:
    """The prefix engine A left in the store, and what the later engines need to ask for it."""

    store: StoreConfig
    num_blocks: int
    prefix: list[int]
    questions: list[list[int]]
    warm: list[int]
    bytes_per_token: float


@dataclass
class Repeats:
    """Each repeat's TTFTs: from the store, recomputed, from the device cache; B's breakdown."""

    loads: list[float] = field(default_factory=list)
    recomputes: list[float] = field(default_factory=list)
    devices: list[float] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)


def publish(make: Make, args: argparse.Namespace) -> Published:
    """Engine A computes the prefix (and a question) and publishes it in a namespace of its
    own; it is closed once its writes are flushed."""
    ns = f"bench-{uuid.uuid4().hex[:12]}"
    url = f"{args.redis}?namespace={ns}&timeout=5"
    store = StoreConfig(url=url, format=args.format, host_tier_bytes=2 << 30)
    num_blocks = args.prefix_tokens // 16 + 8 + 16
    a = make(store, num_blocks=num_blocks)
    prefix = reference_text(a.tokenizer, args.prefix_tokens)
    questions = [list(a.tokenizer.encode(q)) for q in QUESTIONS]
    t0 = time.perf_counter()
    first_token_s(a, "publish", prefix + questions[0])
    a.kv.flush()
    bytes_per_token = float(a.store_stats()["bytes_per_token"])
    a.close()
    print(
        f"engine A computed and published {len(prefix)} tokens in "
        f"{time.perf_counter() - t0:.2f}s ({bytes_per_token:,.0f} B/token in the store, "
        f"{args.format})"
    )
    warm = list(a.tokenizer.encode(WARM_UP))
    return Published(store, num_blocks, prefix, questions, warm, bytes_per_token)


def cross_instance_ttft(make: Make, args: argparse.Namespace) -> dict[str, Any]:
    """Engine A publishes a long prefix; then, each repeat, a fresh engine B answers a question
    after that prefix with the prefix loaded from the store, and a fresh store-less engine C
    recomputes it. Medians of both TTFTs."""
    pub = publish(make, args)
    runs = Repeats()
    for r in range(args.repeats):
        _repeat(make, pub, r, runs)
    out = _ttft_summary(runs, args.format, len(pub.prefix))
    out["store_bytes_per_token"] = pub.bytes_per_token
    out["ttft_device_s"] = statistics.median(runs.devices)
    out["ttft_device_range_s"] = [min(runs.devices), max(runs.devices)]
    out["store_vs_device"] = out["ttft_store_s"] / out["ttft_device_s"]
    print(
        f"TTFT median: device hit {out['ttft_device_s']:.3f}s; store / device "
        f"{out['store_vs_device']:.2f}x"
    )
    return out


def _repeat(make: Make, pub: Published, r: int, runs: Repeats) -> None:
    qs = pub.questions
    ids = pub.prefix + qs[(r + 1) % len(qs)]
    t_load, row = _ttft_from_store(make(pub.store, num_blocks=pub.num_blocks), pub.warm, ids)
    c = make(None, num_blocks=pub.num_blocks)
    first_token_s(c, "warm", pub.warm)
    t_re = first_token_s(c, "q", ids)
    # C's device cache now holds the prefix: the same kind of prompt as a device hit.
    t_dev = first_token_s(c, "dev", pub.prefix + qs[(r + 2) % len(qs)])
    del c
    runs.loads.append(t_load)
    runs.recomputes.append(t_re)
    runs.devices.append(t_dev)
    runs.rows.append(row)
    print(
        f"repeat {r}: store {t_load:.3f}s ({row['cached_tokens']} tokens from Redis) vs "
        f"recompute {t_re:.3f}s vs device hit {t_dev:.3f}s; breakdown "
        + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_s")),
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
        **(f.timings if f is not None else {}),
        "copy_in_s": b.kv.copy_in_s,
    }
    b.close()
    return t_load, row


def _ttft_summary(runs: Repeats, fmt: str, prefix_tokens: int) -> dict[str, Any]:
    loads, recomputes = runs.loads, runs.recomputes
    med_l, med_r = statistics.median(loads), statistics.median(recomputes)
    print(f"TTFT median: store {med_l:.3f}s, recompute {med_r:.3f}s, speedup {med_r / med_l:.1f}x")
    return {
        "ttft_store_s": med_l,
        "ttft_recompute_s": med_r,
        "speedup": med_r / med_l,
        "ttft_store_range_s": [min(loads), max(loads)],
        "ttft_recompute_range_s": [min(recomputes), max(recomputes)],
        "ttft_breakdown": runs.rows,
        "ttft_format": fmt,
        "prefix_tokens": prefix_tokens,
    }
