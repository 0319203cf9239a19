"""A store load's writes into the engine's cache blocks, on the loader threads.

Each fetched batch is verified and decoded (`BatchLoader.write`), an int8 / fp8 frame
dequantized straight into a staging buffer in the cache's dtype (each thread reuses its own),
and written with one copy per layer, under a LoadJob: once stopped, no write starts, and once
quiescent none is running, so the engine may give the blocks to someone else.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from kvserve.shared.store.block_data import QUANTIZED_KV_DTYPES, BlockData
from kvserve.shared.store.codec import BlockMeta, Miss, decode_block
from kvserve.shared.store.hashing import BlockHash

# KVCache.write_stacked: (blocks, k, v, k_scale, v_scale), K/V [num_layers, n, ...].
WriteStacked = Callable[
    [list[int], torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None
]
_staging = threading.local()  # each load thread's reusable K/V buffers


def _buffers(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """This thread's K and V staging buffers of `shape` (reused: no fresh pages per batch)."""
    key = (shape, dtype)
    if getattr(_staging, "key", None) != key:
        _staging.key = key
        _staging.kv = (torch.empty(shape, dtype=dtype), torch.empty(shape, dtype=dtype))
    kv: tuple[torch.Tensor, torch.Tensor] = _staging.kv
    return kv


class LoadJob:
    """The writes of one load into the engine's cache blocks, from worker threads. Once
    `stop()` was called and `quiescent()` is True, no write happens any more: the engine may
    then give the blocks to someone else."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stopped = False
        self._active = 0

    def begin(self) -> bool:
        """May a block be written now? (then `end()` after it)."""
        with self._lock:
            if self._stopped:
                return False
            self._active += 1
            return True

    def end(self) -> None:
        with self._lock:
            self._active -= 1

    def stop(self) -> None:
        with self._lock:
            self._stopped = True

    def quiescent(self) -> bool:
        with self._lock:
            return self._stopped and self._active == 0


@dataclass
class LoadedBatch:
    """One fetched batch after verification: how many of its leading blocks were written,
    and why it stopped early (`miss`: a codec Miss reason, "gone" or "stopped"; `bad`: the
    hash of a frame that failed)."""

    written: int = 0
    miss: str | None = None
    bad: BlockHash | None = None
    seconds: float = 0.0


@dataclass(frozen=True)
class BatchLoader:
    """Verifies one load's fetched batches and writes them into the engine's cache blocks,
    from the loader threads; every write runs under `job` (none starts once it is stopped)."""

    meta: BlockMeta
    cache_dtype: torch.dtype
    root: BlockHash  # the chain's root, which block 0's frame names as its parent
    write_stacked: WriteStacked
    job: LoadJob

    def write(
        self, hashes: list[BlockHash], frames: list[bytes | None], dst: list[int]
    ) -> LoadedBatch:
        """Verify each frame, up to the first missing or bad one, and write those blocks into
        theirs (a worker thread: it touches only its own blocks)."""
        t0 = time.perf_counter()
        quantized = self.cache_dtype in QUANTIZED_KV_DTYPES.values()
        L, *rest = self.meta.block_shape
        k, v = _buffers(
            (L, len(hashes), *rest), self.cache_dtype if not quantized else torch.float32
        )
        got = self._decode(hashes, frames, k, v)
        n = got.written
        if n and self.job.begin():
            try:
                self._write(dst[:n], k[:, :n], v[:, :n], quantized)
            finally:
                self.job.end()
        elif n:
            got.written, got.miss, got.bad = 0, "stopped", None
        got.seconds = time.perf_counter() - t0
        return got

    def _decode(
        self,
        hashes: list[BlockHash],
        frames: list[bytes | None],
        k: torch.Tensor,  # [num_layers, len(hashes), block_size, num_kv_heads, head_dim]
        v: torch.Tensor,
    ) -> LoadedBatch:
        """The leading verified frames' K/V into k[:, j], v[:, j] (an int8 / fp8 frame
        dequantized there, in the buffers' dtype)."""
        got = LoadedBatch()
        for j, (h, frame) in enumerate(zip(hashes, frames, strict=True)):
            if frame is None:
                got.miss = "gone"
                break
            decoded = decode_block(frame, self.meta, h, self.root, dequantize=False)
            if isinstance(decoded, Miss):
                got.miss, got.bad = decoded.reason, h
                break
            for out, stored, i in ((k, decoded.k, 0), (v, decoded.v, 1)):
                out[:, j].copy_(stored)
                if decoded.scales is not None:
                    out[:, j].mul_(decoded.scales[i].unsqueeze(-1))
            got.written += 1
        return got

    def _write(self, dst: list[int], k: torch.Tensor, v: torch.Tensor, quantized: bool) -> None:
        """One copy per layer into the cache; a quantized cache takes the blocks requantized
        to its own scales."""
        if not quantized:
            self.write_stacked(dst, k, v, None, None)
            return
        n = len(dst)
        blocks = [BlockData.from_float(k[:, j], v[:, j], self.cache_dtype) for j in range(n)]
        ks = torch.stack([b.k_scale for b in blocks if b.k_scale is not None], 1)
        vs = torch.stack([b.v_scale for b in blocks if b.v_scale is not None], 1)
        kq = torch.stack([b.k for b in blocks], 1)
        vq = torch.stack([b.v for b in blocks], 1)
        self.write_stacked(dst, kq, vq, ks, vs)
