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
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvserve.shared.config import StoreConfig

QUESTION = "\n\nQuestion: which topic above is the longest?"
WARM = "A short warm-up request, unrelated to the prefix."
Make = Callable[..., Any]


def _ttft(engine: Any, ids: list[int], warm: list[int]) -> float:
    from kvserve.services.bench.store import _first_token_s

    _first_token_s(engine, "warm", warm)
    return float(_first_token_s(engine, "q", ids))


def point(make: Make, redis: str, fmt: str, prefix_tokens: int, repeats: int) -> dict[str, Any]:
    """One (format, length) point: the three TTFTs (medians of `repeats` fresh engines each)
    and the rule's choices."""
    from kvserve.services.bench.kvquant import reference_text

    url = f"{redis}?namespace=breakeven-{uuid.uuid4().hex[:12]}&timeout=5"
    store = StoreConfig(url=url, format=fmt, host_tier_bytes=2 << 30)
    num_blocks = prefix_tokens // 16 + 32
    a = make(store, num_blocks=num_blocks)
    prefix = reference_text(a.tokenizer, prefix_tokens)
    ids = prefix + list(a.tokenizer.encode(QUESTION))
    warm = list(a.tokenizer.encode(WARM))
    _ttft(a, [*prefix, ids[-1]], warm)  # computes and publishes the prefix
    a.close()
    rules, loads, recomputes, chose = [], [], [], []
    for _ in range(repeats):
        rule = make(store, num_blocks=num_blocks)
        rules.append(_ttft(rule, ids, warm))
        chose.append(rule.kv.last_fetch.decision if rule.kv.last_fetch is not None else "none")
        rule.close()
        load = make(store, num_blocks=num_blocks)
        load.kv.prefill_s_per_token = 1.0  # recomputing looks slow: the rule always loads
        loads.append(_ttft(load, ids, warm))
        load.close()
        recomputes.append(_ttft(make(None, num_blocks=num_blocks), ids, warm))
    t_rule, t_load, t_re = (statistics.median(x) for x in (rules, loads, recomputes))
    decision = ",".join(sorted(set(chose)))
    best = min(t_load, t_re)
    row = {"format": fmt, "prefix_tokens": len(prefix), "ttft_rule_s": t_rule,
           "ttft_load_s": t_load, "ttft_recompute_s": t_re, "rule_chose": decision,
           "rule_over_best": t_rule / best}  # fmt: skip
    print(
        f"{fmt:>7} {len(prefix):>5} tokens: load {t_load:.3f}s recompute {t_re:.3f}s "
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
    """TTFT against cached-prefix length, per format: load, recompute, the rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    formats = sorted({r["format"] for r in rows})
    fig, axes = plt.subplots(1, len(formats), figsize=(5.5 * len(formats), 4), squeeze=False)
    for ax, fmt in zip(axes[0], formats, strict=True):
        mine = [r for r in rows if r["format"] == fmt]
        x = [r["prefix_tokens"] for r in mine]
        for key, label in (
            ("ttft_load_s", "load from Redis"),
            ("ttft_recompute_s", "recompute"),
            ("ttft_rule_s", "cost rule"),
        ):
            ax.plot(x, [r[key] for r in mine], marker="o", label=label)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("cached prefix (tokens)")
        ax.set_ylabel("TTFT (s)")
        ax.set_title(f"store format {fmt}")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
