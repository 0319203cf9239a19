"""Fixtures of the service tests: `start_server(*args)` starts `kvserve serve` (module scope,
the shared harness's ServerProcess, ready at its `ready` log event); `services_engine` is the
default model in this process (64 blocks), shared by the modules."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kvserve.services.bench.lib.process import ServerProcess, kvserve_process

SERVE = ("serve", "--port", "0")


@pytest.fixture(scope="module")
def start_server(model_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """start_server(*args, env=...) -> a ready ServerProcess, stopped at module end; on the
    device KVSERVE_TEST_DEVICE names (default: the CPU)."""
    started: list[ServerProcess] = []
    device = os.environ.get("KVSERVE_TEST_DEVICE", "cpu")

    def start(*args: str, env: dict[str, str] | None = None) -> ServerProcess:
        cmd = ["--model", str(model_path), "--device", device, *args]
        p = kvserve_process(SERVE, cmd, env=env)
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
