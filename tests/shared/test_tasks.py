"""cancel_and_wait ends a task that lost a cancellation (as Python 3.11's wait_for loses one
inside redis-py), without cutting short the clean-up of a task that got it."""

from __future__ import annotations

import asyncio
import sys

import pytest
from kvserve.shared import tasks
from kvserve.shared.tasks import cancel_all, cancel_and_wait


async def test_a_cancellation_lost_in_wait_for_is_repeated_until_the_task_ends() -> None:
    """The CPython race itself: the task is cancelled in the loop iteration in which the
    future its wait_for waits on completes (redis-py: a socket write that has just finished)."""
    written: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    forever = asyncio.Event()
    went_on = asyncio.Event()

    async def heartbeat() -> None:
        while True:
            await asyncio.wait_for(written, 30)
            went_on.set()
            await forever.wait()

    task = asyncio.create_task(heartbeat())
    await asyncio.sleep(0)  # the task now waits in wait_for
    written.set_result(None)
    task.cancel()
    if sys.version_info < (3, 12):  # the bug this module exists for
        await asyncio.wait_for(went_on.wait(), 5)
        assert not task.done()
    await asyncio.wait_for(cancel_and_wait(task), 10)
    assert task.cancelled()


async def test_a_task_that_swallows_a_cancellation_is_cancelled_again() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                swallowed += 1
                if swallowed == 3:
                    raise

    task = asyncio.create_task(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_and_wait(task), 10)
    assert swallowed == 3 and task.cancelled()


async def test_clean_up_after_a_cancellation_is_not_cut_short() -> None:
    """A task that got its cancellation and awaits something in its clean-up (an error event,
    an ack) is not cancelled again while it does, within RECANCEL_S."""
    cleaning = asyncio.Event()
    release = asyncio.Event()
    cleaned = False

    async def request() -> None:
        nonlocal cleaned
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cleaning.set()
            await release.wait()
            cleaned = True
            raise

    task = asyncio.create_task(request())
    await asyncio.sleep(0)
    stopper = asyncio.create_task(cancel_and_wait(task))
    await cleaning.wait()
    release.set()
    await asyncio.wait_for(stopper, 10)
    assert cleaned and task.cancelled()
    assert tasks.RECANCEL_S >= 0.5  # a Redis round trip or two fits in it


async def test_an_exception_the_task_ends_with_is_raised_and_cancel_all_drops_it() -> None:
    async def failing() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise RuntimeError("clean-up failed") from None

    task = asyncio.create_task(failing())
    await asyncio.sleep(0)
    with pytest.raises(RuntimeError, match="clean-up failed"):
        await cancel_and_wait(task)
    done = asyncio.create_task(asyncio.sleep(0))
    await done
    others = [asyncio.create_task(failing()) for _ in range(3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(cancel_all([*others, done]), 10)
    assert all(t.done() for t in others)
