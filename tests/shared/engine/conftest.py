"""Fixtures of the engine tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """The engine's ops are tiny: on a shared 2-core machine two OpenMP threads wait on each
    other in every op (about 15x slower than one). A module that uses it (`pytestmark`) runs
    on one thread."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
