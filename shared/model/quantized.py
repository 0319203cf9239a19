"""A weight kept in its GGUF file's own blocks, and the operations the model needs on it.

GGUF quantizes a weight [out, in] in blocks of consecutive inputs of one output row (32, or
256 for the k-quants), so a weight is a byte matrix [out, in / block weights * block size]:
selecting, permuting or concatenating output rows is the same operation on the byte rows, and
the file's numbers never change.
`dequantize` expands a GGUF tensor's data to fp32: the loader expands the weights it does not
keep in blocks with it, and `QuantizedWeight.dequantize` the ones it keeps, so both give the
same fp32 for the same bytes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from kvserve.kernels import cpu_ops
from kvserve.kernels.cpu_qlinear import FORMATS


def dequantize(raw: np.ndarray, qtype: Any) -> np.ndarray:
    """A GGUF tensor's data as float32 with its logical shape. Q4_1 and Q8_0 (the default
    model's types) in torch's vectorized ops, with gguf's arithmetic (the same fp32
    operations in the same order, so bit-identical, tested), several times faster than gguf's
    numpy code. Every other type through `gguf.quants.dequantize`."""
    import gguf

    kind = gguf.GGMLQuantizationType
    if qtype not in (kind.Q4_1, kind.Q8_0):
        return gguf.quants.dequantize(raw, qtype).astype(np.float32)  # a copy, not a file view
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]  # bytes per block of 32
    rows = raw.shape[:-1]
    blocks = torch.from_numpy(raw.copy()).view(-1, type_size)  # raw: a read-only file view
    d = blocks[:, :2].contiguous().view(torch.float16).float()  # [n, 1]
    if qtype == kind.Q8_0:  # d (f16), then 32 int8 quants: q * d
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        out = q * d
    else:  # d, m (f16), then 16 bytes: low nibbles are quants 0-15, high nibbles 16-31
        m = blocks[:, 2:4].contiguous().view(torch.float16).float()
        packed = blocks[:, 4:]
        q = torch.cat((packed & 0x0F, packed >> 4), dim=1).float()
        out = d * q + m
    return out.reshape(*rows, -1).numpy()


@dataclass(frozen=True)
class QuantizedWeight:
    """`blocks`: uint8 [out_features, in_features / block weights * block size], a row of
    blocks per output row, in the file's byte layout; `fmt` a key of kernels.cpu_qlinear.FORMATS
    (the GGML type's name in lower case)."""

    fmt: str
    blocks: torch.Tensor

    @property
    def out_features(self) -> int:
        return int(self.blocks.shape[0])

    @property
    def in_features(self) -> int:
        weights, size = FORMATS[self.fmt]
        return int(self.blocks.shape[1]) // size * weights

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """The output rows at `index` (a gather: an embedding lookup)."""
        return QuantizedWeight(self.fmt, self.blocks[index])

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, in_features]: `dequantize` of the same bytes, as the loader expands them."""
        import gguf

        qtype = gguf.GGMLQuantizationType[self.fmt.upper()]
        return torch.from_numpy(dequantize(self.blocks.numpy(), qtype))


class BlockRows:
    """A weight's rows for lookups (an embedding). Q8_0 and Q4_1 blocks are split once into
    their fp32 scales (and Q4_1's mins) and their quants, so that a lookup gathers the rows and
    does `dequantize`'s arithmetic on them alone, bit-identical to it, without its per-call
    setup (~0.15 ms a decode step): in one C++ call where the kernels are built
    (cpu_ops.embed_rows; ~10 torch ops otherwise, ~0.08 ms in a decode step on an EPYC Zen 4).
    Other formats: `QuantizedWeight.rows(...).dequantize()`."""

    def __init__(self, weight: QuantizedWeight) -> None:
        self.weight: QuantizedWeight | None = None
        if weight.fmt not in ("q8_0", "q4_1"):
            self.weight = weight
            return
        size = FORMATS[weight.fmt][1]  # bytes per block of 32
        blocks = weight.blocks.view(weight.out_features, -1, size)
        self.d = blocks[..., :2].contiguous().view(torch.float16).float()  # [V, blocks, 1]
        self.m: torch.Tensor | None = None
        if weight.fmt == "q8_0":  # d (f16), then 32 int8 quants: q * d
            self.q = blocks[..., 2:].contiguous().view(torch.int8)
        else:  # d, m (f16), then 16 bytes: low nibbles are quants 0-15, high nibbles 16-31
            self.m = blocks[..., 2:4].contiguous().view(torch.float16).float()
            self.q = blocks[..., 4:].contiguous()

    def lookup(self, index: torch.Tensor) -> torch.Tensor:
        """fp32 [len(index), in_features]: the rows at `index`, dequantized."""
        if self.weight is not None:
            return self.weight.rows(index).dequantize()
        out = cpu_ops.embed_rows(self.q, self.d, self.m, index)  # one call, the same bits
        if out is not None:
            return out
        d = self.d[index]
        if self.m is None:
            out = self.q[index].float() * d
        else:
            packed = self.q[index]
            out = d * torch.cat((packed & 0x0F, packed >> 4), dim=-1).float() + self.m[index]
        return out.reshape(index.shape[0], -1)


@dataclass(frozen=True)
class StackedBlocks:
    """Weights stacked along the output rows whose blocks differ in format (Q4_K_M files store
    some layers' V projections as Q6_K beside Q4_K Q and K): each part keeps its own blocks,
    and the stack's output is the parts' outputs side by side."""

    parts: tuple[QuantizedWeight, ...]

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    @property
    def in_features(self) -> int:
        return self.parts[0].in_features

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])


Weight = torch.Tensor | QuantizedWeight  # a tensor as loaded
LinearWeight = Weight | StackedBlocks  # what a linear layer takes


def fuse(parts: Sequence[Weight]) -> LinearWeight:
    """Weights stacked along the output rows (a fused QKV or gate/up projection): in the file's
    blocks when every part is in the file's blocks (one matrix of them where the formats agree,
    else StackedBlocks of the runs of neighbours in one format), else as fp32 (or the tensors'
    dtype)."""
    blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(blocks) < len(parts):
        return torch.cat([expand(p) for p in parts])
    runs = [
        QuantizedWeight(fmt, torch.cat([p.blocks for p in run]))
        for fmt, run in itertools.groupby(blocks, key=lambda p: p.fmt)
    ]
    return runs[0] if len(runs) == 1 else StackedBlocks(tuple(runs))


def expand(weight: LinearWeight) -> torch.Tensor:
    return weight if isinstance(weight, torch.Tensor) else weight.dequantize()
