"""Rotary position embeddings (RoPE) as Hugging Face computes them: the inverse frequencies
(default, linear and llama3 scaling), the cos / sin tables and their application to a step's
query and key heads (rotate-half convention)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
from kvserve.kernels import cpu_ops
from kvserve.shared.config import ModelConfig
from torch import nn


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], as Hugging Face computes them (float32)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling_dict or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by cos/sin [T, 1, d] (HF's rotate-half convention)."""
    return x * cos + rotate_half(x) * sin


@dataclass
class Rope:
    """The step's positions [T] and the cos / sin tables [P, d] they index."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    @functools.cached_property
    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d] of the step's positions (for the torch path)."""
        return self.cos_table[self.positions][:, None], self.sin_table[self.positions][:, None]

    def apply_(self, qkv: torch.Tensor, num_rotated: int) -> torch.Tensor:
        """Rotate heads [0, num_rotated) of qkv [T, heads, d]: in place with the fused kernel,
        else as a new tensor of those heads; returns the rotated heads."""
        if cpu_ops.rope_(qkv, num_rotated, self.positions, self.cos_table, self.sin_table):
            return qkv[:, :num_rotated]
        return apply_rope(qkv[:, :num_rotated], *self.gathered)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed the way HF computes them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor = rope_inv_freq(config)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.device != device:
            size = max(n, 2 * self._cos.shape[0], 256)
            pos = torch.arange(size, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [size, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, d]
            self._cos, self._sin = emb.cos(), emb.sin()
            self._cast = {}
        return self._cos, self._sin

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, length: int | None = None
    ) -> Rope:
        """The tables for the step's positions [T], in `dtype`. `length`: one past the largest
        position, when the caller knows it (else read from `positions`: on a GPU, a wait for
        the device)."""
        n = int(positions.max()) + 1 if length is None else length
        cos_t, sin_t = self._table(n, positions.device)
        if dtype not in self._cast:
            self._cast[dtype] = (cos_t.to(dtype), sin_t.to(dtype))
        return Rope(positions, *self._cast[dtype])
