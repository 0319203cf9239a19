"""Waiting in tests for a condition that another task or process makes true."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any


async def until(
    check: Callable[[], Any | Awaitable[Any]],
    what: str = "condition not met",
    timeout: float = 10.0,
    pause: float = 0.01,
) -> Any:
    """Call `check` (sync, or async such as a Redis round trip) until it returns something
    truthy, and return that; fail with `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        assert time.monotonic() < deadline, f"{what} within {timeout} s"
        await asyncio.sleep(pause)
