"""What `kvserve bench chaos` reports: per fault, for the requests sent from its start to the
end of its recovery, a `FaultReport` (sent, ok, wrong, lost, failed by kind, the poisoned
requests apart and how each failed, the processes that died, p99 TTFT against the calm
period's, seconds until the store took writes again, KV blocks in use when idle before and
after, RSS growth, and what the fault's own counters say: streams aborted as stalled, bus
messages dropped, keys Redis evicted, requests a stopped worker found taken over); a fault that
does not apply to a target is reported skipped, with why. A table per target, and the soak's
table."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvserve.services.bench.sweeps.chaos_load import Outcome


@dataclass
class FaultReport:
    fault: str
    skipped: str | None = None  # why the fault does not apply to this target
    sent: int = 0
    ok: int = 0
    wrong: int = 0
    lost: int = 0
    failed: dict[str, int] = field(default_factory=dict)
    failed_with_retry_after: int = 0
    # the poisoned requests (counted apart from the above) by how they ended: "RESULT CODE"
    poisoned: dict[str, int] = field(default_factory=dict)
    workers_lost: int = 0  # processes that died (not ended by the fault itself)
    died: list[str] = field(default_factory=list)  # their names, in order
    p99_ttft_s: float | None = None
    p99_ttft_calm_s: float | None = None
    store_back_s: float | None = None  # Redis faults: until the store took writes again
    used_blocks_before: int = 0
    used_blocks_after: int = 0
    rss_growth_mb: float = 0.0
    # Counters read before the fault and once idle after it (None: not exposed / not read)
    stream_stalls: int | None = None  # the front's kvserve:stream_stalls_total
    bus_dropped: int | None = None  # kvserve:bus_dropped_messages_total, every process's
    bus_dropped_by: dict[str, int] = field(default_factory=dict)  # "stream/reason": n
    evicted_keys: dict[str, int] = field(default_factory=dict)  # Redis role: keys evicted
    taken_over: int | None = None  # worker-stop: "request taken over" lines of the stopped

    def count(self, outcomes: list[Outcome], fault_start_s: float | None = None) -> None:
        """Fill in the outcomes of the fault's requests and of its calm period's (those that
        ended before the fault began at `fault_start_s`, when given: a calm request the fault
        caught in flight is no calm figure); the poisoned ones only in `poisoned`."""
        poisoned = [o for o in outcomes if o.phase == self.fault and o.fault]
        self.poisoned = dict(Counter(_how(o) for o in poisoned))
        mine = [o for o in outcomes if o.phase == self.fault and not o.fault]
        calm = [
            o
            for o in outcomes
            if o.phase == f"calm:{self.fault}"
            and not o.fault
            and (fault_start_s is None or (o.done_s is not None and o.done_s <= fault_start_s))
        ]
        counts = Counter(o.result for o in mine)
        self.sent, self.ok = len(mine), counts["ok"]
        self.wrong, self.lost = counts["wrong"], counts["lost"]
        self.failed = {k: n for k, n in counts.items() if k not in ("ok", "wrong", "lost")}
        self.failed_with_retry_after = sum(o.retry_after for o in mine)
        self.p99_ttft_s = p99([o.ttft_s for o in mine if o.ttft_s is not None])
        self.p99_ttft_calm_s = p99([o.ttft_s for o in calm if o.ttft_s is not None])


def _how(o: Outcome) -> str:
    return f"{o.result} {o.code}" if o.code else o.result


def p99(values: list[float]) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def table(result: dict[str, Any]) -> str:
    head = (
        f"{'fault':<18} {'sent':>5} {'ok':>5} {'wrong':>5} {'lost':>5}  {'failed (kind: n)':<34}"
        f" {'poisoned (how: n)':<36} {'died':>4} {'p99 TTFT / calm s':>18} {'store back s':>12}"
        f" {'blocks':>9} {'RSS MB':>7}  detail"
    )
    lines = [f"target {result['target']}", head, "-" * len(head)]
    lines += [_line(r) for r in result["faults"]]
    return "\n".join(lines)


def _line(r: dict[str, Any]) -> str:
    if r["skipped"]:
        return f"{r['fault']:<18} skipped: {r['skipped']}"
    failed = ", ".join(f"{k}: {n}" for k, n in sorted(r["failed"].items())) or "-"
    if r["failed_with_retry_after"]:
        failed += f" ({r['failed_with_retry_after']} w/ Retry-After)"
    p99, calm = r["p99_ttft_s"], r["p99_ttft_calm_s"]
    ttft = f"{p99:.2f} / {calm:.2f}" if p99 is not None and calm is not None else "-"
    back = f"{r['store_back_s']:.1f}" if r["store_back_s"] is not None else "-"
    blocks = f"{r['used_blocks_before']}->{r['used_blocks_after']}"
    return (
        f"{r['fault']:<18} {r['sent']:>5} {r['ok']:>5} {r['wrong']:>5} {r['lost']:>5}  "
        f"{failed:<34} {_poisoned(r['poisoned']):<36} {r['workers_lost']:>4} {ttft:>18} "
        f"{back:>12} {blocks:>9} {r['rss_growth_mb']:>7.1f}  {detail(r)}"
    )


def _poisoned(poisoned: dict[str, int]) -> str:
    if not poisoned:
        return "-"
    hows = ", ".join(f"{k}: {n}" for k, n in sorted(poisoned.items()))
    return f"{sum(poisoned.values())} ({hows})"


# The counters each fault is about, shown even when 0 (or not exposed: "-"); any other shows
# when it moved.
DETAIL = {"slow-reader": "stalls", "bad-message": "dropped", "redis-full": "evicted",
          "worker-stop": "taken over"}  # fmt: skip


def detail(r: dict[str, Any]) -> str:
    """The fault's own counters: stalled streams aborted, bus messages dropped, keys evicted
    per Redis, requests the stopped worker found taken over."""
    own = DETAIL.get(r["fault"])
    evicted = ", ".join(f"{k} {n}" for k, n in sorted(r["evicted_keys"].items()))
    values = {
        "stalls": r["stream_stalls"],
        "dropped": r["bus_dropped"],
        "evicted": evicted if any(r["evicted_keys"].values()) or own == "evicted" else None,
        "taken over": r["taken_over"],
    }
    parts = []
    for name, v in values.items():
        if name == own:
            parts.append(f"{name} {'-' if v is None else v}")
        elif v:
            parts.append(f"{name} {v}")
    if r["died"]:
        parts.append("died: " + " ".join(r["died"]))
    return ", ".join(parts) or "-"


# The soak's figures per minute, as columns (those a target has: a bus only in a fleet).
SOAK_COLUMNS = ("used_blocks", "cached_blocks", "evicted_blocks", "rss_mb", "fds",
                "redis_clients", "errors_logged", "store_used_mb", "bus_used_mb", "stream_len",
                "pending")  # fmt: skip


def soak_table(result: dict[str, Any]) -> str:
    soak = result.get("soak")
    if not soak:
        return ""
    keys = [k for k in SOAK_COLUMNS if k in soak["minutes"][0]] if soak["minutes"] else []
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
