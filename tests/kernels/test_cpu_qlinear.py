"""The quantized-weight GEMM (GGUF Q4_0 / Q4_1 / Q8_0 blocks) against cpu_linear over the same
weights expanded to fp32: bit-identical, for any number of rows and any column count."""

from __future__ import annotations

import pytest
import torch
from kvserve.kernels import cpu_linear, cpu_qlinear
from kvserve.shared.model.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_qlinear.available(), reason="no C++ toolchain")


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, cols / 32 * size]: random quants, small random fp16 scales (and offsets)."""
    g = torch.Generator().manual_seed(seed)
    size, nb = cpu_qlinear.FORMATS[fmt], cols // 32
    b = torch.randint(0, 256, (rows, nb, size), dtype=torch.uint8, generator=g)
    d = torch.rand(rows, nb, 1, generator=g) * 0.02 + 1e-3
    b[..., 0:2] = d.half().view(torch.uint8)
    if fmt == "q4_1":
        b[..., 2:4] = (torch.randn(rows, nb, 1, generator=g) * 0.05).half().view(torch.uint8)
    return b.view(rows, nb * size)


def test_pack_keeps_every_byte_of_the_blocks() -> None:
    nr = cpu_linear.panel_width()
    blocks = random_blocks("q8_0", nr + 3, 64, seed=1)
    packed = cpu_qlinear.pack(blocks, "q8_0")
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2, nr * 34)
    first = packed[0, 1]  # panel 0, block 1: NR scales then 32 rows of NR quants
    assert torch.equal(first[: 2 * nr].view(nr, 2), blocks[:nr, 34:36])
    assert torch.equal(first[2 * nr :].view(32, nr).T, blocks[:nr, 36:68])
    assert torch.count_nonzero(packed[1, :, : 2 * nr].view(2, nr, 2)[:, 3:]) == 0  # padding


@pytest.mark.parametrize("fmt", sorted(cpu_qlinear.FORMATS))
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (50, 64), (7, 32)])
def test_bit_identical_to_the_fp32_expansion(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    weight = QuantizedWeight(fmt, random_blocks(fmt, n, k, seed=n + k))
    assert (weight.out_features, weight.in_features) == (n, k)
    packed = cpu_qlinear.pack(weight.blocks, fmt)
    panels = cpu_linear.pack(weight.dequantize())
    mr = cpu_linear.tile_rows()
    for rows in (1, 2, 3, 4, 5, mr + 1, 3 * mr + 2):
        x = torch.randn(rows, k)
        got = cpu_qlinear.linear(x, packed, n)
        want = cpu_linear.linear(x, panels, n)
        assert got is not None and want is not None
        assert torch.equal(got, want), (fmt, shape, rows)
        torch.testing.assert_close(got, x @ weight.dequantize().T, rtol=1e-4, atol=1e-4)


def test_a_rows_result_does_not_depend_on_the_batch() -> None:
    weight = random_blocks("q4_1", 200, 96, seed=3)
    packed = cpu_qlinear.pack(weight, "q4_1")
    x = torch.randn(13, 96)
    batch = cpu_qlinear.linear(x, packed, 200)
    assert batch is not None
    for i in range(13):
        alone = cpu_qlinear.linear(x[i : i + 1], packed, 200)
        assert alone is not None and torch.equal(alone[0], batch[i])


def test_other_inputs_are_not_for_the_kernel() -> None:
    packed = cpu_qlinear.pack(random_blocks("q8_0", 16, 32, seed=4), "q8_0")
    assert cpu_qlinear.linear(torch.randn(2, 32, dtype=torch.bfloat16), packed, 16) is None
