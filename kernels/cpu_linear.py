"""y = x @ W.T in fp32 on the CPU over a weight packed once into column panels.

`pack` lays W [N, K] out as panels of NR output columns, [ceil(N / NR), K, NR] (zero-padded):
each panel is one contiguous stream, and a row of it holds the NR weights that one x value
multiplies. A tile of MR rows of x times one panel keeps its MR x NR sums in vector registers
over all of K: per k, NR / VW vector loads of the panel, MR broadcasts of x and MR * NR / VW
fused multiply-adds (AVX-512: MR = 8, NR = 48, 24 accumulators; AVX2: MR = 6, NR = 16). The
threads take contiguous ranges of panels; a panel is read from memory once and from cache by
its other row tiles, and while a panel's tiles run, the next panel is prefetched towards L2, a
slice per tile. A single row (decode at batch 1) takes four panels at a time instead, so that
four streams of loads are in flight: one panel's stream alone leaves the row waiting on memory.

Every output element is one lane's sequential sum over k, whatever the tile height and whatever
other rows share the call: a sequence's result is bit-identical alone or in any batch.

With AVX-512 it is faster than oneDNN's prepacked GEMM at decode batch sizes and as fast at
prefill sizes, so it takes every input; with AVX2 oneDNN is faster above MAX_ROWS rows, so
those go to oneDNN there (`max_rows()`; figures in docs/benchmarks.md, engine decision records).
With AVX2 the sum over k is also taken as oneDNN takes it there, in runs of 1,024 k whose sums
are then added in turn, so that a row gets the same bits from either (a K of 1,536 summed in
one run differed from oneDNN's in ~94% of the outputs, and an int8 KV cache turned that into
another greedy answer for a question after a cached prefix than for the whole prompt).
`available()` is False where the kernel cannot be built: the caller uses oneDNN.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from kvserve.kernels import cpp_build

UNBOUNDED = -1


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


@functools.cache
def _geometry() -> tuple[int, int, int]:
    ext = _extension()
    assert ext is not None
    panel, tile, max_rows = ext.geometry()
    return panel, tile, max_rows


def tile_rows() -> int:
    """MR: the rows of x one tile computes."""
    return _geometry()[1]


def panel_width() -> int:
    """NR: the output columns of one panel."""
    return _geometry()[0]


def max_rows() -> int | None:
    """Rows of x above which oneDNN is faster with this machine's vector width; None: the
    kernel is for any number of rows."""
    rows = _geometry()[2]
    return None if rows == UNBOUNDED else rows


def pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] fp32 -> its panels [ceil(N / NR), K, NR], zero-padded to whole panels."""
    n, k = weight.shape
    nr = panel_width()
    panels = -(-n // nr)
    padded = F.pad(weight.float(), (0, 0, 0, panels * nr - n))
    return padded.view(panels, nr, k).transpose(1, 2).contiguous()


def linear(
    x: torch.Tensor, packed: torch.Tensor, out_features: int, any_rows: bool = False
) -> torch.Tensor | None:
    """x [M, K] @ W.T for W packed by `pack`, or None where this input is not for the kernel
    (not fp32 on the CPU, more than max_rows() rows unless `any_rows`, no compiled kernel)."""
    ext = _extension()
    if ext is None or x.dtype != torch.float32 or not x.is_cpu or x.dim() != 2:
        return None
    limit = max_rows()
    if limit is not None and x.shape[0] > limit and not any_rows:
        return None
    out: torch.Tensor = ext.linear(x.contiguous(), packed, out_features)
    return out
