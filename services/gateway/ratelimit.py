"""Per-API-key rate limiting: a token bucket per key (`--rate-limit N/s`), refilled at N tokens
a second up to a burst of max(1, N); a request that finds its bucket empty gets 429 with
Retry-After (seconds until the next token)."""

from __future__ import annotations

import math
import re
import time
from collections import OrderedDict

_SPEC = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:/\s*(s|sec|second|m|min|minute))?\s*$")
_PER = {None: 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "m": 60.0, "min": 60.0, "minute": 60.0}


def parse_rate(spec: str) -> float:
    """'10/s', '600/m' or '10' -> requests per second; ValueError for anything else."""
    m = _SPEC.match(spec)
    if m is None or float(m.group(1)) <= 0:
        raise ValueError(f"a rate limit is N/s or N/m with N > 0, got {spec!r}")
    return float(m.group(1)) / _PER[m.group(2)]


class RateLimiter:
    """Token buckets by key; at most `max_keys` buckets (the least recently used go: a bucket
    untouched that long is full again anyway)."""

    def __init__(self, rate: float, burst: float | None = None, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = burst if burst is not None else max(1.0, rate)
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key: tokens, t

    def acquire(self, key: str, now: float | None = None) -> float:
        """Take a token: 0.0 when allowed, else the seconds until one is available."""
        now = time.monotonic() if now is None else now
        tokens, last = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        wait = 0.0
        if tokens >= 1.0:
            tokens -= 1.0
        else:
            wait = (1.0 - tokens) / self.rate
        self._buckets[key] = (tokens, now)
        while len(self._buckets) > self.max_keys:
            self._buckets.popitem(last=False)
        return wait

    @staticmethod
    def retry_after(wait: float) -> int:
        return max(1, math.ceil(wait))
