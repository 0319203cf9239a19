"""What `kvserve bench chaos` reports: per fault, for the requests sent from its start to the
end of its recovery, a `FaultReport` (sent, ok, wrong, lost, failed by kind, p99 TTFT against
the calm period's, seconds until the store took writes again, KV blocks in use when idle
before and after, RSS growth); a table per target, and the soak's table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.bench.sweeps.chaos_load import Outcome


@dataclass
class FaultReport:
    fault: str
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    failed_with_retry_after: int = 0
    p99_ttft_s: float | None = None
    p99_ttft_calm_s: float | None = None
    store_back_s: float | None = None  # Redis faults: until the store took writes again
    used_blocks_before: int = 0
    used_blocks_after: int = 0
    rss_growth_mb: float = 0.0

    def count(self, outcomes: list[Outcome]) -> None:
        """Fill in the outcomes of the fault's requests and of its calm period's."""
        mine = [o for o in outcomes if o.phase == self.fault]
        calm = [o for o in outcomes if o.phase == f"calm:{self.fault}"]
        counts = Counter(o.result for o in mine)
        self.sent, self.ok = len(mine), counts["ok"]
        self.wrong, self.lost = counts["wrong"], counts["lost"]
        self.failed = {k: n for k, n in counts.items() if k not in ("ok", "wrong", "lost")}
        self.failed_with_retry_after = sum(o.retry_after for o in mine)
        self.p99_ttft_s = p99([o.ttft_s for o in mine if o.ttft_s is not None])
        self.p99_ttft_calm_s = p99([o.ttft_s for o in calm if o.ttft_s is not None])


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'fault':<18} {'sent':>5} {'ok':>5} {'wrong':>5} {'lost':>5}  {'failed (kind: n)':<46}"
        f" {'p99 TTFT / calm s':>18} {'store back s':>12} {'blocks':>9} {'RSS MB':>7}"
    )
    lines = [f"target {result['target']}", head, "-" * len(head)]
    lines += [_line(r) for r in result["faults"]]
    return "\n".join(lines)


def _line(r: dict[str, Any]) -> str:
    failed = ", ".join(f"{k}: {n}" for k, n in sorted(r["failed"].items())) or "-"
    if r["failed_with_retry_after"]:
        failed += f" ({r['failed_with_retry_after']} w/ Retry-After)"
    p99, calm = r["p99_ttft_s"], r["p99_ttft_calm_s"]
    ttft = f"{p99:.2f} / {calm:.2f}" if p99 is not None and calm is not None else "-"
    back = f"{r['store_back_s']:.1f}" if r["store_back_s"] is not None else "-"
    blocks = f"{r['used_blocks_before']}->{r['used_blocks_after']}"
    return (
        f"{r['fault']:<18} {r['sent']:>5} {r['ok']:>5} {r['wrong']:>5} {r['lost']:>5}  "
        f"{failed:<46} {ttft:>18} {back:>12} {blocks:>9} {r['rss_growth_mb']:>7.1f}"
    )


def soak_table(result: dict[str, Any]) -> str:
    soak = result.get("soak")
    if not soak:
        return ""
    keys = ("used_blocks", "cached_blocks", "evicted_blocks", "rss_mb", "fds", "redis_clients",
            "errors_logged")  # fmt: skip
    lines = [
        f"soak of {result['target']}: per minute, idle",
        "minute " + " ".join(f"{k:>14}" for k in keys) + "  outcomes",
    ]
    for row in soak["minutes"]:
        vals = " ".join(
            f"{row[k]:>14.1f}" if isinstance(row[k], float) else f"{row[k]:>14}" for k in keys
        )
        lines.append(f"{row['minute']:>6} {vals}  {row['outcomes']}")
    slopes = ", ".join(f"{k} {v:+.3f}/min" for k, v in soak["slopes_per_min"].items())
    lines.append(f"slopes: {slopes}")
    return "\n".join(lines)
