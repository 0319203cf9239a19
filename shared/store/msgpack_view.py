"""A msgpack map read in place: its `bin` values come back as read-only memoryviews of the input
(no copy), every other value as msgpack itself unpacks it, under the same limits.

msgpack copies each `bin` into a new bytes object; a store frame is one map whose payload is
nearly all of its bytes, so reading a frame that way copies it once more than its reader
needs. Here only the structure of the top level is walked (each value's extent, from the
msgpack specification's type bytes); the values themselves, keys included, go to msgpack.

`unpack` raises ValueError for anything that is not exactly one well-formed object within the
limits (as msgpack.unpackb raises for the same input).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack

# Type bytes with a fixed extent after them: nil/false/true, float 32/64, (u)int 8..64.
_FIXED = {0xC0: 0, 0xC2: 0, 0xC3: 0, 0xCA: 4, 0xCB: 8, 0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8,
          0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8}  # fmt: skip
# Types whose length follows as a 1-, 2- or 4-byte big-endian integer: bin, str.
_SIZED = {0xC4: 1, 0xC5: 2, 0xC6: 4, 0xD9: 1, 0xDA: 2, 0xDB: 4}
_BIN = frozenset({0xC4, 0xC5, 0xC6})
# Containers whose element count follows likewise (map entries count twice): array, map.
_CONTAINERS = {0xDC: (2, 1), 0xDD: (4, 1), 0xDE: (2, 2), 0xDF: (4, 2)}
_LENGTH = {1: ">B", 2: ">H", 4: ">I"}


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


def _length(data: memoryview, pos: int, width: int) -> int:
    if pos + width > len(data):
        raise ValueError("msgpack: truncated")
    value: int = struct.unpack_from(_LENGTH[width], data, pos)[0]
    return value


def _end(data: memoryview, pos: int) -> int:
    """Where the object starting at `pos` ends (its extent, not its validity: msgpack checks
    that). Iterative: a deeply nested value costs no recursion."""
    pending = 1
    while pending:
        if pos >= len(data):
            raise ValueError("msgpack: truncated")
        b = data[pos]
        pending -= 1
        pos += 1
        if b <= 0x7F or b >= 0xE0:  # positive / negative fixint
            continue
        if 0xA0 <= b <= 0xBF:  # fixstr
            pos += b & 0x1F
        elif 0x90 <= b <= 0x9F:  # fixarray
            pending += b & 0x0F
        elif 0x80 <= b <= 0x8F:  # fixmap
            pending += 2 * (b & 0x0F)
        elif b in _FIXED:
            pos += _FIXED[b]
        elif b in _SIZED:
            pos += _SIZED[b] + _length(data, pos, _SIZED[b])
        elif b in _CONTAINERS:
            width, per = _CONTAINERS[b]
            pending += per * _length(data, pos, width)
            pos += width
        else:  # ext types, and 0xC1, which msgpack never uses
            raise ValueError(f"msgpack: type byte {b:#x} not read here")
    if pos > len(data):
        raise ValueError("msgpack: truncated")
    return pos


def _map_header(data: memoryview) -> tuple[int, int] | None:
    """(entries, offset of the first key) of the map at the start of `data`; None if what
    starts there is no map."""
    b = data[0] if len(data) else None
    if b is not None and 0x80 <= b <= 0x8F:
        return b & 0x0F, 1
    if b in (0xDE, 0xDF):
        width = 2 if b == 0xDE else 4
        return _length(data, 1, width), 1 + width
    return None


def unpack(data: bytes | bytearray | memoryview, limits: Limits) -> Any:
    """The one object that is all of `data`: a map with its bin values as memoryviews of
    `data`, anything else as msgpack unpacks it."""
    view = memoryview(data).cast("B")
    header = _map_header(view)
    if header is None:
        return limits.unpack(view)
    entries, pos = header
    if entries > limits.max_map_len:
        raise ValueError("msgpack: map over its limit")
    out: dict[Any, Any] = {}
    for _ in range(entries):
        key_end = _end(view, pos)
        if 0xA0 <= view[pos] <= 0xBF:  # a fixstr: the usual key, read without a call
            key: Any = str(view[pos + 1 : key_end], "utf-8")
        else:
            key = limits.unpack(view[pos:key_end])
        if not isinstance(key, str | bytes):
            raise ValueError("msgpack: map key neither str nor bytes")
        end = _end(view, key_end)
        if view[key_end] <= 0x7F:  # a positive fixint
            out[key] = view[key_end]
        elif view[key_end] in _BIN:
            width = _SIZED[view[key_end]]
            if end - key_end - 1 - width > limits.max_bin_len:
                raise ValueError("msgpack: bin over its limit")
            out[key] = view[key_end + 1 + width : end].toreadonly()
        else:
            out[key] = limits.unpack(view[key_end:end])
        pos = end
    if pos != len(view):
        raise ValueError("msgpack: data after the map")
    return out
