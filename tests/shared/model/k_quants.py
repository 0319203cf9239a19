"""Q4_K, Q5_K and Q6_K encoders for tests (the default model's file has no k-quant tensor): GGML's
block layouts, each sub-block quantized by its range (not llama.cpp's search for the best
scales: the tests compare a kernel with the expansion of the same blocks)."""

from __future__ import annotations

import numpy as np


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> uint8 [n, k / 256 * 144]: per block of 256, fp16
    d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of quants (group j's byte
    l: weight l of sub-block 2j in the low nibble, of 2j + 1 in the high); w ~ d sc q - dmin mn."""
    return _k_blocks(w, bits=4)


def q5_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] -> uint8 [n, k / 256 * 176]: Q4_K's layout with 32 bytes of fifth bits
    (bit j of byte l: weight l of sub-block j) between the scales and the low 4 bits."""
    return _k_blocks(w, bits=5)


def _k_blocks(w: np.ndarray, bits: int) -> np.ndarray:
    n, k = w.shape
    top = (1 << bits) - 1
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [n, nb, 8]: the offset is -dmin mn <= 0
    step = (sub.max(-1) - lo) / top
    d = (step.max(-1) / 63).astype(np.float16)  # [n, nb]
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    sc = np.round(step / np.maximum(d.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    mn = np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.round((sub + offset[..., None]) / np.maximum(scale, 1e-30)[..., None]).clip(0, top)
    sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
    scales = np.concatenate(
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ),
        axis=-1,
    )
    pairs = (q & 15).reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, k // 256, 128)
    halves = (d[..., None].view(np.uint8), dmin[..., None].view(np.uint8))
    if bits == 4:
        return np.concatenate((*halves, scales, qs), axis=-1).reshape(n, -1)
    fifth = ((q >> 4) << np.arange(8, dtype=np.uint8)[:, None]).sum(axis=-2, dtype=np.uint8)
    return np.concatenate((*halves, scales, fifth, qs), axis=-1).reshape(n, -1)


def q6_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> uint8 [n, k / 256 * 210]: per block of 256, 128
    bytes of the quants' low 4 bits, 64 of their high 2 bits (GGML's order: weight 32 t + l of
    each half of 128 in ql[32 (t & 1) + l]'s low (t < 2) or high nibble and qh[l]'s bits 2t),
    16 int8 scales of sub-blocks of 16, fp16 d; w ~ d sc (q - 32)."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 16, 16)
    step = np.abs(sub).max(-1) / 31  # [n, nb, 16]
    d = (np.abs(step).max(-1) / 127).astype(np.float16)
    sc = np.round(step / np.maximum(d.astype(np.float32), 1e-30)[..., None]).clip(-128, 127)
    scale = d.astype(np.float32)[..., None] * sc
    q = np.round(sub / np.maximum(scale, 1e-30)[..., None]).clip(-32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(n, k // 256, 2, 4, 32)  # [.., half, t, l]
    lo, hi = q & 15, q >> 4
    ql = np.concatenate(
        (lo[..., 0, :] | (lo[..., 2, :] << 4), lo[..., 1, :] | (lo[..., 3, :] << 4)), -1
    )
    qh = hi[..., 0, :] | (hi[..., 1, :] << 2) | (hi[..., 2, :] << 4) | (hi[..., 3, :] << 6)
    parts = (
        ql.reshape(n, k // 256, 128),
        qh.reshape(n, k // 256, 64),
        sc.astype(np.int8).view(np.uint8),
        d[..., None].view(np.uint8),
    )
    return np.concatenate(parts, axis=-1).reshape(n, -1)
