"""Warm-up jobs as the gateway tracks them: POST /v1/cache/warmup starts one on a worker (an
AdminRequest on the bus), the job's events update its counters, GET /v1/cache/warmup/{id}
reads them. The gateway remembers the running jobs and the latest finished ones."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from kvserve.shared.bus.base import EventStream
from kvserve.shared.tasks import cancel_all
from kvserve.shared.telemetry import get_logger

log = get_logger("kvserve.gateway")

COUNTERS = ("done", "blocks", "computed", "skipped", "published")


@dataclass
class WarmupJob:
    id: str
    total: int
    status: str = "running"  # running | completed | failed
    error: str | None = None
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    task: asyncio.Task[None] | None = None

    def fail(self, message: str) -> None:
        self.status = "failed"
        self.error = message

    def view(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "object": "cache.warmup",
            "status": self.status,
            "total": self.total,
            **self.counts,
        }
        if self.error is not None:
            out["error"] = self.error
        return out

    async def follow(self, stream: EventStream) -> None:
        """Read the job's events until it ends: completed when every prefix is done, failed
        on an error event, an early end, or the gateway stopping."""
        try:
            async with stream:
                async for ev in stream:
                    if ev.error is not None:
                        self.fail(ev.error.message)
                        return
                    if ev.info:
                        self.counts.update(
                            {k: int(ev.info[k]) for k in self.counts if k in ev.info}
                        )
            if self.counts["done"] >= self.total:
                self.status = "completed"
            else:
                self.fail("the job ended early")
        except asyncio.CancelledError:
            self.fail("the gateway stopped")
            raise
        except Exception as e:
            log.exception("warm-up job failed", job=self.id)
            self.fail(f"{type(e).__name__}: {e}")
        finally:
            log.info("warm-up job finished", job=self.id, status=self.status, **self.counts)


class WarmupJobs:
    """The jobs by id: every running one, and at most `max_finished` finished ones (the
    oldest forgotten first)."""

    def __init__(self, max_finished: int) -> None:
        self.max_finished = max_finished
        self._jobs: dict[str, WarmupJob] = {}

    def get(self, job_id: str) -> WarmupJob | None:
        return self._jobs.get(job_id)

    def start(self, job: WarmupJob, stream: EventStream) -> None:
        """Follow the job's events in a task of its own, and remember it."""
        job.task = asyncio.create_task(job.follow(stream), name=job.id)
        self._jobs[job.id] = job
        done = [j for j in self._jobs.values() if j.status != "running"]
        for old in done[: max(0, len(done) - self.max_finished)]:
            del self._jobs[old.id]

    async def cancel(self) -> None:
        """Stop following every job (the gateway is shutting down)."""
        await cancel_all(j.task for j in self._jobs.values() if j.task is not None)
