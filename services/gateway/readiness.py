"""Readiness: whether a request can be served now, as /ready answers and as the routes that
need a worker (generation, warm-up, flush) check before they submit anything to the bus."""

from __future__ import annotations

from kvserve.services.gateway.errors import APIError
from kvserve.shared.bus.base import Bus, BusUnavailableError


class Readiness:
    """Asks the bus each time (no cached state): a worker may come or go between requests.
    `dead` (a reason) is set once by a process whose own engine failed (`kvserve serve`): its
    /health then answers 503 until the process exits."""

    def __init__(self, bus: Bus, retry_after_s: int) -> None:
        self.bus = bus
        self.retry_after_s = retry_after_s
        self.dead: str | None = None

    async def status(self) -> str:
        """ready, starting (no live worker) or bus_unavailable (Redis down: nobody can tell)."""
        try:
            return "ready" if await self.bus.ready() else "starting"
        except BusUnavailableError:
            return "bus_unavailable"

    async def serving(self) -> str:
        """What /ready answers: `status()`, and "starting" while the live workers cannot serve a
        request between them: prefill workers without a decode one, or the reverse (the
        disaggregated topology needs both roles). So a container's or a pod's readiness, and
        compose's `up --wait`, mean "answers requests". Workers that have not described
        themselves yet count as able to serve (a bus that does not say their roles)."""
        status = await self.status()
        if status != "ready":
            return status
        try:
            roles = {info.role for info in (await self.bus.workers()).values()}
        except Exception:  # the bus failed between the two calls: nobody can tell
            return "bus_unavailable"
        complete = not roles or "worker" in roles or {"prefill", "decode"} <= roles
        return "ready" if complete else "starting"

    async def require_worker(self) -> None:
        """Return when a worker is ready; else 503 with Retry-After."""
        status = await self.status()
        if status != "ready":
            bus_down = status == "bus_unavailable"
            raise APIError(
                503,
                "The event bus (Redis) is unreachable; retry shortly."
                if bus_down
                else "No engine worker is ready yet; retry shortly.",
                "server_error",
                None,
                "bus_unavailable" if bus_down else "not_ready",
                headers={"Retry-After": str(self.retry_after_s)},
            )
