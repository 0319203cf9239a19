"""`--store-format auto`: the cache's own format, whatever the store."""

from __future__ import annotations

import pytest
from kvserve.shared.config import StoreConfig


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/0", "redis+cluster://h1:7000/", "memory://",
                                 "file:///var/cache/kv", "default"])  # fmt: skip
@pytest.mark.parametrize(("kv_dtype", "expected"), [("auto", "native"), ("int8", "int8"),
                                                   ("fp8", "fp8")])  # fmt: skip
def test_auto_is_the_caches_own_format(url: str, kv_dtype: str, expected: str) -> None:
    assert StoreConfig(url=url).frame_format(kv_dtype) == expected


def test_an_explicit_format_is_kept() -> None:
    assert StoreConfig(url="redis://h/0", format="int8").frame_format("auto") == "int8"
    assert StoreConfig(url="memory://", format="compact").frame_format("int8") == "compact"
    with pytest.raises(ValueError, match="store format"):
        StoreConfig(url="memory://", format="int4")
