"""`Fleet`: the kvserve processes of one deployment (a gateway or a `serve`, and its workers),
each a `ServerProcess`, spawned, signalled, restarted and stopped by name. The Redis they meet
on belongs to the caller."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from kvserve.services.bench.lib.process import (
    STOP_GRACE_S,
    Readiness,
    ServerProcess,
    kvserve_process,
)


class Fleet:
    """Named processes `kvserve COMMAND [--model MODEL] ARGS`; `log_dir` keeps NAME.log of each.

    `procs` holds the latest process of each name: `process` of a name in use replaces one that
    has ended (a restart keeps its log). `stop` ends every process, all at once."""

    def __init__(self, model: Path | str | None = None, log_dir: Path | None = None) -> None:
        self.model = model
        self.log_dir = log_dir
        self.procs: dict[str, ServerProcess] = {}

    def process(
        self,
        name: str,
        command: Sequence[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        ready: Readiness | None = None,
        url: str = "",
    ) -> ServerProcess:
        """The named process, registered, not spawned (`.spawn()`, then `wait_ready`)."""
        model = ["--model", str(self.model)] if self.model is not None else []
        log = self.log_dir / f"{name}.log" if self.log_dir is not None else None
        p = kvserve_process(
            command, [*model, *args], name=name, ready=ready, url=url, log=log, env=env
        )
        self.procs[name] = p
        return p

    def __iter__(self) -> Iterator[ServerProcess]:
        return iter(list(self.procs.values()))

    def wait_ready(self, timeout: float | None = None) -> None:
        """Every process ready (they load in parallel; each under its own deadline)."""
        for p in self:
            p.wait_ready() if timeout is None else p.wait_ready(timeout)

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM to every process, then each reaped (SIGKILL after `grace` seconds)."""
        for p in self:
            p.terminate()
        for p in self:
            p.reap(grace)

    def rss_mb(self) -> float:
        return sum(p.rss_mb() for p in self)

    def open_fds(self) -> int:
        return sum(p.open_fds() for p in self)
