"""The paged KV cache tensors. Held by the KVCacheManager, which reads and writes whole blocks
(and closes it); the ModelRunner runs the model over it, which writes each step's tokens. Block
ids come from the BlockPool.

Per layer one K and one V tensor [num_blocks, block_size, num_kv_heads, head_dim] in the cache
dtype; for int8 / fp8 also per-(token, head) float32 scales [num_blocks, block_size, kv_heads].
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import threading
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from kvserve.kernels import cpu_ops
from kvserve.shared.config import POPULATE_MODES, ModelConfig
from kvserve.shared.model import huge_pages
from kvserve.shared.model.huge_pages import make_resident
from kvserve.shared.store.block_data import QUANTIZED_KV_DTYPES, BlockData

if TYPE_CHECKING:
    from kvserve.shared.store.codec import FrameTemplate

log = logging.getLogger(__name__)


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return model_dtype if kv_dtype == "auto" else QUANTIZED_KV_DTYPES[kv_dtype]


def kv_dtype_name(dtype: torch.dtype) -> str:
    """CacheConfig.kv_dtype of a cache of `dtype`: "int8" / "fp8", or "auto" (the model's)."""
    return next((n for n, d in QUANTIZED_KV_DTYPES.items() if d == dtype), "auto")


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of K and V (and scales, when quantized) one token occupies across all layers."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * config.num_kv_heads * config.head_dim * elem
    if dtype in QUANTIZED_KV_DTYPES.values():
        per_layer += 2 * config.num_kv_heads * 4
    return per_layer * config.num_layers


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.zeros, except that on the CPU the memory is a fresh mapping on transparent huge
    pages (huge_pages.mapping), not yet resident: `make_resident` makes it so. A cache populated
    ahead of use reserves its memory as a GPU server reserves its KV memory, and no step waits
    for the kernel to fault in the pages of the blocks it writes."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_pages.mapping(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)


def idle_priority() -> bool:
    """Run the calling thread only on CPU time no other thread wants (Linux's SCHED_IDLE),
    so that a background population never slows the steps of a server that already serves
    (the page faults are kernel work charged to this thread). False where the platform has no
    such policy."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))  # 0: this thread
    except (AttributeError, OSError):
        return False
    return True


# The threads still faulting in a cache's pages, each with the event that stops it. A process
# that exits meanwhile stops them first: one that wakes up inside a call while the interpreter
# finalizes aborts it.
_populating: dict[threading.Thread, threading.Event] = {}
_populating_lock = threading.Lock()


@atexit.register
def _stop_populating() -> None:
    with _populating_lock:
        running = list(_populating.items())
    for thread, stop in running:
        stop.set()
        thread.join()


def _populate_in_background(tensors: list[torch.Tensor], stop: threading.Event) -> None:
    """A background population's thread. It holds the tensors and not their cache, so that a
    cache dropped meanwhile is freed at once (its finalizer stops this thread), however long a
    busy machine keeps this idle-priority thread from running."""
    idle_priority()
    try:  # an older kernel: the pages are faulted in as blocks are written
        make_resident(tensors, stop)
    except MemoryError as e:
        log.warning("%s; the cache's pages are faulted in as blocks are written", e)
    finally:
        with _populating_lock:
            _populating.pop(threading.current_thread(), None)


class KVCache:
    """`populate` says when a CPU cache's memory becomes resident: "eager" before the
    constructor returns (MemoryError if it is not there), "background" in a daemon thread
    while the engine already runs (a server starts serving at once; the thread ends when done
    or at `close`), "lazy" page by page as blocks are first written (a one-shot command that
    touches a few blocks of a large cache)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        populate: str = "eager",
    ) -> None:
        if populate not in POPULATE_MODES:
            raise ValueError(f"populate must be one of {POPULATE_MODES}, got {populate!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.k = [zeros(shape, dtype, device) for _ in range(config.num_layers)]
        self.v = [zeros(shape, dtype, device) for _ in range(config.num_layers)]
        self.quantized = dtype in QUANTIZED_KV_DTYPES.values()
        scale_shape = shape[:3]
        self.k_scale: list[torch.Tensor | None] = [
            torch.ones(scale_shape, dtype=torch.float32, device=device) if self.quantized else None
            for _ in range(config.num_layers)
        ]
        self.v_scale: list[torch.Tensor | None] = [
            torch.ones(scale_shape, dtype=torch.float32, device=device) if self.quantized else None
            for _ in range(config.num_layers)
        ]
        self._stop_populating = threading.Event()
        self._populating: threading.Thread | None = None
        if populate == "eager" and not make_resident(self.k + self.v):
            for t in self.k + self.v:  # an older kernel: touch every page by writing it
                t.zero_()
        elif populate == "background":
            self._populating = threading.Thread(
                target=_populate_in_background,
                args=(self.k + self.v, self._stop_populating),
                name="kv-populate",
                daemon=True,
            )
            with _populating_lock:
                _populating[self._populating] = self._stop_populating
            weakref.finalize(self, self._stop_populating.set)
            self._populating.start()

    def close(self) -> None:
        """Stop a background population (the tensors stay valid)."""
        self._stop_populating.set()
        if self._populating is not None:
            self._populating.join()

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write: make block `dst` hold what `src` holds, in every layer."""
        for layer in range(len(self.k)):
            self.k[layer][dst].copy_(self.k[layer][src])
            self.v[layer][dst].copy_(self.v[layer][src])
            ks, vs = self.k_scale[layer], self.v_scale[layer]
            if ks is not None and vs is not None:
                ks[dst].copy_(ks[src])
                vs[dst].copy_(vs[src])

    def read_blocks(self, blocks: Sequence[int]) -> list[BlockData]:
        """Copies of the given blocks, one BlockData each."""
        idx = torch.tensor(list(blocks), dtype=torch.long, device=self.k[0].device)

        def gather(ts: Sequence[torch.Tensor | None]) -> torch.Tensor:
            out = torch.stack([raw_view(t).index_select(0, idx) for t in ts if t is not None], 1)
            return out.cpu().view(ts[0].dtype) if ts[0] is not None else out

        k, v = gather(self.k), gather(self.v)
        if not self.quantized:
            return [BlockData(k[i], v[i]) for i in range(len(blocks))]
        ks, vs = gather(self.k_scale), gather(self.v_scale)
        return [BlockData(k[i], v[i], ks[i], vs[i]) for i in range(len(blocks))]

    def write_blocks(self, blocks: Sequence[int], data: Sequence[BlockData]) -> None:
        """Overwrite the given blocks with `data` (same dtype and shape as the cache's)."""
        if not blocks:
            return

        def stacked(parts: list[torch.Tensor | None]) -> torch.Tensor:
            return torch.stack([raw_view(p) for p in parts if p is not None], dim=1)  # [L, n, ...]

        k, v = stacked([d.k for d in data]), stacked([d.v for d in data])
        if not self.quantized:
            self.write_stacked(blocks, k, v)
            return
        ks, vs = stacked([d.k_scale for d in data]), stacked([d.v_scale for d in data])
        self.write_stacked(blocks, k, v, ks, vs)

    def write_stacked(
        self,
        blocks: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> None:
        """Overwrite `blocks` with k, v [num_layers, len(blocks), block_size, num_kv_heads,
        head_dim] in the cache dtype (and, for int8 / fp8 caches, their scales [num_layers,
        len(blocks), block_size, num_kv_heads]): one copy per layer. A float cache also takes
        int8 / fp8 k, v with their scales: dequantized on the way in, straight into the blocks
        when they are consecutive, else through a small per-layer buffer. Touches only those
        blocks, so a store load's worker threads write while the engine runs others."""
        if not blocks:
            return
        if not self.quantized and k_scale is not None and v_scale is not None:
            self._dequantize_into(blocks, k, v, k_scale, v_scale)
            return
        dev = self.k[0].device
        first, n, idx = _placement(blocks, dev)

        def scatter(ts: Sequence[torch.Tensor | None], src: torch.Tensor | None) -> None:
            assert src is not None
            src = src.to(dev)
            for layer, t in enumerate(ts):
                assert t is not None
                if idx is None:
                    raw_view(t)[first : first + n].copy_(raw_view(src[layer]))
                else:
                    raw_view(t).index_copy_(0, idx, raw_view(src[layer]))

        scatter(self.k, k)
        scatter(self.v, v)
        if self.quantized:
            scatter(self.k_scale, k_scale)
            scatter(self.v_scale, v_scale)

    def write_frames(
        self,
        blocks: Sequence[int],
        k: Sequence[cpu_ops.Buffer],
        v: Sequence[cpu_ops.Buffer],
        scales: Sequence[cpu_ops.Buffer] | None,
        stored: torch.dtype,
        checksums: tuple[list[bytes], list[bytes]] | None = None,
    ) -> int | None:
        """Overwrite `blocks` with blocks as a store frame holds them, as bytes: each one's K
        and V [num_layers, block_size, num_kv_heads, head_dim] as `stored` (int8 / fp8 with its
        fp32 scales [2, num_layers, block_size, num_kv_heads]), in one C++ call: copied where
        they are in the cache's own format, dequantized into an fp32 cache. `checksums`: each
        frame's checksum head and digest (an empty digest: verified already), checked just
        before its block is written. How many leading blocks were written (up to the first
        whose checksum fails); None (nothing written) where that kernel does not apply
        (another device or pairing): write_stacked takes them then."""
        return cpu_ops.write_frames(
            k,
            v,
            scales,
            stored,
            self.k,
            self.v,
            self.k_scale,
            self.v_scale,
            list(blocks),
            checksums,
        )

    def write_templated(
        self,
        blocks: Sequence[int],
        frames: Sequence[cpu_ops.Buffer],
        template: FrameTemplate,
        heads: tuple[list[bytes], list[bytes]],
    ) -> tuple[int, int] | None:
        """write_frames for whole frames that `template` reads (`heads`: each one's bytes up to
        its scales and its checksum's head, FrameTemplate.heads): each frame's layout and
        checksum checked just before its block is written, in one C++ call. (blocks written,
        why it stopped: 0 none did, 1 the next frame is laid out otherwise, 2 its checksum
        fails); None (nothing written) where that kernel does not apply."""
        return cpu_ops.write_templated(
            frames,
            *heads,
            template.middle,
            template.tail,
            template.scales_len,
            template.payload_len,
            template.stored,
            self.k,
            self.v,
            self.k_scale,
            self.v_scale,
            list(blocks),
        )

    def _dequantize_into(
        self,
        blocks: Sequence[int],
        k: torch.Tensor,
        v: torch.Tensor,
        k_scale: torch.Tensor,
        v_scale: torch.Tensor,
    ) -> None:
        dev = self.k[0].device
        first, n, idx = _placement(blocks, dev)
        buf = None if idx is None else _layer_buffer((n, *self.k[0].shape[1:]), self.dtype, dev)
        for caches, q, scale in ((self.k, k, k_scale), (self.v, v, v_scale)):
            q, scale = q.to(dev), scale.to(dev)
            for layer, t in enumerate(caches):
                out = t[first : first + n] if buf is None else buf
                out.copy_(q[layer])
                out.mul_(scale[layer].unsqueeze(-1))
                if idx is not None:
                    t.index_copy_(0, idx, out)


def _placement(blocks: Sequence[int], device: torch.device) -> tuple[int, int, torch.Tensor | None]:
    """(first block, count, their ids as an index tensor, or None when they are consecutive:
    then blocks[first : first + count] is a slice)."""
    first, n = blocks[0], len(blocks)
    if list(blocks) == list(range(first, first + n)):
        return first, n, None
    return first, n, torch.tensor(list(blocks), dtype=torch.long, device=device)


_buffers = threading.local()  # each writing thread's dequantization buffer


def _layer_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """This thread's buffer of one layer's worth of blocks (reused: it stays in the CPU's cache)."""
    key = (shape, dtype, device)
    if getattr(_buffers, "key", None) != key:
        _buffers.key = key
        _buffers.t = torch.empty(shape, dtype=dtype, device=device)
    buf: torch.Tensor = _buffers.t
    return buf


def raw_view(t: torch.Tensor) -> torch.Tensor:
    """fp8 as uint8 (CPU torch cannot stack or index_copy_ fp8); anything else as is."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
