"""Waiting for observable state under a deadline, never for an assumed time: `poll_until` a
condition holds, `server_ready` for a server's readiness URL (and a gateway's live workers)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvserve.services.bench.lib.http import Http, gateway_stats


def poll_until(check: Callable[[], Any], timeout: float = 10.0, interval: float = 0.02) -> Any:
    """Re-evaluate `check` until it returns something truthy (a condition on observable state,
    under a deadline) and return that; AssertionError with the last value otherwise."""
    deadline = time.monotonic() + timeout
    value = check()
    while not value:
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s (last: {value!r})")
        time.sleep(interval)
        value = check()
    return value


def answers_ok(url: str, timeout: float = 5.0) -> bool:
    """Does `url` answer GET with 200 (False while nothing listens, or on an error status)?"""
    try:
        return Http(url, timeout=timeout).get("").status_code == 200
    except OSError:
        return False


def server_ready(base_url: str, ready_url: str, workers: int = 0) -> bool:
    """Does `ready_url` answer 200 and, for a kvserve gateway given `workers`, does it list at
    least that many live workers?"""
    if not answers_ok(ready_url):
        return False  # not listening yet, or 503 while loading
    live = gateway_stats(base_url).get("workers") if workers else None
    return not workers or len(live or {}) >= workers
