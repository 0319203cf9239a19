"""Fused elementwise kernels for the CPU forward pass, fp32: RMSNorm (with the residual add
folded in), RoPE applied in place, and SiLU(gate) * up, as vLLM's CPU backend fuses them; the
K/V write into the paged cache in one call (quantizing for an int8 or fp8 cache); a store load's
blocks into their cache blocks in one call; a quantized embedding's rows; and the sampler's
argmax + logsumexp.

Each replaces several torch ops (and their temporaries) with one pass over the rows, which
matters both at batch 1, where a decode step is ~25 small ops per layer, and in prefill, where
the unfused SiLU * up reads and writes strided multi-MB temporaries. Every row is
computed on its own, the same way whatever else shares the call (batch independence). The
arithmetic is Hugging Face's (fp32 throughout, the same formulas); only the order of the
reduction in RMSNorm and fused multiply-adds differ, by a few ulps.

Each function returns None (or False) where the kernel cannot be built or does not apply
(not fp32 on the CPU): the model then uses its torch code.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from kvserve.kernels import cpp_build, reference


def _extension() -> Any | None:
    """The compiled kernels (cpp_build.extension), or None where they cannot be built."""
    return cpp_build.extension()


def available() -> bool:
    return _extension() is not None


def _applies(*tensors: torch.Tensor) -> bool:
    # A loop, not all() over a generator: this runs ~150 times in a batch-1 decode step.
    for t in tensors:  # noqa: SIM110
        if t.dtype != torch.float32 or not t.is_cpu:
            return False
    return True


def _rows_contiguous(t: torch.Tensor) -> bool:
    """Whether t [T, heads, d] holds each token's heads as one contiguous run (any token
    stride): what the kernels that walk a token's heads take."""
    return t.stride(2) == 1 and t.stride(1) == t.shape[2]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * x / sqrt(mean(x^2) + eps) over the last dim of x [T, n], or None."""
    ext = _extension() if _applies(x, weight) else None  # no build for a GPU's tensors
    if ext is None:
        return None
    out: torch.Tensor = ext.rms_norm(x.contiguous(), weight.contiguous(), eps)
    return out


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor | None:
    """residual += x in place and return rms_norm(residual); None (residual untouched) where
    the kernel does not apply. `residual` must be contiguous."""
    ext = _extension() if _applies(x, residual, weight) else None
    if ext is None or not residual.is_contiguous():
        return None
    out: torch.Tensor = ext.add_rms_norm(x.contiguous(), residual, weight.contiguous(), eps)
    return out


def rope_(
    qkv: torch.Tensor,
    num_rotated: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> bool:
    """Rotate heads [0, num_rotated) of qkv [T, heads, d] in place by the rows `positions` of
    the tables cos / sin [P, d]. False (nothing done) where the kernel does not apply."""
    ext = _extension() if _applies(qkv, cos, sin) else None
    if ext is None or not _rows_contiguous(qkv) or positions.dtype != torch.int64:
        return False
    ext.rope_(qkv, num_rotated, positions.contiguous(), cos.contiguous(), sin.contiguous())
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up for gate_up [T, 2I] = [gate | up], or None."""
    ext = _extension() if _applies(gate_up) else None
    if ext is None:
        return None
    out: torch.Tensor = ext.silu_mul(gate_up.contiguous())
    return out


def takes_cache(k_cache: torch.Tensor, v_cache: torch.Tensor, k_scale: torch.Tensor | None) -> bool:
    """Whether the C++ kernels (K/V write, decode attention, the one-call decode step) take
    this KV cache: fp32 without scales, or int8 / fp8 (e4m3) with them, on the CPU."""
    if k_scale is None:
        return _applies(k_cache, v_cache)
    quantized = reference.is_quantized(k_cache.dtype) and v_cache.dtype == k_cache.dtype
    return quantized and k_cache.is_cpu


def store_kv(
    key: torch.Tensor,  # [T, kvh, d]
    value: torch.Tensor,  # [T, kvh, d]
    k_cache: torch.Tensor,  # [nb, bs, kvh, d]
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [T] int64
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> None:
    """`reference.store_kv` in one call for fp32 caches (each token's K and V rows copied to
    their slots) and int8 / fp8 ones (each row quantized as `reference.quantize_kv` does, bit
    for bit, its scale written beside); other caches go to the reference."""
    ext = _extension()
    rows_contiguous = _rows_contiguous(key) and _rows_contiguous(value)
    scales = (None, None) if k_scale is None else (k_scale, v_scale)
    if (
        ext is None
        or not (_applies(key, value) and takes_cache(k_cache, v_cache, k_scale))
        or not (rows_contiguous and k_cache.is_contiguous() and v_cache.is_contiguous())
        or not all(s is None or s.is_contiguous() for s in scales)
        or slot_mapping.dtype != torch.int64
    ):
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
        return
    ext.store_kv(key, value, k_cache, v_cache, slot_mapping.contiguous(), *scales)


Buffer = bytes | bytearray | memoryview
# The element types a frame's payload may hold, by the name write_frames knows them by.
_STORED_NAMES = {
    torch.int8: "int8",
    torch.float8_e4m3fn: "fp8",
    torch.float32: "float32",
    torch.bfloat16: "bfloat16",
    torch.float16: "float16",
}


def write_frames(
    k: Sequence[Buffer],  # per block: K's bytes [num_layers, block_size, kvh, d] as stored
    v: Sequence[Buffer],
    scales: Sequence[Buffer] | None,  # int8 / fp8: fp32 [2, num_layers, block_size, kvh]
    stored: torch.dtype,  # K's and V's element type
    k_cache: list[torch.Tensor],  # per layer [num_blocks, block_size, kvh, d]
    v_cache: list[torch.Tensor],
    k_scale: list[torch.Tensor | None],  # per layer [num_blocks, block_size, kvh], or Nones
    v_scale: list[torch.Tensor | None],
    blocks: list[int],  # block j's cache block
    checksums: tuple[list[bytes], list[bytes]] | None = None,  # (heads, digests) per block
) -> int | None:
    """A store load's blocks, as bytes (a frame's payload halves: no tensor made per frame),
    into their cache blocks in one call without the GIL: a copy of their bytes (and scales)
    where they are stored in the cache's own format, dequantized into an fp32 cache where they
    are int8 / fp8 (as `reference.dequantize_kv`, bit for bit). `checksums`: block j's frame
    checksum (codec.Checksum's head and digest; an empty digest: verified already), checked
    just before block j is written. How many leading blocks were written (up to the first whose
    checksum fails); None (nothing written) where the kernel does not apply: another device or
    pairing."""
    ext = _extension()
    if ext is None or not k or not k_cache[0].is_cpu or stored not in _STORED_NAMES:
        return None
    cache = k_cache[0].dtype
    quantized = reference.is_quantized(stored)
    if (stored != cache and not (quantized and cache == torch.float32)) or (
        quantized and scales is None
    ):
        return None
    cache_scales = ([s for s in k_scale if s is not None], [s for s in v_scale if s is not None])
    heads, digests = checksums or ([], [])
    written: int = ext.write_frames(
        list(k), list(v), list(scales or []), _STORED_NAMES[stored], k_cache, v_cache,
        *cache_scales, blocks, heads, digests,
    )  # fmt: skip
    return written


def write_templated(
    frames: Sequence[Buffer],  # whole frames, each laid out as the template says
    heads: list[bytes],  # per frame: its bytes up to the scales
    hashed: list[bytes],  # per frame: its checksum's head
    middle: bytes,  # between the scales and the payload
    tail: bytes,  # between the payload and the digest
    scales_len: int,
    payload_len: int,
    stored: torch.dtype,
    k_cache: list[torch.Tensor],
    v_cache: list[torch.Tensor],
    k_scale: list[torch.Tensor | None],
    v_scale: list[torch.Tensor | None],
    blocks: list[int],
) -> tuple[int, int] | None:
    """write_frames for whole frames laid out byte for byte as one template
    (codec.FrameTemplate): frame j is heads[j], its finite scales, `middle`, the payload,
    `tail` and its digest, its checksum taken over hashed[j], the scales and the payload. Each
    frame's layout and checksum are checked just before its block is written, without the GIL.
    (blocks written, why it stopped: 0 none did, 1 the next frame is laid out otherwise, 2 its
    checksum fails); None (nothing written) where the kernel does not apply."""
    ext = _extension()
    if ext is None or not frames or not k_cache[0].is_cpu or stored not in _STORED_NAMES:
        return None
    cache = k_cache[0].dtype
    if stored != cache and not (reference.is_quantized(stored) and cache == torch.float32):
        return None
    cache_scales = ([s for s in k_scale if s is not None], [s for s in v_scale if s is not None])
    written, stop = ext.write_templated(
        list(frames), heads, hashed, middle, tail, scales_len, payload_len,
        _STORED_NAMES[stored], k_cache, v_cache, *cache_scales, blocks,
    )  # fmt: skip
    return int(written), int(stop)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A CPU tensor's bytes as a flat buffer (a copy only where it is not contiguous)."""
    flat: Any = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    return memoryview(flat)


def embed_rows(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor | None:
    """The rows `ids` of a Q4_1 (with mins `m`) or Q8_0 embedding as BlockRows splits it
    (shared/model/quantized.py), dequantized to fp32 [len(ids), in_features] bit for bit as its
    torch ops do, in one call; or None. An id outside the table raises."""
    ext = _extension() if ids.is_cpu and d.is_cpu else None
    if ext is None or ids.dtype != torch.long or ids.dim() != 1:
        return None
    out: torch.Tensor = ext.embed_rows(q, d, m, ids.contiguous())
    return out


def argmax_logsumexp(
    logits: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Per row of logits [N, V]: the argmax (the first, as torch.argmax), logsumexp and the
    largest logit (the argmax's own), in one call reading each row twice; or None."""
    ext = _extension() if _applies(logits) else None
    if ext is None or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    ids, lse, top = ext.argmax_logsumexp(logits.contiguous())
    return ids, lse, top
