"""A store load's writes into the engine's cache blocks, on the loader threads.

Each fetched batch is verified (`BatchLoader.verify`, on the connector's event loop) and
written (on a loader thread) under a LoadJob: once stopped, no write starts, and once
quiescent none is running, so the engine may give the blocks to someone else. On the CPU a
batch goes from its frames into the cache in one C++ call without the GIL
(KVCache.write_frames): a frame in the cache's own format as a byte copy (an int8 / fp8 one
with its scales: bit-exact with what the engine wrote), int8 / fp8 frames dequantized into an
fp32 cache. Otherwise its blocks are gathered, as stored, into a staging buffer (each thread
reuses its own) and written with one copy per layer (KVCache.write_stacked, which dequantizes
on the way in for a float cache); anything else is converted block by block.

Where the one-call write is there, verification leaves each frame's checksum to it
(codec.read_unchecked): it hashes the frame just before copying its block, so the payload is
read once, and takes the frames' bytes as they are (no tensor is made per frame). A batch's
blocks count only up to the first frame whose checksum fails, however they were written (the
staged path checks the deferred checksums itself, before its copies). Where the engine gives
the load its blocks' tokens and parents (`Chain`), the frames after the first are checked by
comparing their bytes with those their writer wrote for those blocks (codec.FrameTemplate,
made from the first; a frame that differs goes to read_unchecked). Once the template is there
and the cache takes whole frames (KVCache.write_templated), later batches leave that
comparison to the write as well: the event loop, which also receives the next batch, hands
their frames on untouched, and the loader thread checks each one's bytes, then its checksum,
then copies it, in C++ without the GIL (~14-23 us of Python a frame on the loop before).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from kvserve.kernels import cpu_ops
from kvserve.kernels.cpu_ops import Buffer
from kvserve.kernels.reference import dequantize_kv
from kvserve.shared.engine.kv.cache import raw_view
from kvserve.shared.store.block_data import QUANTIZED_KV_DTYPES, BlockData
from kvserve.shared.store.codec import (
    UNCHECKED_FORMATS,
    BlockMeta,
    Checksum,
    DecodedBlock,
    FrameTemplate,
    Miss,
    UncheckedFrame,
    decode_block,
    read_unchecked,
)
from kvserve.shared.store.hashing import BlockHash

# KVCache.write_stacked: (blocks, k, v, k_scale, v_scale), K/V [num_layers, n, ...].
WriteStacked = Callable[
    [list[int], torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None], None
]
# KVCache.write_frames: (blocks, k, v, scales, stored dtype, checksums), the bytes as frames
# hold them; the leading blocks written (up to a checksum that fails), None: not written.
WriteFrames = Callable[
    [
        list[int],
        list[Buffer],
        list[Buffer],
        list[Buffer] | None,
        torch.dtype,
        tuple[list[bytes], list[bytes]] | None,
    ],
    int | None,
]
# KVCache.write_templated: (blocks, whole frames, their template, FrameTemplate.heads) ->
# (blocks written, why it stopped: 0 none did, 1 a frame laid out otherwise, 2 a bad checksum),
# None: not written.
WriteTemplated = Callable[
    [list[int], list[Buffer], FrameTemplate, tuple[list[bytes], list[bytes]]],
    tuple[int, int] | None,
]
_staging = threading.local()  # each load thread's reusable staging buffers


def _buffers(shape: tuple[int, ...], dtype: torch.dtype, scales: bool) -> Staging:
    """This thread's staging buffers of `shape` (reused: no fresh pages per batch)."""
    key = (shape, dtype, scales)
    if getattr(_staging, "key", None) != key:
        _staging.key = key
        raw = torch.uint8 if dtype == torch.float8_e4m3fn else dtype
        k, v = (torch.empty(shape, dtype=raw).view(dtype) for _ in range(2))
        s = torch.empty((2, *shape[:-1]), dtype=torch.float32) if scales else None
        _staging.buffers = Staging(k, v, s)
    staging: Staging = _staging.buffers
    return staging


@dataclass(frozen=True)
class Staging:
    """K and V [num_layers, n, block_size, num_kv_heads, head_dim] as stored (an int8 / fp8
    frame's element type, with `scales` [2, num_layers, n, block_size, num_kv_heads]) or in a
    float dtype (`scales` None)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor | None

    def put(self, j: int, block: DecodedBlock) -> None:
        """Block j of the batch from a verified frame, converted to the staging's form."""
        if self.scales is None:
            for out, stored, i in ((self.k, block.k, 0), (self.v, block.v, 1)):
                out[:, j].copy_(stored)
                if block.scales is not None:
                    out[:, j].mul_(block.scales[i].unsqueeze(-1))
            return
        k, v, scales = block.k, block.v, block.scales
        if scales is None or k.dtype != self.k.dtype:  # another format: quantize it here
            data = BlockData.from_float(*_as_float(block), self.k.dtype)
            assert data.k_scale is not None and data.v_scale is not None
            k, v, scales = data.k, data.v, torch.stack([data.k_scale, data.v_scale])
        raw_view(self.k[:, j]).copy_(raw_view(k))
        raw_view(self.v[:, j]).copy_(raw_view(v))
        self.scales[:, :, j].copy_(scales)


def _as_bytes(
    block: DecodedBlock | UncheckedFrame,
) -> tuple[Buffer, Buffer, Buffer | None, torch.dtype]:
    """A verified block's K and V bytes as stored, its scales' bytes (int8 / fp8) and its
    stored dtype: an unchecked frame's own bytes, a decoded block's tensors' bytes."""
    if isinstance(block, UncheckedFrame):
        half = len(block.payload) // 2
        scales = block.scales if block.fmt in QUANTIZED_KV_DTYPES else None
        return block.payload[:half], block.payload[half:], scales, block.stored
    s = block.scales
    k, v = cpu_ops.tensor_bytes(block.k), cpu_ops.tensor_bytes(block.v)
    return k, v, None if s is None else cpu_ops.tensor_bytes(s), block.k.dtype


def block_data(block: DecodedBlock, dtype: torch.dtype) -> BlockData:
    """A verified block (decoded with dequantize=False) as a cache of `dtype` holds it: an
    int8 / fp8 frame of that dtype as stored (copied), anything else through floats."""
    if block.scales is not None and block.k.dtype == dtype:
        k, v, s = (raw_view(t).clone().view(t.dtype) for t in (block.k, block.v, block.scales))
        return BlockData(k, v, s[0], s[1])
    return BlockData.from_float(*_as_float(block), dtype)


def _as_float(block: DecodedBlock) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 copies of the block's K and V (never views of the frame)."""
    if block.scales is None:
        return block.k.to(torch.float32, copy=True), block.v.to(torch.float32, copy=True)
    return (
        dequantize_kv(block.k, block.scales[0], torch.float32),
        dequantize_kv(block.v, block.scales[1], torch.float32),
    )


def loader_pool(workers: int, name: str) -> concurrent.futures.ThreadPoolExecutor:
    """`workers` threads, started now, whose torch ops run on their own thread only. A store
    load's copies are small and many: split over the intra-op threads, each would wake (and
    spin) the engine's compute threads and take the core the store's reads need. torch keeps
    the thread count per thread; the default that later threads start with is put back."""
    before = torch.get_num_threads()
    started = threading.Barrier(workers + 1)

    def single_threaded() -> None:
        torch.get_num_threads()  # torch's first call on a thread sets it to the default
        torch.set_num_threads(1)
        started.wait()

    pool = concurrent.futures.ThreadPoolExecutor(
        workers, thread_name_prefix=name, initializer=single_threaded
    )
    for _ in range(workers):  # each starts a thread: none is idle, all wait in the initializer
        pool.submit(lambda: None)
    started.wait()
    torch.set_num_threads(before)
    return pool


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
class Verified:
    """A batch's leading verified blocks and its LoadedBatch so far: each block decoded (views
    of its frame), or, where the one-call write takes it, its frame read but not yet hashed
    (an UncheckedFrame: its checksum left to the write)."""

    blocks: list[DecodedBlock | UncheckedFrame]
    got: LoadedBatch
    hashes: list[BlockHash] = field(default_factory=list)
    # Or the frames left whole to the write, which checks them against the load's template
    # (KVCache.write_templated): blocks `at`, `at + 1`, ... of the load.
    raw: list[Buffer] = field(default_factory=list)
    at: int = 0

    @property
    def checksums(self) -> list[Checksum | None]:
        """Each block's checksum left to its write (None: verified already)."""
        return [b.checksum if isinstance(b, UncheckedFrame) else None for b in self.blocks]

    def decoded(self, n: int) -> list[DecodedBlock]:
        """The first `n` blocks as decoded blocks (views of their frames)."""
        return [b.block() if isinstance(b, UncheckedFrame) else b for b in self.blocks[:n]]


@dataclass
class LoadedBatch:
    """One fetched batch after verification: how many of its leading blocks were written,
    and why it stopped early (`miss`: a codec Miss reason, "gone" or "stopped"; `bad`: the
    hash of a frame that failed)."""

    written: int = 0
    miss: str | None = None
    bad: BlockHash | None = None
    seconds: float = 0.0  # the batch's time on its thread: verify_s + write_s
    verify_s: float = 0.0  # verification and gathering into the staging buffer
    write_s: float = 0.0  # copies (and dequantization) into the cache blocks


@dataclass(frozen=True)
class Chain:
    """What the reader knows of the blocks a load asks for: each one's token ids and its
    parent's hash (the block before it, or the root), in the load's order. With them a frame
    is read against the bytes its writer would have written (codec.FrameTemplate)."""

    tokens: Sequence[list[int]]
    parents: Sequence[BlockHash]

    @staticmethod
    def of_run(
        token_ids: list[int],
        block_size: int,
        first: int,
        parent: BlockHash,
        hashes: Sequence[BlockHash],
    ) -> Chain:
        """The chain of `hashes`: blocks `first`, `first + 1`, ... of a sequence of `token_ids`,
        block `first` following `parent`."""
        starts = [(first + i) * block_size for i in range(len(hashes))]
        tokens = [token_ids[s : s + block_size] for s in starts]
        return Chain(tokens, [parent, *hashes[:-1]])


@dataclass(frozen=True)
class BatchLoader:
    """Verifies one load's fetched batches and writes them into the engine's cache blocks,
    from the loader threads; every write runs under `job` (none starts once it is stopped).
    `fmt` is the store's frame format: an int8 / fp8 one is staged as stored."""

    meta: BlockMeta
    cache_dtype: torch.dtype
    root: BlockHash  # the chain's root, which block 0's frame names as its parent
    write_stacked: WriteStacked
    job: LoadJob
    fmt: str = "native"
    write_frames: WriteFrames | None = None  # tried first: one call for the whole batch
    chain: Chain | None = None  # the load's blocks, where the engine gave them
    # Tried first once the load has its template: whole frames checked and written in one call.
    write_templated: WriteTemplated | None = None
    # The template of the load's frames, from the first one read_unchecked took (a holder:
    # the loader is otherwise immutable).
    _template: list[FrameTemplate] = field(default_factory=list)

    def load(
        self,
        hashes: list[BlockHash],
        frames: Sequence[bytes | memoryview | None],
        dst: list[int],
        at: int = 0,
    ) -> LoadedBatch:
        """Verify each frame, up to the first missing or bad one, and write those blocks into
        theirs (a loader thread: it touches only its own blocks)."""
        return self.write(self.verify(hashes, frames, at), dst)

    def verify(
        self,
        hashes: list[BlockHash],
        frames: Sequence[Buffer | None],
        at: int = 0,
        by_template: bool = True,
    ) -> Verified:
        """The leading verified frames, up to the first missing or bad one (`hashes` are the
        load's from its block `at` on). Where the cache's one-call write takes the frames,
        their checksums are left to it (codec.read_unchecked: it hashes each payload just
        before copying it, one pass over the bytes); with the load's `chain`, a frame laid out
        as its writer would have written it for the expected block is read by comparing bytes
        (FrameTemplate), any other by read_unchecked. Once the load has its template and the
        cache's write takes whole frames (`write_templated`), that comparison is left to the
        write too: the frames up to the first missing one go to it as they are."""
        t0 = time.perf_counter()
        if by_template and self.write_templated is not None and self._template and self.fused:
            raw: list[Buffer] = []
            for frame in frames:
                if frame is None:
                    break
                raw.append(frame)
            got = LoadedBatch(len(raw), None if len(raw) == len(frames) else "gone")
            got.verify_s = time.perf_counter() - t0
            return Verified([], got, hashes[: len(raw)], raw, at)
        got, blocks = LoadedBatch(), list[DecodedBlock | UncheckedFrame]()
        for j, (h, frame) in enumerate(zip(hashes, frames, strict=True)):
            if frame is None:
                got.miss = "gone"
                break
            unchecked = self._read_unchecked(frame, h, at + j) if self.fused else None
            if unchecked is not None:
                blocks.append(unchecked)
                continue
            decoded = decode_block(frame, self.meta, h, self.root, dequantize=False)
            if isinstance(decoded, Miss):
                got.miss, got.bad = decoded.reason, h
                break
            blocks.append(decoded)
        got.written = len(blocks)
        got.verify_s = time.perf_counter() - t0
        return Verified(blocks, got, hashes[: len(blocks)])

    def _read_unchecked(self, frame: Buffer, h: BlockHash, i: int) -> UncheckedFrame | None:
        """Block `i` of the load (hash `h`) read with its checksum left to the write: against
        the template where there is one, else by read_unchecked (whose first success makes the
        template)."""
        chain = self.chain
        if chain is not None and self._template:
            read = self._template[0].read(frame, chain.tokens[i], chain.parents[i], self.root)
            if read is not None:
                return read
        read = read_unchecked(frame, self.meta, h, self.root)
        if read is not None and chain is not None and not self._template:
            template = FrameTemplate.of(self.meta, read)
            if template is not None:
                self._template.append(template)
        return read

    @property
    def fused(self) -> bool:
        """Whether checksums are left to the write: the one-call write is there and the
        store's frames are of a format read_unchecked takes (else each frame would be read
        twice)."""
        return self.write_frames is not None and self.fmt in UNCHECKED_FORMATS

    def write(self, verified: Verified, dst: list[int]) -> LoadedBatch:
        """Write the verified blocks into their cache blocks `dst` (in one call, or gathered
        into this thread's staging buffer first), each checksum left to the write verified
        before its block counts: the write ends at the first that fails."""
        t0 = time.perf_counter()
        got, n = verified.got, verified.got.written
        if n and self.job.begin():
            try:
                self._write_run(verified, dst[:n])
            finally:
                self.job.end()
        elif n:
            got.written, got.miss, got.bad = 0, "stopped", None
        got.write_s = time.perf_counter() - t0
        got.seconds = got.verify_s + got.write_s
        return got

    def _write_run(self, verified: Verified, dst: list[int]) -> None:
        """The verified run into `dst`; `verified.got` then says how many blocks went in and
        why the run stopped."""
        got = verified.got
        if verified.raw:
            self._write_raw(verified, dst)
            return
        written = self._write_direct(dst, verified)
        if written is None:
            written = self._checked(verified)
            if written:
                staging = self._staging(written)
                for j, block in enumerate(verified.decoded(written)):
                    staging.put(j, block)
                self._write(dst[:written], staging, written)
        if written < len(verified.blocks):
            got.written, got.miss = written, "bad_checksum"
            got.bad = verified.hashes[written]

    def _write_raw(self, verified: Verified, dst: list[int]) -> None:
        """Whole frames checked against the template and written in one call; from the first
        laid out otherwise on, the frames are read as any other (`verify` without it)."""
        assert self.write_templated is not None and self.chain is not None
        got, raw, at, n = verified.got, verified.raw, verified.at, len(verified.raw)
        template = self._template[0]
        heads = template.heads(self.chain.tokens[at : at + n], self.chain.parents[at : at + n])
        done = self.write_templated(dst, raw, template, heads)
        written, stop = done if done is not None else (0, 1)
        got.written = written
        if stop == 2:
            got.miss, got.bad = "bad_checksum", verified.hashes[written]
        elif stop == 1:
            rest = self.verify(verified.hashes[written:], raw[written:], at + written, False)
            if rest.got.written:
                self._write_run(rest, dst[written : written + rest.got.written])
            got.written += rest.got.written
            if rest.got.miss is not None:
                got.miss, got.bad = rest.got.miss, rest.got.bad

    @staticmethod
    def _checked(verified: Verified) -> int:
        """How many leading blocks verify, their checksums left to the write checked here."""
        for j, checksum in enumerate(verified.checksums):
            if checksum is not None and not checksum.verifies():
                return j
        return len(verified.blocks)

    def _write_direct(self, dst: list[int], verified: Verified) -> int | None:
        """The blocks straight from their frames' bytes into the cache (write_frames), if it
        takes them (all of one stored type): how many leading blocks it wrote, each checksum
        left to it verified first."""
        if self.write_frames is None:
            return None
        parts = [_as_bytes(b) for b in verified.blocks]
        stored = parts[0][3]
        if any(p[3] != stored for p in parts) or len({p[2] is None for p in parts}) != 1:
            return None  # frames of several types, or quantized and float ones mixed
        k, v = [p[0] for p in parts], [p[1] for p in parts]
        scales = [p[2] for p in parts if p[2] is not None] or None
        sums = verified.checksums
        checks = (
            ([c.head if c else b"" for c in sums], [c.digest if c else b"" for c in sums])
            if any(sums)
            else None
        )
        return self.write_frames(dst, k, v, scales, stored, checks)

    def _staging(self, n: int) -> Staging:
        """Frames of an int8 / fp8 format stay as stored unless the cache is quantized
        otherwise; float frames are staged in the cache's dtype (float32 for a quantized one)."""
        L, *rest = self.meta.block_shape
        shape = (L, n, *rest)
        stored = QUANTIZED_KV_DTYPES.get(self.fmt)
        quantized_cache = self.cache_dtype in QUANTIZED_KV_DTYPES.values()
        if stored is not None and (not quantized_cache or stored == self.cache_dtype):
            return _buffers(shape, stored, scales=True)
        return _buffers(shape, torch.float32 if quantized_cache else self.cache_dtype, False)

    def _write(self, dst: list[int], staging: Staging, n: int) -> None:
        """One copy per layer into the cache (a float cache dequantizes int8 / fp8 on the
        way in); a quantized cache given float blocks takes them quantized block by block."""
        k, v, s = staging.k[:, :n], staging.v[:, :n], staging.scales
        if s is not None:
            self.write_stacked(dst, k, v, s[0, :, :n], s[1, :, :n])
        elif self.cache_dtype not in QUANTIZED_KV_DTYPES.values():
            self.write_stacked(dst, k, v, None, None)
        else:
            blocks = [BlockData.from_float(k[:, j], v[:, j], self.cache_dtype) for j in range(n)]
            ks = torch.stack([b.k_scale for b in blocks if b.k_scale is not None], 1)
            vs = torch.stack([b.v_scale for b in blocks if b.v_scale is not None], 1)
            kq = torch.stack([b.k for b in blocks], 1)
            vq = torch.stack([b.v for b in blocks], 1)
            self.write_stacked(dst, kq, vq, ks, vs)
