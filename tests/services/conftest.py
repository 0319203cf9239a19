"""Fixtures of the service tests: `start_server(*args)` starts `kvserve serve` (module scope)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

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
