"""CircuitBreaker: protects the engine from a slow or dead store.

States and transitions (the breaker owns only state; the store owns the probe):

- ``closed``: calls go through. ``failure_threshold`` consecutive failures open it; any success
  resets the count.
- ``open``: calls are short-circuited (the store answers misses and skips writes). Once
  ``cooldown_s`` has passed on the injected ``clock``, ``begin_probe()`` hands exactly one caller
  the right to probe and moves to ``half_open``.
- ``half_open``: one probe is in flight; every other call is still short-circuited.
  ``probe_succeeded()`` closes the breaker, ``probe_failed()`` reopens it and restarts the cooldown.

Only transport failures (connection refused/reset, timeouts) count; a server that answers, even with
an error, is reachable and must not open the breaker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    def __init__(
        self,
        failure_threshold: int = 5,
        cooldown_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError("failure_threshold must be >= 1")
        self.failure_threshold = failure_threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state: State = "closed"
        self._consecutive_failures = 0
        self._opened_at = 0.0
        self.opens = 0
        self.probes = 0
        self.probe_failures = 0

    @property
    def state(self) -> State:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state == "closed"

    @property
    def consecutive_failures(self) -> int:
        return self._consecutive_failures

    def record_success(self) -> None:
        if self._state == "closed":
            self._consecutive_failures = 0

    def record_failure(self) -> None:
        if self._state != "closed":
            return
        self._consecutive_failures += 1
        if self._consecutive_failures >= self.failure_threshold:
            self._open()

    def probe_due(self) -> bool:
        return self._state == "open" and self._clock() - self._opened_at >= self.cooldown_s

    def begin_probe(self) -> bool:
        """True for the single caller that must now run the probe (state becomes half_open)."""
        if not self.probe_due():
            return False
        self._state = "half_open"
        self.probes += 1
        return True

    def probe_succeeded(self) -> None:
        self._state = "closed"
        self._consecutive_failures = 0

    def probe_failed(self) -> None:
        self.probe_failures += 1
        self._open()

    def _open(self) -> None:
        if self._state != "open":
            self.opens += 1
        self._state = "open"
        self._opened_at = self._clock()

    def stats(self) -> dict[str, object]:
        return {
            "breaker_state": self._state,
            "breaker_opens": self.opens,
            "breaker_probes": self.probes,
            "breaker_probe_failures": self.probe_failures,
            "consecutive_failures": self._consecutive_failures,
        }
