"""Stopping asyncio tasks that talk to Redis.

Python 3.11's `asyncio.wait_for` returns its inner result instead of raising when the task
around it is cancelled in the same loop iteration as the inner future completes (CPython
gh-86296, fixed in 3.12 by rebuilding `wait_for` on `asyncio.timeout`). redis-py wraps every
socket write in `wait_for(..., socket_timeout)`, so a `task.cancel()` that lands while a
command is being written can be lost: the task goes on as if nothing happened, and whoever
awaits it after cancelling waits for as long as it runs (a loop: for ever).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

# How long to wait for a cancelled task before cancelling it again: long enough for the
# clean-up a task runs on cancellation (a Redis round trip or two: an error event, an ack) to
# finish before another cancellation could interrupt it.
RECANCEL_S = 1.0


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel `task` and return once it has ended, cancelling it again for as long as it
    runs. Its CancelledError is swallowed; any other exception it ended with is raised."""
    while not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=RECANCEL_S)
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def cancel_all(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """`cancel_and_wait` for each task, concurrently; their exceptions are dropped (the
    caller is stopping them, not reading their results)."""
    await asyncio.gather(*(cancel_and_wait(t) for t in tasks), return_exceptions=True)
