"""DiskStore: one file per block on a local disk / NVMe, bounded by bytes, surviving restarts.

Layout under ``root``: ``ab/cd/<hex>`` for a block whose hash hex starts ``abcd`` (two levels of
256-way fan-out); ``pins`` lists pinned hashes, one hex per line. Files are written to a
``.tmp-*`` sibling and ``os.replace``d into place, so a reader sees a whole block or none; stale
tmp files from a crash are removed when the store opens.

Ownership: the store owns every file under ``root``; nothing else may write there. The in-memory
ByteLRU index is rebuilt from the directory on first use (recency = file mtime, oldest evicted
first) and is authoritative afterwards; a read hit bumps the file's mtime so the order survives a
restart. Pinned blocks are exempt from eviction and count toward ``max_bytes``.

All file I/O runs in worker threads (``asyncio.to_thread``); index updates and writes are serialised
by one asyncio lock; reads take no lock (a block evicted under a reader is a miss).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from kvserve.shared.store.base import BlockStore, StoreStats
from kvserve.shared.store.hashing import BlockHash
from kvserve.shared.store.memory import ByteLRU

DEFAULT_MAX_BYTES = 64 << 30
_TMP_PREFIX = ".tmp-"
_PINS_FILE = "pins"


def _is_hex(name: str) -> bool:
    try:
        bytes.fromhex(name)
    except ValueError:
        return False
    return len(name) >= 4


class DiskStore(BlockStore):
    def __init__(self, root: str | os.PathLike[str], max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root)
        self._index = ByteLRU(max_bytes)
        self._stats = StoreStats()
        self._lock = asyncio.Lock()
        self._opened = False

    # -- paths and blocking helpers (run in threads) ---------------------------------------------

    def path_of(self, h: bytes) -> Path:
        x = h.hex()
        return self.root / x[0:2] / x[2:4] / x

    def _scan(self) -> tuple[list[tuple[int, bytes, int]], set[bytes]]:
        self.root.mkdir(parents=True, exist_ok=True)
        found: list[tuple[int, bytes, int]] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                full = os.path.join(dirpath, name)
                if name.startswith(_TMP_PREFIX):
                    with contextlib.suppress(OSError):
                        os.unlink(full)
                    continue
                if dirpath == str(self.root) or not _is_hex(name):
                    continue
                try:
                    st = os.stat(full)
                except OSError:
                    continue
                found.append((st.st_mtime_ns, bytes.fromhex(name), st.st_size))
        found.sort()
        pins: set[bytes] = set()
        pins_path = self.root / _PINS_FILE
        if pins_path.exists():
            for line in pins_path.read_text().split():
                if _is_hex(line):
                    pins.add(bytes.fromhex(line))
        return found, pins

    def _write(self, h: bytes, value: bytes) -> None:
        path = self.path_of(h)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{_TMP_PREFIX}{path.name}.{uuid.uuid4().hex}")
        try:
            with open(tmp, "wb") as f:
                f.write(value)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _read(self, h: bytes) -> bytes | None:
        path = self.path_of(h)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recency survives a restart
        return data

    def _unlink(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            with contextlib.suppress(OSError):
                os.unlink(self.path_of(k))

    def _save_pins(self, pins: set[bytes]) -> None:
        path = self.root / _PINS_FILE
        tmp = path.with_name(f"{_TMP_PREFIX}{_PINS_FILE}.{uuid.uuid4().hex}")
        tmp.write_text("".join(f"{p.hex()}\n" for p in sorted(pins)))
        os.replace(tmp, path)

    async def _ensure_open(self) -> None:
        if self._opened:
            return
        async with self._lock:
            if self._opened:
                return
            found, pins = await asyncio.to_thread(self._scan)
            for p in pins:
                self._index.pin(p)
            over: list[bytes] = []
            for _mtime, h, size in found:  # oldest first: the newest end up most recent
                evicted = self._index.admit(h, size)
                if evicted is None:
                    over.append(h)
                else:
                    over.extend(evicted)
            if over:  # max_bytes shrank since the last run
                self._stats.evictions += len(over)
                await asyncio.to_thread(self._unlink, over)
            self._opened = True

    # -- BlockStore ------------------------------------------------------------------------------

    async def get_many(self, hashes: Sequence[BlockHash]) -> list[bytes | None]:
        await self._ensure_open()
        present = [h for h in hashes if h in self._index]

        def read_all() -> list[bytes | Exception | None]:
            out: list[bytes | Exception | None] = []
            for h in present:
                try:
                    out.append(self._read(h))
                except OSError as e:
                    out.append(e)
            return out

        got = dict(zip(present, await asyncio.to_thread(read_all), strict=True)) if present else {}
        result: list[bytes | None] = []
        for h in hashes:
            v = got.get(h)
            if isinstance(v, bytes):
                self._stats.hits += 1
                self._index.touch(h)
                result.append(v)
            else:
                if isinstance(v, Exception):
                    self._stats.get_errors += 1
                self._stats.misses += 1
                result.append(None)
        return result

    async def put_many(
        self, items: Sequence[tuple[BlockHash, bytes]], ttl_s: int | None = None
    ) -> int:
        await self._ensure_open()
        written = 0
        async with self._lock:
            for h, value in items:
                evicted = self._index.admit(h, len(value))
                if evicted is None:  # only pinned blocks left to evict
                    self._stats.skipped_writes += 1
                    continue
                if evicted:
                    self._stats.evictions += len(evicted)
                    await asyncio.to_thread(self._unlink, evicted)
                try:
                    await asyncio.to_thread(self._write, h, value)
                except OSError:
                    self._stats.put_errors += 1
                    self._index.remove(h)
                    await asyncio.to_thread(self._unlink, [h])
                    continue
                written += 1
        self._stats.puts += written
        return written

    async def contains(self, hashes: Sequence[BlockHash]) -> list[bool]:
        await self._ensure_open()
        return [h in self._index for h in hashes]

    async def delete(self, hashes: Sequence[BlockHash]) -> None:
        await self._ensure_open()
        async with self._lock:
            had_pin = False
            for h in hashes:
                had_pin |= h in self._index.pins
                self._index.unpin(h)
                self._index.remove(h)
            await asyncio.to_thread(self._unlink, list(hashes))
            if had_pin:
                await asyncio.to_thread(self._save_pins, set(self._index.pins))

    async def pin(self, hashes: Sequence[BlockHash]) -> None:
        await self._set_pins(hashes, True)

    async def unpin(self, hashes: Sequence[BlockHash]) -> None:
        await self._set_pins(hashes, False)

    async def _set_pins(self, hashes: Sequence[BlockHash], pinned: bool) -> None:
        """Pin (or unpin) each hash in the index, then save the pin set."""
        await self._ensure_open()
        async with self._lock:
            for h in hashes:
                if pinned:
                    self._index.pin(h)
                else:
                    self._index.unpin(h)
            await asyncio.to_thread(self._save_pins, set(self._index.pins))

    def lru_order(self) -> list[bytes]:
        """Unpinned hashes, next to be evicted first (for tests and admin)."""
        return self._index.lru_order()

    def stats(self) -> dict[str, object]:
        self._stats.bytes_stored = self._index.used
        d = self._stats.as_dict()
        d.update(backend="file", root=str(self.root), blocks=len(self._index))
        d.update(max_bytes=self._index.max_bytes, pinned=len(self._index.pins))
        return d

    async def close(self) -> None:
        async with self._lock:
            self._opened = False
            self._index = ByteLRU(self._index.max_bytes)
