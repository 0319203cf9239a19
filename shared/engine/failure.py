"""Failure containment: what a failing request or step costs the engine.

- A request failure: an exception raised while one request's outputs were processed (its
  sampling, stop strings, detokenization, logprobs, beam) is pinned on that request
  (`RequestFailure`); the request alone fails and the rest of the step goes on.
- A step failure: an exception no request can be blamed for (the batch's forward). The step's
  requests are requeued for recompute; one that was in `quarantine_after` failed steps is
  failed instead (quarantined). `StepFailures` counts them in a sliding window; past its
  bound the engine is dead (`EngineDeadError`) and its process should be restarted.
- Fault injection (`SamplingParams.fault`, only when the engine allows it): the faults above,
  and "kill", on purpose, for tests and `kvserve bench chaos`.
"""

from __future__ import annotations

import os
import signal
import time
from collections import deque
from collections.abc import Iterable

from kvserve.shared.sampling_params import SamplingParams


class RequestFailedError(RuntimeError):
    """A request the engine failed: `kind` is "internal_error" (an exception in its own
    processing, or its step failed) or "quarantined" (it was in too many failed steps)."""

    def __init__(self, request_id: str, kind: str, cause: str) -> None:
        what = "quarantined after repeated failures" if kind == "quarantined" else "failed"
        super().__init__(f"request {request_id} {what}: {cause}")
        self.request_id = request_id
        self.kind = kind


class EngineDeadError(RuntimeError):
    """Too many steps failed in a short time: the engine stops taking work."""


class InjectedFault(RuntimeError):
    """A fault a request asked for (SamplingParams.fault)."""


def describe(error: BaseException) -> str:
    return f"{type(error).__name__}: {error}"


class StepFailures:
    """Unattributable step failures within the last `window_s` seconds."""

    def __init__(self, limit: int, window_s: float) -> None:
        self.limit = limit
        self.window_s = window_s
        self.total = 0
        self._times: deque[float] = deque()

    def record(self, now: float | None = None) -> bool:
        """Count one failure; True when the window now holds more than the limit allows."""
        now = time.monotonic() if now is None else now
        self.total += 1
        self._times.append(now)
        while self._times and now - self._times[0] > self.window_s:
            self._times.popleft()
        return len(self._times) >= self.limit


def inject_step_faults(params: Iterable[SamplingParams]) -> None:
    """The faults that strike a whole step: "kill" ends this process at once (as a crash in a
    native kernel would), "raise-step" fails the step's forward."""
    faults = {p.fault for p in params}
    if "kill" in faults:
        os.kill(os.getpid(), signal.SIGKILL)
    if "raise-step" in faults:
        raise InjectedFault("the step's forward failed (fault injected)")


def inject_request_fault(params: SamplingParams) -> None:
    """The fault that strikes one request's output processing."""
    if params.fault == "raise":
        raise InjectedFault("processing the request's output failed (fault injected)")
