from __future__ import annotations

import hashlib
import struct

import msgpack
import pytest
from kvserve.shared.store.hashing import (
    SCHEMA_VERSION,
    InvalidSaltError,
    block_hashes,
    chain_hash,
    root_hash,
    validate_cache_salt,
)


def test_root_is_sha256_of_msgpack_header() -> None:
    expected = hashlib.sha256(
        msgpack.packb([SCHEMA_VERSION, "m", "t", "float32", 16, "salt"])
    ).digest()
    assert root_hash("m", "t", "float32", 16, "salt") == expected


@pytest.mark.parametrize(
    "other",
    [
        ("m2", "t", "float32", 16, None),
        ("m", "t2", "float32", 16, None),
        ("m", "t", "int8", 16, None),
        ("m", "t", "float32", 32, None),
        ("m", "t", "float32", 16, "a"),
    ],
)
def test_root_binds_every_field(other: tuple) -> None:  # type: ignore[type-arg]
    assert root_hash("m", "t", "float32", 16, None) != root_hash(*other)


def test_chain_uses_fixed_width_little_endian_tokens() -> None:
    root = root_hash("m", "t", "float32", 2)
    h0 = hashlib.sha256(root + struct.pack("<2I", 1, 70000)).digest()
    h1 = hashlib.sha256(h0 + struct.pack("<2I", 3, 4)).digest()
    assert block_hashes(root, [1, 70000, 3, 4, 5], 2) == [h0, h1]  # partial block not hashed
    assert chain_hash(h0, [3, 4]) == h1
    assert block_hashes(root, [1, 70000, 3, 4], 2, start=1, parent=h0) == [h1]


def test_same_block_different_prefix_differs() -> None:
    root = root_hash("m", "t", "float32", 2)
    assert block_hashes(root, [1, 2, 5, 6], 2)[1] != block_hashes(root, [9, 9, 5, 6], 2)[1]


@pytest.mark.parametrize("bad", ["", "a" * 129, "has space", "semi;colon", "ü", "abc\n"])
def test_bad_salts_rejected(bad: str) -> None:
    with pytest.raises(InvalidSaltError):
        validate_cache_salt(bad)


def test_good_salts() -> None:
    assert validate_cache_salt(None) is None
    assert validate_cache_salt("tenant-1:a.b_c") == "tenant-1:a.b_c"


def test_block_hashes_chain_every_full_block_from_any_start() -> None:
    root = root_hash("m", "t", "float32", 4)
    tokens = list(range(100, 119))  # four full blocks of 4, three tokens over
    chain, prev = [], root
    for i in range(4):
        prev = chain_hash(prev, tokens[4 * i : 4 * i + 4])
        chain.append(prev)
    assert block_hashes(root, tokens, 4) == chain
    assert block_hashes(root, tokens, 4, start=2, parent=chain[1]) == chain[2:]
    assert block_hashes(root, tokens[:3], 4) == []
