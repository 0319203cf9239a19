"""Host memory on transparent huge pages, for what a decode step streams: the weights and the
KV cache.

A batch-1 decode step reads every weight once (96 MB for the default model) in ~120 matrices
of 0.2-1 MB. On 4 KiB pages each 4 KiB of them is a TLB miss and a page walk, and the
hardware prefetcher stops at every page's end; on 2 MiB pages neither happens. The model's
linear layers chained at one row read their weights ~11% faster from one huge-page mapping
than from torch's allocations (docs/benchmarks.md, "Huge pages and a call's fixed cost").

Where the kernel offers no transparent huge pages (disabled, or not Linux) the memory is the
same mapping on ordinary pages: nothing else changes.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import cast

import torch

HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
ALIGN = 64  # each gathered tensor starts on a cache line
# Linux's madvise(2) advice "fault every page in, writable, now" (5.14+; Python 3.11's mmap
# module predates its constant).
MADV_POPULATE_WRITE = 23
_POPULATE_CHUNK = 64 << 20


def mapping(nbytes: int) -> torch.Tensor:
    """`nbytes` zero bytes (uint8) in a fresh private anonymous mapping advised onto huge pages,
    starting on a huge page's boundary, not yet resident. Private, not mmap's default shared
    mapping, which a forked child would share; the tensor holds a reference to the mapping,
    which is unmapped when the last view of it is freed."""
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.uint8)
    # A huge page backs only a whole aligned 2 MiB of the mapping: map one more and start on
    # the first boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advise_huge_pages(region)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    start = -raw.data_ptr() % HUGE_PAGE
    return raw[start : start + nbytes]


def advise_huge_pages(region: mmap.mmap) -> bool:
    """madvise(MADV_HUGEPAGE) on the whole mapping; False where the platform or the kernel
    has no transparent huge pages (the pages stay ordinary)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # EINVAL: a kernel built without them
        return False
    return True


@functools.cache
def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """madvise(2) through ctypes, which releases the GIL for the call (mmap.madvise holds it,
    and populating gigabytes takes seconds)."""
    if not sys.platform.startswith("linux"):
        return None
    fn = ctypes.CDLL(None, use_errno=True).madvise
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return cast(Callable[[int, int, int], int], fn)


def make_resident(tensors: Sequence[torch.Tensor], stop: threading.Event | None = None) -> bool:
    """Fault in the CPU tensors' pages, writable, 64 MiB per call (`stop` ends it between
    calls), never changing what they hold. False where the kernel lacks MADV_POPULATE_WRITE;
    MemoryError where the memory is not there."""
    madvise = _libc_madvise()
    if madvise is None:
        return False
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0:
            continue
        flat = t.view(-1).view(torch.uint8)
        for start in range(0, flat.numel(), _POPULATE_CHUNK):
            if stop is not None and stop.is_set():
                return True
            chunk = flat[start : start + _POPULATE_CHUNK]
            if madvise(chunk.data_ptr(), chunk.numel(), MADV_POPULATE_WRITE):
                err = ctypes.get_errno()
                if err == errno.EINVAL:  # an older kernel
                    return False
                raise MemoryError(f"cannot reserve memory: {os.strerror(err)}")
    return True


def aligned(nbytes: int) -> int:
    """`nbytes` rounded up to whole cache lines: the room a tensor takes in an Arena."""
    return -(-nbytes // ALIGN) * ALIGN


class Arena:
    """One `mapping`, made resident before anything is written to it, that contiguous CPU
    tensors are copied into in turn, each on a cache line after the one before. Populated in
    one call first: faulted in while being copied into, a 96 MB mapping took ~150 ms on huge
    pages, populated first 12 ms plus 8 ms of copy (`xeon-167`)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        """Room for `tensors` (only their sizes are read)."""
        self.memory = mapping(sum(aligned(t.numel() * t.element_size()) for t in tensors))
        make_resident([self.memory])
        self.offset = 0

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """A copy of `t` at the next free offset."""
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError("only contiguous CPU tensors are placed in a mapping")
        nbytes = t.numel() * t.element_size()
        copy = self.memory[self.offset : self.offset + nbytes].view(t.dtype).view(t.shape)
        copy.copy_(t)
        self.offset += aligned(nbytes)
        return copy


def gather(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of the contiguous CPU `tensors` in one Arena, in order (a step that reads them in
    this order walks the mapping front to back)."""
    arena = Arena(tensors)
    return [arena.place(t) for t in tensors]
