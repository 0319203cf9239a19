"""`--store-format auto`: int8 frames in a store other processes read, the cache's own dtype in
one of the process's own."""

from __future__ import annotations

import pytest
from kvserve.shared.config import StoreConfig


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis://127.0.0.1:6379/0", "int8"),
        ("rediss://h:6380/1", "int8"),
        ("redis+cluster://h1:7000,h2:7001/", "int8"),
        ("unix:///tmp/redis.sock", "int8"),
        ("memory://", "native"),
        ("file:///var/cache/kv", "native"),
        ("default", "native"),
    ],
)
def test_auto_is_int8_where_blocks_leave_the_process(url: str, expected: str) -> None:
    assert StoreConfig(url=url).frame_format == expected


def test_an_explicit_format_is_kept() -> None:
    assert StoreConfig(url="redis://h/0", format="native").frame_format == "native"
    assert StoreConfig(url="memory://", format="compact").frame_format == "compact"
    with pytest.raises(ValueError, match="store format"):
        StoreConfig(url="memory://", format="int4")
