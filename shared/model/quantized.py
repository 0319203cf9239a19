"""A weight kept in its GGUF file's own blocks, and the operations the model needs on it.

GGUF quantizes a weight [out, in] in blocks of consecutive inputs of one output row (32, or
256 for the k-quants), so a weight is a byte matrix [out, in / block weights * block size]:
selecting, permuting or concatenating output rows is the same operation on the byte rows, and
the file's numbers never change.
`dequantize` gives exactly the fp32 expansion the loader gives for the same tensor.
"""

from __future__ import annotations

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


Weight = torch.Tensor | QuantizedWeight


def fuse(parts: Sequence[Weight]) -> Weight:
    """Weights stacked along the output rows (a fused QKV or gate/up projection): in the file's
    blocks when every part is in the same format, else as fp32 (or the tensors' dtype)."""
    blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(blocks) == len(parts) and len({p.fmt for p in blocks}) == 1:
        return QuantizedWeight(blocks[0].fmt, torch.cat([p.blocks for p in blocks]))
    return torch.cat([expand(p) for p in parts])


def expand(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight
