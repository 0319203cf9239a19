"""Build a small C++ kernel for the CPU once, with torch's cpp_extension, keyed by this CPU.

Binaries are compiled with -march=native, so the module name carries a hash of the CPU's flags
and the source: another machine (or a changed kernel) builds its own. A machine where the build
fails (no compiler, no ninja) gets None, logged once per kernel, and the caller falls back to
torch.
"""

from __future__ import annotations

import hashlib
import logging
import platform
from typing import Any

log = logging.getLogger(__name__)

CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]

# 16-float vectors for the kernels' inner loops, in GCC/Clang vector extensions: one AVX-512
# register, two AVX2 ones, whatever -march=native gives. Loads and stores are unaligned.
SIMD = r"""
#include <cstring>
typedef float v16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline __attribute__((always_inline)) void store16(float* p, v16 v) {
  std::memcpy(p, &v, sizeof v);
}
static inline __attribute__((always_inline)) float hsum(v16 v) {
  typedef float v8 __attribute__((vector_size(32)));
  typedef float v4 __attribute__((vector_size(16)));
  const v8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
               __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  const v4 b =
      __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  return (b[0] + b[2]) + (b[1] + b[3]);
}
"""


def cpu_tag(source: str) -> str:
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        flags = ""
    return hashlib.sha256((platform.machine() + flags + source).encode()).hexdigest()[:12]


def load(name: str, source: str, functions: list[str]) -> Any | None:
    """The compiled module `kvserve_{name}_{tag}` exposing `functions`, or None."""
    from torch.utils.cpp_extension import load_inline

    try:
        return load_inline(
            name=f"kvserve_{name}_{cpu_tag(source)}",  # under torch's extensions directory
            cpp_sources=[source],
            functions=functions,
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no ninja, ...: the caller falls back to torch
        log.warning("CPU kernel %s unavailable (%s); using torch", name, e)
        return None
