"""msgpack_view.unpack reads what msgpack.unpackb reads, and fails where it fails; a map's bin
values are views of the input, not copies."""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvserve.shared.store.msgpack_view import Limits, unpack, unpack_first

LIMITS = Limits(max_bin_len=1 << 20, max_str_len=64, max_array_len=64, max_map_len=16)

scalars = (
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False)
    | st.text(max_size=80) | st.binary(max_size=300)
)  # fmt: skip


def _containers(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    keys = st.text(max_size=5)
    return st.lists(inner, max_size=70) | st.dictionaries(keys, inner, max_size=18)


values = st.recursive(scalars, _containers, max_leaves=40)


def _reference(data: bytes) -> Any:
    return msgpack.unpackb(
        data, raw=False, strict_map_key=True, use_list=True, max_bin_len=LIMITS.max_bin_len,
        max_str_len=LIMITS.max_str_len, max_array_len=LIMITS.max_array_len,
        max_map_len=LIMITS.max_map_len, max_ext_len=0,
    )  # fmt: skip


def _plain(x: Any) -> Any:
    return bytes(x) if isinstance(x, memoryview) else x


def _outcome(fn: Any, data: bytes) -> tuple[str, Any]:
    try:
        got = fn(data)
    except Exception:
        return ("error", None)
    return ("ok", {k: _plain(v) for k, v in got.items()} if isinstance(got, dict) else got)


@settings(max_examples=300, deadline=None)
@given(values)
def test_reads_what_msgpack_reads(obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    assert _outcome(lambda d: unpack(d, LIMITS), data) == _outcome(_reference, data)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=5), scalars, max_size=16), st.data())
def test_damaged_maps_fail_where_msgpack_fails(obj: dict[str, Any], data: st.DataObject) -> None:
    frame = bytearray(msgpack.packb(obj, use_bin_type=True))
    cut = data.draw(st.integers(0, len(frame)))
    damaged = bytes(frame[:cut]) + data.draw(st.binary(max_size=8))
    assert _outcome(lambda d: unpack(d, LIMITS), damaged)[0] == _outcome(_reference, damaged)[0]


def test_bin_values_are_read_only_views_of_the_input() -> None:
    data = msgpack.packb({"a": b"x" * 1000, "n": 3, "s": "text"}, use_bin_type=True)
    got = unpack(data, LIMITS)
    assert isinstance(got["a"], memoryview) and got["a"].readonly and got["a"].obj is data
    assert bytes(got["a"]) == b"x" * 1000 and got["n"] == 3 and got["s"] == "text"


@pytest.mark.parametrize(
    "data",
    [
        msgpack.packb({"a": 1}) + b"\x00",  # data after the map
        msgpack.packb({str(i): i for i in range(17)}),  # over max_map_len
        msgpack.packb({"a": b"x" * ((1 << 20) + 1)}, use_bin_type=True),  # bin over its limit
        msgpack.packb({1: 2}),  # a key neither str nor bytes
        msgpack.packb({"a": msgpack.ExtType(1, b"x")}),  # ext
        b"\x81\xa1a\xc6\xff\xff\xff\xff",  # a bin that claims 4 GiB
    ],
)
def test_what_msgpack_refuses_is_refused(data: bytes) -> None:
    with pytest.raises(Exception):  # noqa: B017 - msgpack raises several types too
        _reference(data)
    with pytest.raises(ValueError):
        unpack(data, LIMITS)


def test_unpack_first_reads_one_object_and_leaves_the_unpacker_empty() -> None:
    first, second = msgpack.packb([1, 70000, "x"]), msgpack.packb({"k": b"v"})
    data = memoryview(first + second + b"\xc1")  # 0xc1 is never valid msgpack
    assert unpack_first(data, LIMITS) == ([1, 70000, "x"], len(first))
    assert unpack_first(data[len(first) :], LIMITS) == ({"k": b"v"}, len(second))
    for bad in (b"", b"\x93\x01", b"\xc1", msgpack.packb(list(range(LIMITS.max_array_len + 1)))):
        with pytest.raises(ValueError):
            unpack_first(memoryview(bad), LIMITS)
    assert unpack_first(memoryview(first), LIMITS) == ([1, 70000, "x"], len(first))
