"""Run by test_cpp_build.py in a child process: load the tiny extension from DIR (building it
where needed) and print {"answer": its answer(), or null where it did not load} as JSON.

usage: python build_probe.py DIR [EXTRA_CFLAG ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from kvserve.kernels.cpp_build import Recipe, load_or_build

TINY = Path(__file__).with_name("tiny_ext.cpp")


def recipe(*extra_cflags: str) -> Recipe:
    return Recipe("tiny", TINY, (), ("-O1", "-fPIC", *extra_cflags), torch=False)


if __name__ == "__main__":
    module = load_or_build(recipe(*sys.argv[2:]), Path(sys.argv[1]))
    print(json.dumps({"answer": module.answer() if module is not None else None}))
