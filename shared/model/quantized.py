"""A weight kept in its GGUF file's own blocks, and the operations the model needs on it.

GGUF quantizes a weight [out, in] in blocks of consecutive inputs of one output row (32, or
256 for the k-quants), so a weight is a byte matrix [out, in / block weights * block size]:
selecting, permuting or concatenating output rows is the same operation on the byte rows, and
the file's numbers never change.
`dequantize` gives exactly the fp32 expansion the loader gives for the same tensor.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from kvserve.kernels.cpu_qlinear import FORMATS


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
        """fp32 [rows, in_features]: the loader's expansion of the same bytes, bit for bit."""
        import gguf
        from kvserve.shared.model.loader import dequantize

        qtype = gguf.GGMLQuantizationType[self.fmt.upper()]
        return torch.from_numpy(dequantize(self.blocks.numpy(), qtype))


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
