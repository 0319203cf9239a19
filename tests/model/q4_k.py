"""A Q4_K encoder for tests (the default model's file has no Q4_K tensor): GGML's block layout,
each sub-block of 32 quantized between its min and max (not llama.cpp's search for the best
scales: the tests compare a kernel with the expansion of the same blocks)."""

from __future__ import annotations

import numpy as np


def q4_k_blocks(w: np.ndarray) -> np.ndarray:
    """float32 [n, k] (k a multiple of 256) -> uint8 [n, k / 256 * 144]: per block of 256, fp16
    d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes of quants (group j's byte
    l: weight l of sub-block 2j in the low nibble, of 2j + 1 in the high); w ~ d sc q - dmin mn."""
    n, k = w.shape
    sub = w.astype(np.float32).reshape(n, k // 256, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # [n, nb, 8]: the offset is -dmin mn <= 0
    step = (sub.max(-1) - lo) / 15
    d = (step.max(-1) / 63).astype(np.float16)  # [n, nb]
    dmin = (-lo.min(-1) / 63).astype(np.float16)
    sc = np.round(step / np.maximum(d.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    mn = np.round(-lo / np.maximum(dmin.astype(np.float32), 1e-30)[..., None]).clip(0, 63)
    scale = d.astype(np.float32)[..., None] * sc
    offset = dmin.astype(np.float32)[..., None] * mn
    q = np.round((sub + offset[..., None]) / np.maximum(scale, 1e-30)[..., None]).clip(0, 15)
    sc, mn, q = sc.astype(np.uint8), mn.astype(np.uint8), q.astype(np.uint8)
    scales = np.concatenate(
        (
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 0x0F) | ((mn[..., 4:] & 0x0F) << 4),
        ),
        axis=-1,
    )
    pairs = q.reshape(n, k // 256, 4, 2, 32)
    qs = (pairs[..., 0, :] | (pairs[..., 1, :] << 4)).reshape(n, k // 256, 128)
    halves = (d[..., None].view(np.uint8), dmin[..., None].view(np.uint8))
    return np.concatenate((*halves, scales, qs), axis=-1).reshape(n, -1)
