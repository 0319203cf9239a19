"""The self-describing block frame of the prefix store (DESIGN.md §5).

One frame holds one full block: its token ids and the K/V of every layer. A frame is a msgpack
map with exactly the fields of `FRAME_FIELDS`:

    v, model_fp, kv_format, block_size, num_layers, num_kv_heads, head_dim,  -- header
    token_ids, parent, fmt, dtype, scales, comp, payload, checksum

- `parent`: the chain hash of the previous block (the root for block 0); a reader that knows
  only the key's hash checks `chain_hash(parent, token_ids) == key_hash`.
- `fmt`: how the payload is stored (`native`, `bf16`, `fp16`, `int8`, `fp8`, `compact`);
  `dtype`: the dtype of the tensors handed to the encoder (`float32`, `bfloat16`, `float16`).
- `scales`: float32 per-(layer, token, head) scales, K's then V's, for `int8` / `fp8`; the
  compact format's float32 steps (store/quant.py); empty otherwise.
- `comp`: how the payload is packed: `zstd` (one zstd frame that records its size) or `none`
  (the bytes as they are). `COMPRESS` says which each format gets (the measurement behind it
  is in docs/store_formats.md): only `compact`, whose bytes are made for an entropy coder,
  pays its CPU back; the others save 0-8% of their bytes for more CPU than the transfer of
  those bytes takes at 10 Gb/s.
- `payload`: the bytes of K then V, each [num_layers, block_size, num_kv_heads, head_dim] in
  the element type of `fmt` (fp8 e4m3 as its raw bytes), packed as `comp` says; for `compact`,
  the sections that store/quant.py lays out, zstd-compressed.
- `checksum`: xxh3-128 over msgpack([the header fields, token_ids, parent, fmt, dtype]) and
  then, in place (no copy, no re-pack), the scales' length, the scales and the payload. It
  guards the bytes against corruption at memory speed; identity stays with the SHA-256 chain
  hash, which the reader checks against the key. `v` is FRAME_VERSION (3 since `comp`); a
  version-2 frame (the same fields without `comp`, its payload always zstd) still reads; a
  frame of any other version is a miss.

Invariants of `decode_block`:
- it never raises, whatever the input bytes; every failure is a `Miss` with a reason from
  `MISS_REASONS`;
- it returns a block only when the checksum verifies, every header field equals the reader's
  `BlockMeta`, the scales and the decompressed payload have exactly the sizes the shape requires,
  and the token ids hash, under the frame's parent, to the key's hash;
- it never unpickles and never decompresses more than the shape requires (the frame size, each
  msgpack field and the zstd output are all bounded);
- `dequantize=False` returns K/V (and scales) as stored, views of the frame's own bytes where
  the payload is not compressed: read-only, no copy (the loader copies them into the cache).

`decode_unchecked`, the store load's fast path for uncompressed native / int8 / fp8 frames laid
out as written, makes every check above but the checksum and returns that as a `Checksum` for
the copy into the cache to verify (kernels/cpu_ops.write_frames) before the block counts.

Byte order is the host's (little-endian on every supported platform).
"""

from __future__ import annotations

import functools
import hmac
import math
import re
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, ParamSpec

import msgpack
import numpy as np
import torch
import xxhash
import zstandard
from kvserve.kernels.reference import dequantize_kv, quantize_kv
from kvserve.shared.store import quant
from kvserve.shared.store.hashing import SCHEMA_VERSION, BlockHash, chain_hash
from kvserve.shared.store.msgpack_view import Limits, unpack, unpack_first

P = ParamSpec("P")
# Uncompressed payloads are read in place, as tensors over the frame's immutable bytes, which
# nothing writes into (torch warns once that it cannot mark such a tensor read-only).
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)
warnings.filterwarnings(
    "ignore", message="The given NumPy array is not writable", category=UserWarning
)

Buffer = bytes | bytearray | memoryview
MAX_FRAME_BYTES: Final = 8 * 1024 * 1024
MAX_TOKENS: Final = 4096  # upper bound on block_size a frame may carry
MAX_STR_LEN: Final = 256
HASH_LEN: Final = 32
CHECKSUM_LEN: Final = 16
FRAME_VERSION: Final = 3
READABLE_VERSIONS: Final = (2, 3)
_UNHASHED: Final = frozenset({"scales", "payload", "checksum"})  # fed to the checksum in place
ZSTD_LEVEL: Final = 3

FORMATS: Final = ("native", "bf16", "fp16", "int8", "fp8", "compact")
Format = Literal["native", "bf16", "fp16", "int8", "fp8", "compact"]

# Native dtypes a frame may carry, by name.
NATIVE_DTYPES: Final[dict[str, torch.dtype]] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_DTYPE_NAMES: Final = {dt: name for name, dt in NATIVE_DTYPES.items()}
# Stored element type of each non-native format.
_FMT_DTYPES: Final[dict[str, torch.dtype]] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
_QUANTIZED: Final = frozenset({"int8", "fp8"})

FRAME_FIELDS: Final = (
    "v",
    "model_fp",
    "kv_format",
    "block_size",
    "num_layers",
    "num_kv_heads",
    "head_dim",
    "token_ids",
    "parent",
    "fmt",
    "dtype",
    "scales",
    "comp",
    "payload",
    "checksum",
)
# The fields of each readable version (2: no `comp`, the payload always zstd).
_VERSION_FIELDS: Final = {2: tuple(n for n in FRAME_FIELDS if n != "comp"), 3: FRAME_FIELDS}
COMPRESSIONS: Final = ("zstd", "none")
_BINS: Final = ("parent", "scales", "payload", "checksum")
_LIMITS: Final = Limits(
    max_bin_len=MAX_FRAME_BYTES,
    max_str_len=MAX_STR_LEN,
    max_array_len=MAX_TOKENS,
    max_map_len=len(FRAME_FIELDS),
)
# Whether each format's payload is zstd-compressed (docs/store_formats.md has the measurement).
COMPRESS: Final[dict[str, bool]] = {
    "native": False,
    "bf16": False,
    "fp16": False,
    "int8": False,
    "fp8": False,
    "compact": True,
}

MissReason = Literal[
    "too_large",  # frame longer than MAX_FRAME_BYTES
    "not_msgpack",  # not bytes, not one well-formed msgpack object, or over a field limit
    "bad_schema",  # not a map of exactly FRAME_FIELDS with the right types, or another version
    "bad_checksum",  # checksum does not match the other fields
    "wrong_model",  # model_fp differs from the reader's
    "wrong_format",  # kv_format differs from the reader's
    "wrong_block_size",  # block_size differs from the reader's
    "wrong_shape",  # num_layers / num_kv_heads / head_dim differ from the reader's
    "bad_payload",  # scales or payload not of the size the shape requires, or not zstd (comp)
    "hash_mismatch",  # chain_hash(parent, token_ids) != the key's hash
    "internal_error",  # anything unforeseen: still a miss, never an exception
]
MISS_REASONS: Final[frozenset[str]] = frozenset(MissReason.__args__)  # type: ignore[attr-defined]


@dataclass(frozen=True)
class BlockMeta:
    """What a reader expects of every frame (and what a writer stamps on it)."""

    model_fp: str
    kv_format: str  # the engine's cache dtype name, as in the root hash
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    version: int = SCHEMA_VERSION

    @property
    def block_shape(self) -> tuple[int, int, int, int]:
        """[num_layers, block_size, num_kv_heads, head_dim]: the shape of K (and of V)."""
        return (self.num_layers, self.block_size, self.num_kv_heads, self.head_dim)


@dataclass(frozen=True)
class DecodedBlock:
    """A verified block: `k`, `v` float32 [num_layers, block_size, num_kv_heads, head_dim]
    (with `decode_block(dequantize=False)`: as stored, possibly read-only views of the frame).

    `is_first` is True when the frame's parent is the root (block 0 of its chain)."""

    token_ids: list[int]
    k: torch.Tensor
    v: torch.Tensor
    parent: BlockHash
    fmt: str
    is_first: bool
    # decode_block(dequantize=False) of an int8 / fp8 frame: k and v as stored, and their
    # scales [2, num_layers, block_size, num_kv_heads] (K's, V's) to dequantize them with.
    scales: torch.Tensor | None = None


@dataclass(frozen=True)
class Miss:
    """Why a frame was rejected; `reason` is always one of MISS_REASONS."""

    reason: MissReason


def frame_checksum(fields: dict[str, Any]) -> bytes:
    """xxh3-128 over msgpack of the small fields (those of the frame's version), then the
    scales' length and the scales and payload bytes in place."""
    scales, payload = _raw_bytes(fields["scales"]), _raw_bytes(fields["payload"])
    return _digest(_checksum_head(fields), scales, payload)


def _checksum_head(fields: dict[str, Any]) -> bytes:
    names = _VERSION_FIELDS.get(fields["v"], FRAME_FIELDS)
    packed: bytes = msgpack.packb([fields[n] for n in names if n not in _UNHASHED])
    return packed


def _digest(head: bytes, scales: Buffer, payload: Buffer) -> bytes:
    h = xxhash.xxh3_128(head)
    h.update(len(scales).to_bytes(8, "little"))
    h.update(scales)
    h.update(payload)
    return h.digest()


@dataclass(frozen=True)
class Checksum:
    """A frame's checksum, left by `decode_unchecked` to whoever copies the payload (one pass
    over its bytes, kernels/cpu_ops.write_frames): xxh3-128 over `head` (msgpack of the small
    fields), the scales' length (8 bytes, little-endian), the scales, then the payload (K's
    bytes, then V's), must give `digest`."""

    head: bytes
    digest: bytes
    scales: Buffer
    payload: Buffer

    def verifies(self) -> bool:
        return hmac.compare_digest(_digest(self.head, self.scales, self.payload), self.digest)


def _raw_bytes(value: Any) -> Buffer:
    """A bytes field as it is (a forged frame's field of another type: its msgpack)."""
    return value if isinstance(value, bytes | bytearray | memoryview) else msgpack.packb(value)


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


def _tensor_in(
    buf: memoryview | bytearray, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of `dtype` and `shape` over `buf`'s bytes from `offset`, without a copy (over
    `bytes`, read-only: nothing writes into a frame)."""
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)


def _element_size(fmt: str, native: torch.dtype) -> int:
    dtype = native if fmt == "native" else _FMT_DTYPES[fmt]
    return dtype.itemsize


def _compact_layout(shape: tuple[int, int, int, int]) -> quant.CompactLayout:
    return quant.CompactLayout(*shape)


def _sizes(fmt: str, native: torch.dtype, shape: tuple[int, int, int, int]) -> tuple[int, int]:
    """(scales bytes, decompressed payload bytes) that a frame of `fmt` and `shape` must have."""
    if fmt == "compact":
        layout = _compact_layout(shape)
        return layout.scales_bytes, layout.payload_bytes
    numel = math.prod(shape)
    scales_len = 2 * numel // shape[-1] * 4 if fmt in _QUANTIZED else 0
    return scales_len, 2 * numel * _element_size(fmt, native)


def frame_bytes(meta: BlockMeta, fmt: str) -> int:
    """At least the size of an uncompressed frame of `fmt` for `meta` (its scales and payload,
    with room for its other fields; a native frame's elements of the dtype `meta` names, fp32
    for a quantized cache): what a reader sizes its buffers by."""
    native = NATIVE_DTYPES.get(meta.kv_format, torch.float32)
    scales, payload = _sizes(fmt, native, meta.block_shape)
    return scales + payload + len(_frame_head(meta)) + 5 * meta.block_size + 256


def encode_block(
    meta: BlockMeta,
    token_ids: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str,
    parent: BlockHash,
    *,
    root: BlockHash | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    compress: bool | None = None,
) -> bytes:
    """One frame for the block whose tokens are `token_ids` and whose chain parent is `parent`
    (the previous block's hash, or the root for block 0).

    k, v: [num_layers, block_size, num_kv_heads, head_dim], float32 / bfloat16 / float16, the
    same dtype; or, with `scales` (K's and V's, [num_layers, block_size, num_kv_heads]
    float32), already quantized in the element type of `fmt` (int8 / fp8): an int8 / fp8
    cache's own bytes, stored as they are (a reader with that cache gets them back bit for
    bit). `root`, when given, tells the `compact` format that a block whose parent is the root
    starts a sequence: its first token is the attention sink and is coded more finely (the
    frame decodes the same either way). `compress`: zstd the payload (default: COMPRESS[fmt]).
    Raises ValueError on inputs that do not match `meta` or are not finite for `compact` (a
    writer bug, not data).
    """
    _check_block(meta, token_ids, k, v, fmt, parent, scales)
    first = root is not None and bytes(parent) == bytes(root)
    compress = COMPRESS[fmt] if compress is None else compress
    if fmt == "compact" and not compress:
        raise ValueError("encode_block: the compact format is always compressed")
    scale_bytes, payload = _encode_payload(k, v, fmt, first, scales, compress)
    fields: dict[str, Any] = {
        **_header(meta),
        "token_ids": [int(t) for t in token_ids],
        "parent": bytes(parent),
        "fmt": fmt,
        "dtype": "float32" if scales is not None else _DTYPE_NAMES[k.dtype],
        "scales": scale_bytes,
        "comp": "zstd" if compress else "none",
        "payload": payload,
    }
    fields["checksum"] = frame_checksum(fields)
    frame = msgpack.packb({name: fields[name] for name in FRAME_FIELDS}, use_bin_type=True)
    if len(frame) > MAX_FRAME_BYTES:
        raise ValueError(f"encode_block: frame of {len(frame)} bytes > {MAX_FRAME_BYTES}")
    return frame


def _check_block(
    meta: BlockMeta,
    token_ids: list[int],
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str,
    parent: BlockHash,
    scales: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"encode_block: unknown format {fmt!r}")
    if k.shape != meta.block_shape or v.shape != meta.block_shape:
        raise ValueError(f"encode_block: k/v shape {tuple(k.shape)} != {meta.block_shape}")
    if scales is not None:
        if fmt not in _QUANTIZED or k.dtype != _FMT_DTYPES[fmt] or v.dtype != k.dtype:
            raise ValueError(f"encode_block: quantized k/v must be {fmt}'s element type")
        if any(s.shape != meta.block_shape[:3] or s.dtype != torch.float32 for s in scales):
            raise ValueError("encode_block: scales must be float32 [layers, tokens, heads]")
    elif k.dtype != v.dtype or k.dtype not in _DTYPE_NAMES:
        raise ValueError(f"encode_block: unsupported k/v dtypes {k.dtype}, {v.dtype}")
    if len(token_ids) != meta.block_size or not all(0 <= t < 2**32 for t in token_ids):
        raise ValueError("encode_block: need block_size token ids in [0, 2**32)")
    if len(parent) != HASH_LEN:
        raise ValueError("encode_block: parent must be a 32-byte block hash")


def _encode_payload(
    k: torch.Tensor,
    v: torch.Tensor,
    fmt: str,
    first: bool,
    stored_scales: tuple[torch.Tensor, torch.Tensor] | None,
    compress: bool,
) -> tuple[bytes, bytes]:
    """(scales, payload) of K and V in `fmt`, the payload zstd-compressed if `compress`;
    `compact` codes (and compresses) its own payload."""
    if fmt == "compact":
        block = quant.encode(k, v, first=first)
        return block.scales, block.payload
    scales = b""
    if stored_scales is not None:
        raw = _tensor_bytes(k) + _tensor_bytes(v)
        scales = _tensor_bytes(stored_scales[0]) + _tensor_bytes(stored_scales[1])
    elif fmt in _QUANTIZED:
        qdtype = _FMT_DTYPES[fmt]
        kq, ks = quantize_kv(k, qdtype)
        vq, vs = quantize_kv(v, qdtype)
        raw = _tensor_bytes(kq) + _tensor_bytes(vq)
        scales = _tensor_bytes(ks) + _tensor_bytes(vs)
    elif fmt == "native":
        raw = _tensor_bytes(k) + _tensor_bytes(v)
    else:
        raw = _tensor_bytes(k.to(_FMT_DTYPES[fmt])) + _tensor_bytes(v.to(_FMT_DTYPES[fmt]))
    if not compress:
        return scales, raw
    cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return scales, cctx.compress(raw)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_types(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The frame's fields if `obj` is a map of exactly its version's fields with the right
    types (a version-2 frame gets `comp` = "zstd")."""
    if set(obj) != set(_VERSION_FIELDS[obj["v"]]):
        return None
    if not all(_is_int(obj[n]) for n in ("v", "block_size", "num_layers", "num_kv_heads")):
        return None
    if not _is_int(obj["head_dim"]):
        return None
    if not all(isinstance(obj[n], str) for n in ("model_fp", "kv_format", "fmt", "dtype")):
        return None
    if not all(isinstance(obj[n], memoryview) for n in _BINS):
        return None
    for n in ("parent", "scales", "checksum"):  # small: copied out of the frame
        obj[n] = bytes(obj[n])
    toks = obj["token_ids"]
    if not isinstance(toks, list) or any(type(t) is not int for t in toks):  # bool: not int
        return None
    if toks and (min(toks) < 0 or max(toks) >= 2**32):
        return None
    if len(obj["parent"]) != HASH_LEN or len(obj["checksum"]) != CHECKSUM_LEN:
        return None
    if obj["fmt"] not in FORMATS or obj["dtype"] not in NATIVE_DTYPES:
        return None
    if obj["v"] == 2:  # before `comp`: every payload was zstd
        obj["comp"] = "zstd"
    elif obj["comp"] not in COMPRESSIONS:
        return None
    return obj


def _never_raises(
    decode: Callable[P, DecodedBlock | Miss],
) -> Callable[P, DecodedBlock | Miss]:
    """A safety net: an exception the checks did not foresee is a Miss, never an exception
    into the caller."""

    @functools.wraps(decode)
    def safe(*args: P.args, **kwargs: P.kwargs) -> DecodedBlock | Miss:
        try:
            return decode(*args, **kwargs)
        except Exception:  # the checks are meant to catch everything
            return Miss("internal_error")

    return safe


@_never_raises
def decode_block(
    data: bytes | bytearray | memoryview,
    expected: BlockMeta,
    key_hash: BlockHash,
    root: BlockHash,
    dequantize: bool = True,
) -> DecodedBlock | Miss:
    """The block in `data` if it is exactly the block stored under `key_hash` for a reader
    expecting `expected`; otherwise a Miss. Never raises (see the module's invariants).
    `dequantize=False` leaves an int8 / fp8 block as stored, with its scales (the reader
    dequantizes it straight into its destination).

    `root` is the chain's root: the frame's parent equals it for block 0. The key's hash already
    binds the root (through the chain), so a frame from another root cannot pass.

    The checks in order, cheapest and most telling first: the frame's shape, its checksum,
    whose block it is, the payload's size, then the key's hash.
    """
    f = _unpack(data, expected)
    if isinstance(f, Miss):
        return f
    if not hmac.compare_digest(frame_checksum(f), f["checksum"]):
        return Miss("bad_checksum")
    miss = _identity_miss(f, expected)
    if miss is not None:
        return miss
    raw = _decompress(f, expected.block_shape)
    if isinstance(raw, Miss):
        return raw
    if chain_hash(BlockHash(f["parent"]), f["token_ids"]) != key_hash:
        return Miss("hash_mismatch")
    return _tensors(f, raw, expected.block_shape, root, dequantize)


# Formats whose uncompressed payload a copy takes as stored (the checksum fused into it):
# the only ones decode_unchecked takes.
UNCHECKED_FORMATS: Final = frozenset({"native", "int8", "fp8"})


@dataclass(frozen=True)
class UncheckedFrame:
    """An uncompressed native / int8 / fp8 frame that passed every check but its checksum,
    left as the frame's own bytes (no tensors made: a load's one-call write takes the bytes):
    `payload` is K's bytes then V's, as `stored`; `scales` the fp32 scales [2, num_layers,
    block_size, num_kv_heads] of an int8 / fp8 frame (finite; empty for a native one)."""

    fmt: str
    stored: torch.dtype
    payload: memoryview
    scales: bytes
    checksum: Checksum
    fields: dict[str, Any]
    shape: tuple[int, int, int, int]
    root: BlockHash

    def block(self) -> DecodedBlock:
        """The frame as `decode_block(dequantize=False)` gives it (views of its bytes)."""
        block = _tensors(self.fields, self.payload, self.shape, self.root, dequantize=False)
        assert not isinstance(block, Miss)  # the scales were checked already
        return block


def read_unchecked(
    data: bytes | bytearray | memoryview, expected: BlockMeta, key_hash: BlockHash, root: BlockHash
) -> UncheckedFrame | None:
    """Every check of `decode_block` but the checksum, on an uncompressed native / int8 / fp8
    frame laid out as `encode_block` writes it; the checksum is left to the copy into the cache
    (reading the payload once rather than twice). None for any other frame or any failed
    check: `decode_block` then names the miss. Never raises."""
    try:
        if not isinstance(data, bytes | bytearray | memoryview) or len(data) > MAX_FRAME_BYTES:
            return None
        f = _read_as_written(memoryview(data).cast("B"), expected)
        if f is None or f["comp"] != "none" or f["fmt"] not in UNCHECKED_FORMATS:
            return None
        shape = expected.block_shape
        if _identity_miss(f, expected) is not None:
            return None
        raw = _decompress(f, shape)
        if isinstance(raw, Miss) or chain_hash(BlockHash(f["parent"]), f["token_ids"]) != key_hash:
            return None
        fmt, scales = f["fmt"], f["scales"]
        if fmt in _QUANTIZED and not np.isfinite(np.frombuffer(scales, np.float32)).all():
            return None
        stored = NATIVE_DTYPES[f["dtype"]] if fmt == "native" else _FMT_DTYPES[fmt]
        checksum = Checksum(_checksum_head(f), f["checksum"], scales, f["payload"])
        return UncheckedFrame(fmt, stored, memoryview(raw), scales, checksum, f, shape, root)
    except Exception:
        return None


@dataclass(frozen=True)
class FrameTemplate:
    """The bytes `encode_block` writes around one load's frames, all of one format and stored
    dtype: given a block's tokens and parent, a frame is read by comparing its bytes with those
    (no parsing, no hash of the tokens), its checksum left to the copy as `read_unchecked`
    leaves it. Made from a frame `read_unchecked` took (`of`): a frame whose every byte
    outside its scales, payload and digest is what the writer would put there for the block
    the reader expects passes every identity check `read_unchecked` makes (its tokens and
    parent are the reader's, which chain to the key's hash)."""

    expected: BlockMeta
    fmt: str
    dtype: str
    stored: torch.dtype
    scales_len: int
    payload_len: int
    # The frame's bytes up to its scales, around the tokens and the parent; between the
    # scales and the payload; and the checksum head's around the tokens and the parent.
    before: tuple[bytes, bytes, bytes]
    middle: bytes
    hashed: tuple[bytes, bytes, bytes]

    @staticmethod
    def of(expected: BlockMeta, frame: UncheckedFrame) -> FrameTemplate | None:
        """The template of `frame`'s format and dtype; None for a frame of an older version."""
        f = frame.fields
        if f["v"] != FRAME_VERSION:
            return None
        fmt, dtype = f["fmt"], f["dtype"]
        scales_len, payload_len = len(f["scales"]), len(f["payload"])
        pack = msgpack.packb
        before = (
            _frame_head(expected) + _TOKEN_KEY,
            pack("parent") + _bin_head(32),
            b"".join((pack("fmt"), pack(fmt), pack("dtype"), pack(dtype), pack("scales")))
            + _bin_head(scales_len),
        )
        middle = pack("comp") + pack("none") + pack("payload") + _bin_head(payload_len)
        count = sum(n not in _UNHASHED for n in FRAME_FIELDS)
        hashed = (
            bytes([0x90 | count]) + b"".join(pack(v) for v in _header(expected).values()),
            _bin_head(32),
            pack(fmt) + pack(dtype) + pack("none"),
        )
        return FrameTemplate(
            expected, fmt, dtype, frame.stored, scales_len, payload_len, before, middle, hashed
        )

    def read(
        self,
        data: bytes | bytearray | memoryview,
        tokens: list[int],
        parent: BlockHash,
        root: BlockHash,
    ) -> UncheckedFrame | None:
        """`data` as `read_unchecked` reads it, if it is laid out byte for byte as this
        template's frame for the block of `tokens` after `parent` (scales finite) in the chain
        of `root`; else None (`read_unchecked` then reads it). Never raises."""
        try:
            view = memoryview(data).cast("B")
            middle = self.middle
            packed_tokens = msgpack.packb(tokens)
            head, checksum_head = self._heads(packed_tokens, parent)
            s = len(head)
            p = s + self.scales_len + len(middle)
            end = p + self.payload_len
            if len(view) != end + len(_CHECKSUM_KEY) + CHECKSUM_LEN or view[:s] != head:
                return None
            if view[p - len(middle) : p] != middle or view[end:-CHECKSUM_LEN] != _CHECKSUM_KEY:
                return None
            scales = bytes(view[s : s + self.scales_len])
            if self.fmt in _QUANTIZED and not np.isfinite(np.frombuffer(scales, np.float32)).all():
                return None
            payload, digest = view[p:end], bytes(view[-CHECKSUM_LEN:])
        except (TypeError, ValueError):
            return None
        fields = {
            **_header(self.expected),
            "token_ids": tokens,
            "parent": bytes(parent),
            "fmt": self.fmt,
            "dtype": self.dtype,
            "scales": scales,
            "comp": "none",
            "payload": payload,
            "checksum": digest,
        }
        checksum = Checksum(checksum_head, digest, scales, payload)
        return UncheckedFrame(
            self.fmt,
            self.stored,
            payload,
            scales,
            checksum,
            fields,
            self.expected.block_shape,
            root,
        )

    def heads(
        self, tokens: Sequence[list[int]], parents: Sequence[BlockHash]
    ) -> tuple[list[bytes], list[bytes]]:
        """For each block of `tokens` after its parent: its frame's bytes up to the scales, and
        its checksum's head, as this template's writer would have written them (what `read`
        compares a frame with; kernels/cpu_ops.write_templated takes them)."""
        out = [self._heads(msgpack.packb(t), p) for t, p in zip(tokens, parents, strict=True)]
        return [h for h, _ in out], [c for _, c in out]

    def _heads(self, packed_tokens: bytes, parent: BlockHash) -> tuple[bytes, bytes]:
        before, hashed = self.before, self.hashed
        return (
            b"".join((before[0], packed_tokens, before[1], parent, before[2])),
            b"".join((hashed[0], packed_tokens, hashed[1], parent, hashed[2])),
        )

    @property
    def tail(self) -> bytes:
        """The bytes between a frame's payload and its digest."""
        return _CHECKSUM_KEY


def _bin_head(n: int) -> bytes:
    """msgpack's header for a bin of `n` bytes (its shortest)."""
    if n < 1 << 8:
        return bytes([0xC4, n])
    if n < 1 << 16:
        return b"\xc5" + n.to_bytes(2, "big")
    return b"\xc6" + n.to_bytes(4, "big")


def decode_unchecked(
    data: bytes | bytearray | memoryview, expected: BlockMeta, key_hash: BlockHash, root: BlockHash
) -> tuple[DecodedBlock, Checksum] | None:
    """`decode_block(dequantize=False)` of a frame `read_unchecked` takes, with every check but
    the checksum, which it returns for whoever copies the payload to verify first. None for any
    other frame or any failed check. Never raises."""
    frame = read_unchecked(data, expected, key_hash, root)
    return None if frame is None else (frame.block(), frame.checksum)


def _unpack(data: bytes | bytearray | memoryview, expected: BlockMeta) -> dict[str, Any] | Miss:
    """The frame's fields, bounded by the limits before anything is allocated; its bin fields
    are views of `data` (msgpack_view: the payload is not copied). A frame laid out as
    `encode_block` writes one for `expected` is read by `_read_as_written`; any other goes
    through msgpack, which also names what is wrong with it."""
    if not isinstance(data, bytes | bytearray | memoryview):
        return Miss("not_msgpack")
    if len(data) > MAX_FRAME_BYTES:
        return Miss("too_large")
    fields = _read_as_written(memoryview(data).cast("B"), expected)
    if fields is not None:
        return fields
    try:
        obj = unpack(data, _LIMITS)
    except Exception:  # ValueError / msgpack's own errors / TypeError on bad input
        return Miss("not_msgpack")
    # The version is checked first: another version may define its fields differently.
    if not isinstance(obj, dict) or obj.get("v") not in READABLE_VERSIONS:
        return Miss("bad_schema")
    if not _is_int(obj["v"]):  # True == 1, 3.0 == 3
        return Miss("bad_schema")
    f = _check_types(obj)
    return Miss("bad_schema") if f is None else f


def _header(meta: BlockMeta) -> dict[str, Any]:
    """A frame's seven header fields for `meta`, in FRAME_FIELDS order."""
    return {
        "v": FRAME_VERSION,
        "model_fp": meta.model_fp,
        "kv_format": meta.kv_format,
        "block_size": meta.block_size,
        "num_layers": meta.num_layers,
        "num_kv_heads": meta.num_kv_heads,
        "head_dim": meta.head_dim,
    }


@functools.lru_cache(maxsize=32)
def _frame_head(expected: BlockMeta) -> bytes:
    """The bytes `encode_block` begins a frame for `expected` with: the map's header and the
    seven header fields, each equal to the reader's."""
    packed = msgpack.packb(_header(expected))
    return bytes([0x80 | len(FRAME_FIELDS)]) + packed[1:]  # a fixmap of the frame's 15 fields


def _packed(name: str) -> bytes:
    return re.escape(msgpack.packb(name))


def _choice(group: str, names: Any) -> bytes:
    """A regex group matching any of `names` as msgpack strings."""
    return b"(?P<" + group.encode() + b">" + b"|".join(_packed(n) for n in names) + b")"


def _bin(group: str) -> bytes:
    """A regex matching a msgpack bin's header (bin 8/16/32), its length's bytes in `group`."""
    return b"(?:\xc4(?P<%s1>.)|\xc5(?P<%s2>..)|\xc6(?P<%s4>....))" % ((group.encode(),) * 3)


# What follows the token ids in a frame as encode_block writes it (fixstr keys, each value's
# shortest encoding): the parent, fmt, dtype and the scales' bin header; then comp and the
# payload's bin header; then the checksum.
_AFTER_TOKENS: Final = re.compile(
    _packed("parent")
    + b"\xc4\x20(?P<parent>.{32})"
    + _packed("fmt")
    + _choice("fmt", FORMATS)
    + _packed("dtype")
    + _choice("dtype", NATIVE_DTYPES)
    + _packed("scales")
    + _bin("s"),
    re.DOTALL,
)
_AFTER_SCALES: Final = re.compile(
    _packed("comp") + _choice("comp", COMPRESSIONS) + _packed("payload") + _bin("p"), re.DOTALL
)
_NAMES: Final = {msgpack.packb(n): n for n in (*FORMATS, *NATIVE_DTYPES, *COMPRESSIONS)}
_CHECKSUM_KEY: Final = msgpack.packb("checksum") + b"\xc4" + bytes([CHECKSUM_LEN])
_TOKEN_KEY: Final = msgpack.packb("token_ids")


def _bin_length(m: re.Match[bytes], group: str) -> int:
    raw = m.group(group + "1") or m.group(group + "2") or m.group(group + "4")
    return int.from_bytes(raw, "big")


def _read_as_written(view: memoryview, expected: BlockMeta) -> dict[str, Any] | None:
    """The fields of a version-3 frame for `expected` whose bytes are laid out exactly as
    `encode_block` writes them (its fields in FRAME_FIELDS order, the header's equal to the
    reader's, fmt, dtype and comp among the known names), read by position (two regular
    expressions and msgpack for the token ids) without msgpack's unpacker, which copies all
    of the frame into its buffer first. None for any other frame, which `_unpack` then reads
    with msgpack: this only ever returns what that would, for a frame that msgpack reads as
    the same map."""
    head = _frame_head(expected)
    n = len(view)
    at = len(head) + len(_TOKEN_KEY)
    if view[: len(head)] != head or view[len(head) : at] != _TOKEN_KEY:
        return None
    count = expected.block_size
    try:  # an array of count uints takes at most 5 bytes each after its 3-byte header
        tokens, used = unpack_first(view[at : at + 3 + 5 * count], _LIMITS)
    except ValueError:
        return None
    m = _AFTER_TOKENS.match(view, at + used)
    if m is None:
        return None
    scales_at = m.end()
    scales_end = scales_at + _bin_length(m, "s")
    e = _AFTER_SCALES.match(view, scales_end)
    if e is None:
        return None
    payload_at = e.end()
    payload_end = payload_at + _bin_length(e, "p")
    checksum_at = payload_end + len(_CHECKSUM_KEY)
    if checksum_at + CHECKSUM_LEN != n or view[payload_end:checksum_at] != _CHECKSUM_KEY:
        return None
    fields = {
        **_header(expected),
        "token_ids": tokens,
        "parent": view[m.start("parent") : m.end("parent")],
        "fmt": _NAMES[m.group("fmt")],
        "dtype": _NAMES[m.group("dtype")],
        "scales": view[scales_at:scales_end],
        "comp": _NAMES[e.group("comp")],
        "payload": view[payload_at:payload_end],
        "checksum": view[checksum_at:n],
    }
    return _written_types(fields)


def _written_types(fields: dict[str, Any]) -> dict[str, Any] | None:
    """`_check_types` for the fields `_read_as_written` found, whose header is the reader's,
    whose names come from the known ones and whose bins have their lengths by position: only
    the token ids, read by msgpack, are left to check."""
    toks = fields["token_ids"]
    if not isinstance(toks, list) or any(type(t) is not int for t in toks):  # bool: not int
        return None
    if toks and (min(toks) < 0 or max(toks) >= 2**32):
        return None
    for n in ("parent", "scales", "checksum"):  # small: copied out of the frame
        fields[n] = bytes(fields[n])
    return fields


def _identity_miss(f: dict[str, Any], expected: BlockMeta) -> Miss | None:
    """A Miss naming how the frame's block differs from what the reader expects, or None."""
    if f["model_fp"] != expected.model_fp:
        return Miss("wrong_model")
    if f["kv_format"] != expected.kv_format:
        return Miss("wrong_format")
    if f["block_size"] != expected.block_size:
        return Miss("wrong_block_size")
    shape = expected.block_shape
    if (f["num_layers"], f["num_kv_heads"], f["head_dim"]) != shape[0:1] + shape[2:]:
        return Miss("wrong_shape")
    if len(f["token_ids"]) != expected.block_size:
        return Miss("bad_schema")
    return None


def _decompress(
    f: dict[str, Any], shape: tuple[int, int, int, int]
) -> memoryview | bytearray | Miss:
    """The payload's raw bytes: as they are when not compressed (exactly the format's size for
    this shape), else decompressed straight into a buffer of exactly that size (the frame's
    declared size is checked first: nothing larger is ever allocated or written). A compressed
    payload must be one zstd frame of exactly that size: a frame that decodes past its declared
    size, or anything decodable after it, is a miss once one byte too many has come out.
    zstd's own window is bounded too (`_max_window`)."""
    scales_len, raw_len = _sizes(f["fmt"], NATIVE_DTYPES[f["dtype"]], shape)
    if len(f["scales"]) != scales_len:
        return Miss("bad_payload")
    if f["comp"] == "none":
        return f["payload"] if len(f["payload"]) == raw_len else Miss("bad_payload")
    buf = bytearray(raw_len)
    try:
        if zstandard.frame_content_size(f["payload"]) != raw_len:
            return Miss("bad_payload")
        dctx = zstandard.ZstdDecompressor(max_window_size=_max_window(raw_len))
        with dctx.stream_reader(f["payload"], read_across_frames=True) as reader:
            filled = 0
            while filled < raw_len and (n := reader.readinto(memoryview(buf)[filled:])):
                filled += n
            if filled != raw_len or reader.read(1):
                return Miss("bad_payload")
    except zstandard.ZstdError:
        return Miss("bad_payload")
    return buf


def _max_window(raw_len: int) -> int:
    """The largest zstd window a payload of `raw_len` bytes may ask for. The encoder's frames
    declare their size, so zstd's window is at most that size; a frame after it may declare
    none, and this keeps the buffer zstd allocates for it (its window) small."""
    return max(1 << 20, 2 * raw_len)


def _tensors(
    f: dict[str, Any],
    raw: memoryview | bytearray,
    shape: tuple[int, int, int, int],
    root: BlockHash,
    dequantize: bool = True,
) -> DecodedBlock | Miss:
    """K and V as float32 from the payload in the frame's format (views of a decompressed
    `raw` where the stored type is float32 already; copies of the frame's own bytes), or with
    `dequantize=False` as stored (views of `raw`, read-only where it is the frame's bytes)."""
    fmt, native = f["fmt"], NATIVE_DTYPES[f["dtype"]]
    if fmt == "compact":
        kv = quant.decode(f["scales"], bytes(raw), _compact_layout(shape))
        if kv is None:
            return Miss("bad_payload")
        return _block(f, kv[0], kv[1], root)
    half = len(raw) // 2
    stored = native if fmt == "native" else _FMT_DTYPES[fmt]
    k = _tensor_in(raw, 0, stored, shape)
    v = _tensor_in(raw, half, stored, shape)
    if fmt in _QUANTIZED:
        scales = np.frombuffer(f["scales"], np.float32)
        if not np.isfinite(scales).all():  # numpy: ~6x faster
            return Miss("bad_payload")
        s = torch.from_numpy(scales).view(2, *shape[:3])  # over the frame's scales (bytes)
        if not dequantize:
            return _block(f, k, v, root, s)
        k = dequantize_kv(k, s[0], torch.float32)
        v = dequantize_kv(v, s[1], torch.float32)
    elif dequantize:
        copy = not isinstance(raw, bytearray) and stored == torch.float32  # not the frame's
        k, v = (k.clone(), v.clone()) if copy else (k.float(), v.float())
    return _block(f, k, v, root)


def _block(
    f: dict[str, Any],
    k: torch.Tensor,
    v: torch.Tensor,
    root: BlockHash,
    scales: torch.Tensor | None = None,
) -> DecodedBlock:
    return DecodedBlock(
        token_ids=list(f["token_ids"]),
        k=k,
        v=v,
        parent=BlockHash(f["parent"]),
        fmt=f["fmt"],
        is_first=f["parent"] == root,
        scales=scales,
    )
