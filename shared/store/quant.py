"""The compact quantization of a KV block: the `compact` store format (at most 1/4 of raw fp16).

Shapes: K and V of one block are [L, T, H, D] (layers, block tokens, KV heads, head_dim).
Three things set the design (the measurements on SmolLM2-135M are in docs/store_formats.md):
- K must be quantized per channel (K has outlier channels); per-token K, even rotated and with
  the channel means removed, is several times worse in KLD. Per-channel scales for 16 tokens
  cost 1-2 bits a value, so K uses one absolute step per (layer, head) and an integer offset
  per channel: every channel keeps the same absolute error, and the entropy coder spends the
  bits where the values spread.
- V is quantized per token after a fixed orthogonal rotation (a sign-flipped Hadamard transform
  over head_dim), which spreads outliers so the values are near-Gaussian; the step follows the
  token's RMS, coded on a log scale in one byte.
- Position 0 of a sequence is the attention sink: that one token carries a large share of the
  KLD. Its K and V get a 4x finer step when the encoder is told the block is the first of its
  chain.
The values are stored as bytes and entropy-coded by zstd tuned to act as a Huffman coder
(min_match 7, fast strategy), which comes close to their order-0 entropy; zstd's default match
finder spends bits on spurious short matches in this noise-like data. No delta coding between
neighbouring tokens (CacheGen): K and V of adjacent tokens are barely correlated in this model,
so deltas spread wider than the values.

Layout (little-endian; every size follows from L, T, H, D):
- `scales`: float32 [3, L, H]: K step (tokens 1..T-1), K step of token 0, V reference step.
- raw payload (zstd-compressed, one section per zstd block so each gets its own Huffman table):
  int16 [L, H, D] K channel offsets (in K steps) | int8 [L, H, D] K residuals of token 0 |
  int8 [L, T-1, H, D] K residuals of tokens 1.. | int8 [L, H, D] V values of token 0 (rotated) |
  int8 [L, T-1, H, D] V values of tokens 1.. | uint8 [L, T, H] V step codes. Token 0 has
  sections of its own so that a finer sink step does not widen everyone's Huffman code. (The
  sink's key lies far from the block's channel means, so in some heads its step stays coarser
  than SINK_FACTOR to keep the residuals in int8; int16 there cost more than it won.)
- decoding: K = (offset * k_step + residual * step_t), step_t the token-0 step for t = 0;
  V = (value * v_ref * 2 ** (-code / 16)) @ R^T, R the rotation. The codes span 16 octaves
  below the head's coarsest V step; a token smaller than that gets the floor step.

Invariants:
- no clipping: steps are raised where needed so every residual fits its integer type; the error
  of each K element is at most half its step, and each V vector's error (L2) at most
  sqrt(D) / 2 times its step;
- `decode` accepts any bytes of the right sizes and returns finite tensors or None (steps not
  finite and positive, or a product overflowing float32); it never raises on data;
- `encode` keeps scales + compressed payload within `BUDGET` of raw fp16 (the frame's header
  adds ~0.1%): a block that comes out larger is re-encoded with both steps coarsened by the
  factor its excess predicts (coarsening by g saves about log2(g) bits a value), at most
  MAX_RETRIES times and up to MAX_COARSEN; real blocks rarely need it. Shapes too small for
  their scales to fit the budget just get the coarsest steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Final

import torch
import zstandard

# Step of K relative to the RMS of the head's in-block deviations from the channel means, and
# of V relative to the token's RMS (after rotation). Tuned on SmolLM2-135M for <= 0.25x fp16.
K_STEP: Final = 0.26
V_STEP: Final = 0.47
SINK_FACTOR: Final = 0.25  # step multiplier for token 0 of the first block of a chain
BUDGET: Final = 0.249  # cap on (scales + compressed payload) / raw fp16 bytes of the block
MAX_RETRIES: Final = 8
MAX_COARSEN: Final = 64.0  # steps never grow past this factor (tiny shapes cannot meet BUDGET)
CODE_STEPS_PER_OCTAVE: Final = 16  # V step codes: step = v_ref * 2 ** (-code / 16)
_TINY: Final = torch.finfo(torch.float32).tiny

# zstd as an order-0 entropy coder: no match is shorter than 7 bytes, so the noise-like values
# go to the literal (Huffman) stream instead of spurious short matches.
_ZSTD_PARAMS: Final = zstandard.ZstdCompressionParameters(
    window_log=17,
    chain_log=12,
    hash_log=12,
    search_log=1,
    min_match=7,
    target_length=0,
    strategy=zstandard.STRATEGY_FAST,
    write_content_size=True,
)


@dataclass(frozen=True)
class CompactLayout:
    """Byte sizes of a compact block of shape [L, T, H, D]."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def scales_bytes(self) -> int:
        return 3 * self.num_layers * self.num_kv_heads * 4

    @property
    def sections(self) -> tuple[int, ...]:
        """Bytes of the raw payload's sections, in order: K offsets, K token 0, K tokens 1..,
        V token 0, V tokens 1.., V step codes."""
        L, T, H, D = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        one, rest = L * H * D, L * (T - 1) * H * D
        return (2 * one, one, rest, one, rest, L * T * H)

    @property
    def payload_bytes(self) -> int:
        return sum(self.sections)

    @property
    def raw_fp16_bytes(self) -> int:
        L, T, H, D = self.num_layers, self.block_size, self.num_kv_heads, self.head_dim
        return 2 * L * T * H * D * 2


@dataclass(frozen=True)
class CompactBlock:
    """One encoded block: `scales` (float32 bytes) and `payload` (a zstd frame)."""

    scales: bytes
    payload: bytes


@lru_cache(maxsize=8)
def rotation(d: int) -> torch.Tensor:
    """The fixed orthogonal [d, d] float32 matrix V is rotated by: diag(signs) @ Hadamard / sqrt(d)
    for d a power of two (signs from a fixed 64-bit LCG, so every platform agrees), the
    identity otherwise."""
    if d < 1 or d & (d - 1):
        return torch.eye(max(d, 1))
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    x, signs = 0x5EED, []
    for _ in range(d):
        x = (x * 6364136223846793005 + 1442695040888963407) % 2**64
        signs.append(-1.0 if x >> 63 else 1.0)
    return torch.tensor(signs)[:, None] * h / math.sqrt(d)


def _k_steps(k: torch.Tensor, rel: float, sink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """K step [L, 1, H, 1] and token-0 step [L, 1, H, 1] for k [L, T, H, D], raised so that
    offsets fit int16 and residuals int8."""
    mean = k.mean(1, keepdim=True)  # [L, 1, H, D]
    dev = k - mean
    rms = dev.square().mean((1, 3), keepdim=True).sqrt()
    maxdev = dev[:, 1:].abs().amax((1, 3), keepdim=True) if k.shape[1] > 1 else rms
    step = torch.maximum(rel * rms, maxdev / 126.0)
    step = torch.maximum(step, mean.abs().amax(3, keepdim=True) / 32000.0).clamp_min(_TINY)
    off = torch.round(mean / step)
    dev0 = (k[:, :1] - off * step).abs().amax(3, keepdim=True)
    step0 = torch.maximum(step * sink, dev0 / 127.0).clamp_min(_TINY)
    return step, step0


def _v_codes(vr: torch.Tensor, rel: float, sink: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference step [L, 1, H, 1] and uint8 codes [L, T, H] for the rotated V [L, T, H, D]:
    step_t = ref * 2 ** (-code_t / 16) >= the wanted step, and >= max|v_t| / 127."""
    rms = vr.square().mean(-1, keepdim=True).sqrt()
    want = torch.maximum(rel * rms, vr.abs().amax(-1, keepdim=True) / 127.0)
    want[:, :1] *= sink
    want = want.clamp_min(_TINY)
    ref = want.amax(1, keepdim=True)
    code = torch.floor(CODE_STEPS_PER_OCTAVE * torch.log2(ref / want)).clamp(0, 255)
    return ref, code[..., 0].to(torch.uint8)


def _v_steps(ref: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """[L, T, H, 1] V steps from ref [L, 1, H, 1] and codes [L, T, H] uint8."""
    return ref * torch.exp2(-code.float()[..., None] / CODE_STEPS_PER_OCTAVE)


def _encode_once(
    k: torch.Tensor, v: torch.Tensor, k_rel: float, v_rel: float, sink: float
) -> CompactBlock:
    step, step0 = _k_steps(k, k_rel, sink)
    off = torch.round(k.mean(1, keepdim=True) / step)  # [L, 1, H, D]
    steps = torch.cat([step0, step.expand(-1, k.shape[1] - 1, -1, -1)], 1)
    kq = torch.round((k - off * step) / steps).clamp_(-127, 127)  # in range by construction
    vr = v @ rotation(v.shape[-1])
    ref, code = _v_codes(vr, v_rel, sink)
    vq = torch.round(vr / _v_steps(ref, code)).clamp_(-127, 127)
    scales = torch.stack([step.flatten(), step0.flatten(), ref.flatten()])  # [3, L*H]
    kq, vq = kq.to(torch.int8), vq.to(torch.int8)
    sections = (off.to(torch.int16), kq[:, :1], kq[:, 1:], vq[:, :1], vq[:, 1:], code)
    cobj = zstandard.ZstdCompressor(compression_params=_ZSTD_PARAMS).compressobj(
        size=sum(s.numel() * s.element_size() for s in sections)
    )
    chunks = []
    for s in sections:  # one zstd block (and Huffman table) per section
        chunks.append(cobj.compress(s.contiguous().view(torch.uint8).numpy().tobytes()))
        chunks.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    chunks.append(cobj.flush())
    return CompactBlock(scales.numpy().tobytes(), b"".join(chunks))


def encode(k: torch.Tensor, v: torch.Tensor, first: bool) -> CompactBlock:
    """k, v: finite float [L, T, H, D]. `first`: the block is the first of its chain, so its
    token 0 is the attention sink and its steps are scaled by SINK_FACTOR."""
    k, v = k.detach().float().cpu(), v.detach().float().cpu()
    if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        raise ValueError("compact: K/V must be finite")
    L, T, H, D = k.shape
    layout = CompactLayout(L, T, H, D)
    budget = BUDGET * layout.raw_fp16_bytes
    sink = SINK_FACTOR if first else 1.0
    g = 1.0
    out = _encode_once(k, v, K_STEP, V_STEP, sink)
    for _ in range(MAX_RETRIES):
        excess = len(out.scales) + len(out.payload) - budget
        if excess <= 0:
            break
        if g >= MAX_COARSEN:
            break
        g = min(MAX_COARSEN, g * 1.02 * 2.0 ** min(8.0 * excess / (k.numel() + v.numel()), 6.0))
        out = _encode_once(k, v, K_STEP * g, V_STEP * g, sink)
    return out


def decode(
    scales: bytes, raw: bytes, layout: CompactLayout
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """float32 K, V [L, T, H, D] from `scales` and the decompressed payload `raw`, whose sizes
    the caller has checked against `layout`; None if the values are not usable (a step not
    finite and positive, or a decoded value not finite)."""
    L, T, H, D = layout.num_layers, layout.block_size, layout.num_kv_heads, layout.head_dim
    s = torch.frombuffer(bytearray(scales), dtype=torch.float32).view(3, L, 1, H, 1)
    if not (bool(torch.isfinite(s).all()) and bool((s > 0).all())):
        return None
    buf = bytearray(raw)
    off = torch.frombuffer(buf, dtype=torch.int16, count=L * H * D).view(L, 1, H, D)
    parts = torch.frombuffer(buf, dtype=torch.uint8).split(list(layout.sections))
    k0, k1, v0, v1 = (p.view(torch.int8).view(L, -1 if p.numel() else 0, H, D) for p in parts[1:5])
    kq, vq = torch.cat([k0, k1], 1), torch.cat([v0, v1], 1)
    code = parts[5].view(L, T, H)
    step, step0, ref = s[0], s[1], s[2]
    steps = torch.cat([step0, step.expand(-1, T - 1, -1, -1)], 1)
    k = off.float() * step + kq.float() * steps
    v = (vq.float() * _v_steps(ref, code)) @ rotation(D).T
    if not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all())):
        return None
    return k, v
