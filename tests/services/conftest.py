"""Fixtures of the service tests: `start_server(*args)` starts `kvserve serve` (module scope);
`services_engine` is the default model in this process (64 blocks), shared by the modules."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.services.kvserve_process import ServeProcess


@pytest.fixture(scope="module")
def start_server(model_path: Path) -> Iterator[Callable[..., ServeProcess]]:
    """start_server(*args, env=...) -> a ready ServeProcess, stopped at module end."""
    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServeProcess:
        p = ServeProcess(["--model", str(model_path), *args], env)
        started.append(p)
        return p.wait_ready()

    yield start
    for p in started:
        p.stop()


@pytest.fixture(scope="session")
def services_engine(make_engine: Callable[..., Any]) -> Any:
    """One Engine for the greedy comparisons and the worker tests (used by one thread at a
    time: a worker's AsyncEngine thread stops at the end of its test)."""
    return make_engine(num_blocks=64)
