"""The engine's helper thread (the emitter): jobs run on it, in order; a job's value or its
exception reaches the waiter; shutdown lets the jobs handed over run first."""

from __future__ import annotations

import threading

import pytest
from kvserve.shared.engine.helper_thread import HelperThread


def test_jobs_run_on_the_helper_in_order_and_their_values_and_errors_reach_the_waiter() -> None:
    helper = HelperThread("kvserve-test-helper")
    ran: list[tuple[int, str]] = []
    gate = threading.Event()

    def job(i: int) -> int:
        if i == 0:
            assert gate.wait(10)
        ran.append((i, threading.current_thread().name))
        if i == 2:
            raise ValueError("job 2")
        return i * 10

    pending = [helper.submit(lambda i=i: job(i)) for i in range(4)]  # type: ignore[misc]
    assert ran == []  # the first job holds the rest back: none ran on this thread
    gate.set()
    assert pending[3].result() == 30
    assert pending[0].result() == 0 and pending[1].result() == 10
    with pytest.raises(ValueError, match="job 2"):
        pending[2].result()
    with pytest.raises(ValueError, match="job 2"):  # asked again, the same outcome
        pending[2].result()
    assert ran == [(i, "kvserve-test-helper") for i in range(4)]
    late = helper.submit(lambda: ran.append((9, "")))
    helper.shutdown()
    assert ran[-1] == (9, "") and late.result() is None
    assert helper.submit(lambda: 5).result() == 5  # a new thread after a shutdown
    helper.shutdown()


def test_the_thread_holds_no_job_that_ran_and_ends_with_its_owner() -> None:
    """A job referring to its owner (the engine's emitter runs the engine's methods) does not
    keep it alive once it ran; the thread ends once the helper is collected."""
    import gc
    import weakref

    class Owner:
        def __init__(self) -> None:
            self.helper = HelperThread("kvserve-test-owner")

        def work(self) -> int:
            return 7

    owner = Owner()
    assert owner.helper.submit(owner.work).result() == 7
    thread = owner.helper._thread
    assert thread is not None
    gone = weakref.ref(owner)
    gc.disable()
    try:
        del owner
        assert gone() is None  # the thread kept nothing of the job, nor of its owner
    finally:
        gc.enable()
    thread.join(10)
    assert not thread.is_alive()
