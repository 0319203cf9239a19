"""Block identity: chained SHA-256 block hashes under a root that binds everything a block's
contents depend on.

- root = sha256(msgpack([schema_version, model_fingerprint, tokenizer_fingerprint, kv_format,
  block_size, cache_salt])): a block computed by another model, tokenizer, KV format, block size
  or tenant can never match.
- h_0 = sha256(root || tokens_0), h_i = sha256(h_{i-1} || tokens_i), tokens as little-endian
  uint32. Only full blocks are hashed. Never Python's hash(), never pickle.
"""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Sequence
from typing import NewType

import msgpack

SCHEMA_VERSION = 1
BlockHash = NewType("BlockHash", bytes)

MAX_SALT_LEN = 128
_SALT_RE = re.compile(r"[A-Za-z0-9._:\-]+")


class InvalidSaltError(ValueError):
    pass


def validate_cache_salt(salt: str | None) -> str | None:
    """A cache salt is 1..128 characters of [A-Za-z0-9._:-]; None means no salt."""
    if salt is None:
        return None
    ok = isinstance(salt, str) and 0 < len(salt) <= MAX_SALT_LEN and _SALT_RE.fullmatch(salt)
    if not ok:
        raise InvalidSaltError(
            f"cache_salt must be 1..{MAX_SALT_LEN} characters of [A-Za-z0-9._:-]"
        )
    return salt


def root_hash(
    model_fingerprint: str,
    tokenizer_fingerprint: str,
    kv_format: str,
    block_size: int,
    cache_salt: str | None = None,
) -> BlockHash:
    header = [
        SCHEMA_VERSION,
        model_fingerprint,
        tokenizer_fingerprint,
        kv_format,
        block_size,
        cache_salt or "",
    ]
    return BlockHash(hashlib.sha256(msgpack.packb(header)).digest())


def encode_tokens(tokens: Sequence[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}I", *tokens)


def chain_hash(parent: BlockHash, tokens: Sequence[int]) -> BlockHash:
    return BlockHash(hashlib.sha256(parent + encode_tokens(tokens)).digest())


def block_hashes(
    root: BlockHash,
    token_ids: Sequence[int],
    block_size: int,
    start: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Hashes of the full blocks of `token_ids` from block `start` on; `parent` is the hash of
    block start - 1 (or the root when start == 0)."""
    prev = root if start == 0 else parent
    if prev is None:
        raise ValueError("parent hash needed when start > 0")
    end = len(token_ids) // block_size * block_size
    # The tokens encoded once, then hashed a block's bytes at a time (chain_hash's bytes,
    # without a pack call per block: the gateway hashes every prompt it routes).
    data = encode_tokens(token_ids[start * block_size : end])
    step = 4 * block_size
    out = []
    for offset in range(0, len(data), step):
        prev = BlockHash(hashlib.sha256(prev + data[offset : offset + step]).digest())
        out.append(prev)
    return out


def tail_hash(request_id: str, token_ids: list[int], block_size: int) -> BlockHash:
    """The per-request key of a tail: its tokens (zero-padded to a block) chained onto a parent
    derived from the request id, so the frame verifies like any block (checksum, header, hash)
    and no other request or content can answer for it."""
    return chain_hash(tail_parent(request_id), padded_tail(token_ids, block_size))


def tail_parent(request_id: str) -> BlockHash:
    """The parent a tail's frame is chained onto: derived from the request id alone."""
    return BlockHash(hashlib.sha256(b"kvserve-tail:" + request_id.encode()).digest())


def padded_tail(token_ids: list[int], block_size: int) -> list[int]:
    """A tail's tokens zero-padded to a whole block, as its frame carries them."""
    return list(token_ids) + [0] * (block_size - len(token_ids))
