"""The C++ kernels build as one module that exports every kernel module's functions."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
from kvserve.kernels import cpp_build

pytestmark = pytest.mark.skipif(cpp_build.extension() is None, reason="no C++ toolchain")


@pytest.mark.parametrize("name", cpp_build.KERNELS)
def test_each_kernel_module_uses_the_one_module(name: str) -> None:
    module = importlib.import_module(f"kvserve.kernels.{name}")
    ext = module._extension()
    assert ext is cpp_build.extension()
    for fn in module.FUNCTIONS:
        assert callable(getattr(ext, fn)), fn


def test_every_body_sits_in_its_own_namespace() -> None:
    source, functions = cpp_build.combined_source()
    assert "#include" not in source.split(cpp_build.HEADERS, 1)[1]
    for name in cpp_build.KERNELS:
        assert f"namespace {name} {{" in source
    assert len(functions) == len(set(functions))


def test_the_setup_entry_point_reports_the_build() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvserve.kernels.cpp_build"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("CPU kernels ready")
