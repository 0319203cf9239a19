"""The model's linear layer: y = x @ W.T over whichever copy of the weight this machine's
fastest kernel for it reads (see `Linear`)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from kvserve.kernels import cpu_linear, cpu_qlinear
from kvserve.shared.model import huge_pages
from kvserve.shared.model.quantized import LinearWeight, QuantizedWeight, StackedBlocks
from torch import nn


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


# (out, in features) -> whether oneDNN's sums are the panels' for weights of that shape: the
# order of a row's sums depends on the kernels and the shape, not on the weight's values.
_SAME_SUMS: dict[tuple[int, int], bool] = {}


def _same_sums(panels: torch.Tensor, packed: torch.Tensor, n: int, k: int) -> bool:
    """Whether oneDNN's matmul over `packed` gives every output bit for bit as cpu_linear's over
    `panels` (the same weight), on a probe of more rows than cpu_linear.max_rows(): so that
    where a call of many rows goes to oneDNN, a row's result still does not depend on the
    batch. Both sum a row's products in the same order (on AVX2 runs of 1,024 k, the runs'
    sums added in turn: cpu_linear follows oneDNN), which the probe checks on this machine's
    oneDNN: where the orders agree every input agrees, where they differ almost every output
    of a random probe does."""
    if (n, k) not in _SAME_SUMS:
        rows = (cpu_linear.max_rows() or 0) + 8
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(0))
        ours = cpu_linear.linear(x, panels, n, any_rows=True)
        theirs = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        _SAME_SUMS[n, k] = ours is not None and torch.equal(ours, theirs)
    return _SAME_SUMS[n, k]


class Linear(nn.Module):
    """y = x @ W.T. fp32 on the CPU: kernels.cpu_linear's GEMM over the weight packed once into
    column panels (faster than oneDNN at decode batch sizes, and a row's result does not depend
    on the batch). Where that does not apply (bf16 matmuls, no compiler, more rows than
    cpu_linear.max_rows() on an AVX2 machine) the weight prepacked for oneDNN (what
    torch.compile's CPU backend does with frozen weights; faster than F.linear's BLAS path);
    elsewhere plain F.linear. Only the copies a path needs are kept. On an AVX2 machine a weight
    whose oneDNN sums differ from the panels' (`_same_sums`; none of the model's do), or that
    oneDNN cannot take, keeps the panels for every call: a token's result is the same however
    many rows its call had (a prompt computed whole, or only its question after a cached
    prefix).

    A weight in its GGUF file's blocks (QuantizedWeight, or StackedBlocks of several formats:
    one panel matrix per part) is packed for kernels.cpu_qlinear,
    which computes on activations quantized to two int8 terms (`int8_activations`); without the
    compiled kernels it is expanded.

    `compute_dtype` (default: the weight's) is the dtype of the matmul itself: the weight is
    stored in it, the input is cast to it and the output back to the input's dtype (bfloat16
    matmuls in a float32 model use the CPU's bf16 dot-product instructions)."""

    def __init__(self, weight: LinearWeight, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The file's blocks as panels with their output features: one part, or StackedBlocks'
        # parts side by side
        self.qparts: list[tuple[torch.Tensor, int]] = []
        self.panels: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.int8_activations = False
        self.panels_only = False  # the panels take calls of any number of rows
        if isinstance(weight, QuantizedWeight | StackedBlocks):
            self.out_features, self.in_features = weight.out_features, weight.in_features
            self.compute_dtype = torch.float32
            if cpu_qlinear.available() and compute_dtype in (None, torch.float32):
                parts = weight.parts if isinstance(weight, StackedBlocks) else (weight,)
                self.qparts = [(cpu_qlinear.pack(p.blocks, p.fmt), p.out_features) for p in parts]
                self.int8_activations = True
                return
            weight = weight.dequantize()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype or weight.dtype
        weight = weight.to(self.compute_dtype)
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_linear.available():
            self.panels = cpu_linear.pack(weight)
        if self.panels is not None and cpu_linear.max_rows() is None:
            return  # the panels take every input
        if _can_prepack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            except RuntimeError:  # a torch build without the op's kernel
                self.packed = None
        if self.panels is not None and (
            self.packed is None or not _same_sums(self.panels, self.packed, *weight.shape)
        ):
            self.packed, self.panels_only = None, True
            return
        if self.packed is None:
            self.weight = weight.contiguous()

    @property
    def weight_bytes(self) -> int:
        """The bytes of the copy of the weight a matmul reads (the first `forward` tries)."""
        if self.qparts:
            return sum(p.numel() for p, _ in self.qparts)
        kept = [t for t in (self.panels, self.packed, self.weight) if t is not None]
        return kept[0].numel() * kept[0].element_size()

    @property
    def qpanels(self) -> torch.Tensor | None:
        """The file's blocks as one panel matrix, or None (none, or parts side by side)."""
        return self.qparts[0][0] if len(self.qparts) == 1 else None

    @property
    def cpp_weight(self) -> torch.Tensor | None:
        """The weight as kernels.cpu_decode_step takes it (either kind of panels), or None."""
        return self.qpanels if self.qpanels is not None else self.panels

    @property
    def cpp_parts(self) -> list[tuple[torch.Tensor, int]] | None:
        """The weight as panel matrices side by side with their output features (one, or the
        parts of StackedBlocks), or None."""
        if self.qparts:
            return self.qparts
        return None if self.panels is None else [(self.panels, self.out_features)]

    def kernel_tensors(self) -> list[torch.Tensor]:
        """The tensors this machine's kernels read for a matmul (the quantized parts' panels,
        or the fp32 panels; none where oneDNN or F.linear computes it), in the order read."""
        if self.qparts:
            return [p for p, _ in self.qparts]
        return [] if self.panels is None else [self.panels]

    def use_copies(self, copies: Sequence[torch.Tensor]) -> None:
        """Read `copies` of `kernel_tensors()` (the same values) in their place from now."""
        if self.qparts:
            self.qparts = [(c, n) for c, (_, n) in zip(copies, self.qparts, strict=True)]
        elif self.panels is not None:
            (self.panels,) = copies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        y: torch.Tensor | None = None
        if self.qparts:
            outs = []
            for panels, n in self.qparts:
                part = cpu_qlinear.linear(x, panels, n)
                assert part is not None, "the quantized kernel takes every fp32 input"
                outs.append(part)
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if y is None and self.panels is not None:
            y = cpu_linear.linear(x, self.panels, self.out_features, self.panels_only)
        if y is None and self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, None, "none", [], ""
            )
        if y is None:
            assert self.weight is not None, "no matmul path for this input"
            y = F.linear(x, self.weight)
        return y if y.dtype == dtype else y.to(dtype)


def gather_on_huge_pages(layers: Sequence[Linear]) -> None:
    """Every layer's kernel tensors moved into one huge_pages mapping, in the order given (a
    decode step's, so that a step walks the mapping front to back), layer by layer (each
    layer's old tensors are freed as it takes its copies); nothing where some are not on the
    CPU."""
    tensors = [t for layer in layers for t in layer.kernel_tensors()]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return
    arena = huge_pages.Arena(tensors)
    del tensors
    for layer in layers:
        layer.use_copies([arena.place(t) for t in layer.kernel_tensors()])
