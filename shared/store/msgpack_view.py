"""A msgpack map read in place: its `bin` values come back as read-only memoryviews of the input
(no copy), every other value as msgpack itself unpacks it, under the same limits.

msgpack copies each `bin` into a new bytes object; a store frame is one map whose payload is
nearly all of its bytes, so reading a frame that way copies it once more than its reader
needs (and, for a 200 KB payload, costs ~10x more than reading it in place: a fresh
allocation per frame). Here msgpack's own streaming unpacker walks the top level: each key and
non-bin value is unpacked under the limits, each bin value is skipped and its extent
(`Unpacker.tell`) sliced out of the input.

`unpack` raises ValueError for anything that is not exactly one well-formed object within the
limits (as msgpack.unpackb raises for the same input).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import msgpack

# The type bytes of bin 8/16/32 (msgpack specification) and the width of the length after them.
_BIN_LENGTH_WIDTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}


@dataclass(frozen=True)
class Limits:
    """msgpack.unpackb's limits, applied to every value."""

    max_bin_len: int
    max_str_len: int
    max_array_len: int
    max_map_len: int

    def unpack(self, data: memoryview) -> Any:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_bin_len=self.max_bin_len,
            max_str_len=self.max_str_len,
            max_array_len=self.max_array_len,
            max_map_len=self.max_map_len,
            max_ext_len=0,
        )

    def unpacker(self) -> msgpack.Unpacker:
        """A streaming unpacker with these limits (its buffer grows to the largest input fed)."""
        return msgpack.Unpacker(
            None,
            raw=False,
            strict_map_key=True,
            use_list=True,
            max_buffer_size=0,  # what is fed is bounded by its caller (codec: MAX_FRAME_BYTES)
            max_bin_len=self.max_bin_len,
            max_str_len=self.max_str_len,
            max_array_len=self.max_array_len,
            max_map_len=self.max_map_len,
            max_ext_len=0,
        )


# One unpacker per thread and per limits, reused: a fresh one allocates a buffer the size of
# its input, and for a frame of ~200 KB that allocation (fresh pages from the OS, each
# faulted in) cost more than reading the frame. After any failure the unpacker is dropped.
_local = threading.local()


def _unpacker(limits: Limits) -> msgpack.Unpacker:
    cache: dict[Limits, msgpack.Unpacker] = _local.__dict__.setdefault("unpackers", {})
    u = cache.get(limits)
    if u is None:
        u = cache[limits] = limits.unpacker()
    return u


def _is_map(view: memoryview) -> bool:
    return len(view) > 0 and (0x80 <= view[0] <= 0x8F or view[0] in (0xDE, 0xDF))


def unpack(data: bytes | bytearray | memoryview, limits: Limits) -> Any:
    """The one object that is all of `data`: a map with its bin values as memoryviews of
    `data`, anything else as msgpack unpacks it."""
    view = memoryview(data).cast("B")
    if not _is_map(view):
        return limits.unpack(view)
    u = _unpacker(limits)
    try:
        return _map(u, view, limits)
    except Exception as e:
        _local.unpackers.pop(limits, None)  # it may hold the rest of `data`
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"msgpack: {type(e).__name__}") from e  # OutOfData and the like


def unpack_first(data: memoryview, limits: Limits) -> tuple[Any, int]:
    """The first object in `data` (which may go on past it) and its length in bytes; ValueError
    when `data` does not begin with one within the limits. Everything in `data` is copied into
    the unpacker's buffer first: give it a bounded slice."""
    u = _unpacker(limits)
    base = u.tell()
    try:
        u.feed(data)
        obj = u.unpack()
        used = u.tell() - base
        u.read_bytes(len(data) - used)  # the rest of `data`: the unpacker is empty again
    except Exception as e:
        _local.unpackers.pop(limits, None)
        if isinstance(e, ValueError):
            raise
        raise ValueError(f"msgpack: {type(e).__name__}") from e
    return obj, used


def _map(u: msgpack.Unpacker, view: memoryview, limits: Limits) -> dict[Any, Any]:
    """The map that is all of `view`, read by `u` (which has consumed all it was fed)."""
    base = u.tell()
    u.feed(view)
    out: dict[Any, Any] = {}
    entries = u.read_map_header()  # read_map_header does not apply max_map_len
    if entries > limits.max_map_len:
        raise ValueError("msgpack: map over its limit")
    for _ in range(entries):
        key = u.unpack()
        if not isinstance(key, str | bytes):
            raise ValueError("msgpack: map key neither str nor bytes")
        start = u.tell() - base
        if start < len(view) and view[start] in _BIN_LENGTH_WIDTH:
            u.skip()  # checks the extent, not the limit (skipping builds nothing): below
            end = u.tell() - base
            first = start + 1 + _BIN_LENGTH_WIDTH[view[start]]
            if end - first > limits.max_bin_len:
                raise ValueError("msgpack: bin over its limit")
            out[key] = view[first:end].toreadonly()
        else:
            out[key] = u.unpack()
    if u.tell() - base != len(view):
        raise ValueError("msgpack: data after the map")
    return out
