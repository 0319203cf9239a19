"""`kvserve bench store --parts breakeven`: where loading a cached prefix from the store stops
paying, and whether the store's cost rule knows it.

For each store format (--breakeven-formats) and each cached-prefix length (--breakeven-lengths,
one block to 4,096 tokens), in a namespace of its own: engine A computes the prefix and
publishes it to Redis; then three fresh engines answer prefix + a question after a warm-up
request: `rule` (the store with its cost rule, as served), `load` (the store with the rule
forced to load: recomputing is made to look expensive) and `recompute` (no store), each
--repeats times. Reported per point: the three median TTFTs, what the rule chose, and the
rule's TTFT over the faster of load and recompute (target <= 1.10 at every point)."""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path
from typing import Any, NamedTuple

from kvserve.services.bench.lib.bench_namespace import drop_namespace, fresh_namespace
from kvserve.services.bench.lib.engine_timing import first_token_s
from kvserve.services.bench.lib.plots import pyplot, save_figure
from kvserve.services.bench.store_ttft import QUESTIONS, WARM_UP, Make
from kvserve.services.bench.workloads.text import reference_text
from kvserve.shared.config import StoreConfig


def _ttft(engine: Any, ids: list[int], warm: list[int]) -> float:
    first_token_s(engine, "warm", warm)
    return first_token_s(engine, "q", ids)


class Published(NamedTuple):
    """A prefix in the store: where, the engines' size, the request (prefix + question), the
    warm-up request, the prefix's length."""

    store: StoreConfig
    namespace: str
    num_blocks: int
    ids: list[int]
    warm: list[int]
    prefix_tokens: int


def _publish(make: Make, redis: str, fmt: str, prefix_tokens: int) -> Published:
    """Engine A computes the prefix and publishes it in a namespace of its own."""
    ns = fresh_namespace("breakeven")
    url = f"{redis}?namespace={ns}&timeout=5"
    store = StoreConfig(url=url, format=fmt, host_tier_bytes=2 << 30)
    num_blocks = prefix_tokens // 16 + 32
    a = make(store, num_blocks=num_blocks)
    prefix = reference_text(a.tokenizer, prefix_tokens)
    ids = prefix + list(a.tokenizer.encode(QUESTIONS[0]))
    warm = list(a.tokenizer.encode(WARM_UP))
    _ttft(a, [*prefix, ids[-1]], warm)  # computes and publishes the prefix
    a.close()
    return Published(store, ns, num_blocks, ids, warm, len(prefix))


class Repeat(NamedTuple):
    """One repeat's TTFTs (the rule's, forced loading's, recomputing's) and the rule's choice."""

    rule: float
    load: float
    recompute: float
    chose: str


def _three_ttfts(make: Make, pub: Published) -> Repeat:
    """One repeat: the rule's TTFT, forced loading's, recomputing's; what the rule chose."""
    rule = make(pub.store, num_blocks=pub.num_blocks)
    t_rule = _ttft(rule, pub.ids, pub.warm)
    chose = rule.kv.last_fetch.decision if rule.kv.last_fetch is not None else "none"
    rule.close()
    load = make(pub.store, num_blocks=pub.num_blocks)
    load.kv.prefill_s_per_token = 1.0  # recomputing looks slow: the rule always loads
    t_load = _ttft(load, pub.ids, pub.warm)
    load.close()
    t_re = _ttft(make(None, num_blocks=pub.num_blocks), pub.ids, pub.warm)
    return Repeat(t_rule, t_load, t_re, chose)


def point(make: Make, redis: str, fmt: str, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """One (format, length) point: the three TTFTs (medians of `repeats` fresh engines each)
    and the rule's choices."""
    pub = _publish(make, redis, fmt, prefix_tokens)
    runs = [_three_ttfts(make, pub) for _ in range(repeats)]
    drop_namespace(redis, pub.namespace)
    t_rule = statistics.median(r.rule for r in runs)
    t_load = statistics.median(r.load for r in runs)
    t_re = statistics.median(r.recompute for r in runs)
    decision = ",".join(sorted({r.chose for r in runs}))
    best = min(t_load, t_re)
    n = pub.prefix_tokens
    row = {"format": fmt, "prefix_tokens": n, "ttft_rule_s": t_rule,
           "ttft_load_s": t_load, "ttft_recompute_s": t_re, "rule_chose": decision,
           "rule_over_best": t_rule / best}  # fmt: skip
    print(
        f"{fmt:>7} {n:>5} tokens: load {t_load:.3f}s recompute {t_re:.3f}s "
        f"rule {t_rule:.3f}s ({decision}) = {t_rule / best:.2f}x the faster",
        flush=True,
    )
    return row


def run(make: Make, args: argparse.Namespace) -> dict[str, Any]:
    rows = [
        point(make, args.redis, fmt, n, args.repeats)
        for fmt in args.breakeven_formats.split(",")
        for n in (int(x) for x in args.breakeven_lengths.split(","))
    ]
    worst = max(r["rule_over_best"] for r in rows)
    print(f"breakeven: the rule's TTFT is at most {worst:.2f}x the faster choice (target 1.10)")
    return {"breakeven": rows, "breakeven_rule_worst": worst}


def save_plot(path: str | Path, rows: list[dict[str, Any]]) -> None:
    """TTFT against cached-prefix length (both axes logarithmic), per format: load, recompute,
    the rule (dashed: it lies on whichever of the two it chose)."""
    formats = sorted({r["format"] for r in rows})
    fig, axes = pyplot().subplots(1, len(formats), figsize=(5.5 * len(formats), 4), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        mine = [r for r in rows if r["format"] == fmt]
        x = [r["prefix_tokens"] for r in mine]
        for key, label, style in (
            ("ttft_load_s", "load from Redis", "-"),
            ("ttft_recompute_s", "recompute", "-"),
            ("ttft_rule_s", "cost rule", "--"),
        ):
            ax.plot(x, [r[key] for r in mine], marker="o", linestyle=style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # 16 tokens' ~40 ms and 4,096's recompute of seconds, both legible
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"store format {fmt}")
        ax.legend()
    save_figure(fig, path)
