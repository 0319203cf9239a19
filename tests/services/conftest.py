"""Fixtures of the service tests: `start_server(*args)` starts `kvserve serve` (module scope,
the shared harness's ServerProcess, ready at its `ready` log event); `services_engine` is the
default model in this process (64 blocks), shared by the modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.bench.lib.process import ServerProcess, kvserve_process

SERVE = ("serve", "--port", "0")


@pytest.fixture(scope="module")
def start_server(model_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(*args, env=...) -> a ready ServerProcess, stopped at module end."""
    started: list[ServerProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        p = kvserve_process(SERVE, ["--model", str(model_path), *args], env=env)
        started.append(p)
        return p.spawn().wait_ready()

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def services_engine(make_engine: Callable[..., Any]) -> Any:
    """One Engine for the greedy comparisons and the worker tests (used by one thread at a
    time: a worker's AsyncEngine thread stops at the end of its test)."""
    return make_engine(num_blocks=64)
