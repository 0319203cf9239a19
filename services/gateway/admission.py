"""Admission: a bound on in-flight generation requests, and the draining state.

`admit()` is a context manager around one generation request: it refuses (503 with
Retry-After) when `max_in_flight` requests are already admitted or the gateway is draining,
and counts the request until it leaves. `drained()` waits until none is left.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from kvserve.services.gateway.errors import APIError


class Admission:
    def __init__(self, max_in_flight: int, retry_after_s: int = 1) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        self.max_in_flight = max_in_flight
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.draining = False
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        if self.draining:
            raise APIError(
                503,
                "The server is shutting down; retry on another replica.",
                "server_error",
                None,
                "shutting_down",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        if self.in_flight >= self.max_in_flight:
            raise APIError(
                503,
                f"The server is at its limit of {self.max_in_flight} requests in flight; "
                "retry later.",
                "server_error",
                None,
                "server_overloaded",
                headers={"Retry-After": str(self.retry_after_s)},
            )
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def drained(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if `timeout` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False
