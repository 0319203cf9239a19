"""Triton quantize_kv / dequantize_kv against kernels.reference.

Tolerances: quantize_kv is bit-exact (q and scale). dequantize_kv is exact for fp32 / fp16
outputs; for bf16 it is exact on CUDA and within one bf16 ulp (rtol 2**-7) under the interpreter,
whose fp32 -> bf16 cast truncates instead of rounding to nearest even.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton")

from kvserve.kernels import reference as ref
from kvserve.kernels.quant import dequantize_kv, quantize_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INPUT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]
QUANT_DTYPES = [torch.int8, torch.float8_e4m3fn]


def bits(q: torch.Tensor) -> torch.Tensor:
    """int8/fp8 payload as raw bytes, so fp8 compares bit for bit (and NaN == NaN)."""
    return q.view(torch.uint8)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("qdtype", QUANT_DTYPES)
@pytest.mark.parametrize("xdtype", INPUT_DTYPES)
def test_quantize_matches_reference_bit_exactly(
    xdtype: torch.dtype, qdtype: torch.dtype, head_dim: int
) -> None:
    torch.manual_seed(0)
    row_scale = torch.rand(5, 3, 1, device=DEVICE) * 20  # rows of very different amax
    x = (torch.randn(5, 3, head_dim, device=DEVICE) * row_scale).to(xdtype)  # [5, 3, d]
    x[0, 0] = 0  # an all-zero row gets the minimum scale
    x[1, 2, 7] = 1e4  # one outlier dominates its row
    q, scale = quantize_kv(x, qdtype)
    q_ref, scale_ref = ref.quantize_kv(x, qdtype)
    assert q.shape == (5, 3, head_dim) and q.dtype == qdtype
    assert scale.shape == (5, 3) and scale.dtype == torch.float32
    assert torch.equal(scale, scale_ref)
    assert torch.equal(bits(q), bits(q_ref))


def test_int8_rounds_half_to_even() -> None:
    # amax 127 -> scale exactly 1.0, so x / scale hits the .5 ties themselves
    ties = torch.arange(-127, 127, dtype=torch.float32, device=DEVICE) + 0.5  # [254]
    x = torch.cat([ties, torch.tensor([-0.3, 0.0], device=DEVICE)]).view(2, 128)
    x[:, 0] = 127.0  # pin every row's amax
    q, scale = quantize_kv(x, torch.int8)
    q_ref, _ = ref.quantize_kv(x, torch.int8)
    assert torch.equal(scale, torch.ones(2, device=DEVICE))
    assert torch.equal(q, q_ref)
    assert q[0, :5].tolist() == [127, -126, -124, -124, -122]  # -125.5, -124.5, -123.5, -122.5


def test_fp8_rounds_every_midpoint_to_nearest_even() -> None:
    # amax 448 -> scale exactly 1.0; probe each e4m3 value and the midpoints to its neighbours
    codes = torch.arange(0, 0x7F, dtype=torch.uint8, device=DEVICE)  # all finite non-negative
    grid = codes.view(torch.float8_e4m3fn).float()  # [127] ascending, 0 .. 448
    mids = (grid[1:] + grid[:-1]) / 2  # [126] exact in fp32
    nudged = torch.cat([mids * (1 + 2**-20), mids * (1 - 2**-20)])  # just off the ties
    vals = torch.cat([grid, mids, nudged])  # [505]
    vals = torch.cat([vals, -vals, torch.zeros(14, device=DEVICE)])  # [1024]
    x = vals.view(8, 128)
    x[:, 0] = 448.0  # pin every row's amax
    q, scale = quantize_kv(x, torch.float8_e4m3fn)
    q_ref, _ = ref.quantize_kv(x, torch.float8_e4m3fn)
    assert torch.equal(scale, torch.ones(8, device=DEVICE))
    # -0 and +0 both decode to 0: a GPU's conversion may drop the sign of what rounds to zero
    got, want = (torch.where(bits(t) == 0x80, 0, bits(t)) for t in (q, q_ref))
    wrong = (got != want).nonzero().tolist()[:8]  # (input, kernel's code, reference's code)
    assert not wrong, [(x[i, j].item(), int(got[i, j]), int(want[i, j])) for i, j in wrong]


@pytest.mark.parametrize("shape", [(0, 64), (7, 128), (2, 3, 4, 64)])
@pytest.mark.parametrize("qdtype", QUANT_DTYPES)
def test_quantize_shapes(shape: tuple[int, ...], qdtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x = torch.randn(shape, device=DEVICE)
    q, scale = quantize_kv(x, qdtype)
    assert q.shape == shape and scale.shape == shape[:-1]
    q_ref, scale_ref = ref.quantize_kv(x, qdtype)
    assert torch.equal(bits(q), bits(q_ref)) and torch.equal(scale, scale_ref)


def test_quantize_non_contiguous_input() -> None:
    torch.manual_seed(2)
    x = torch.randn(6, 4, 64, device=DEVICE).transpose(0, 1)  # [4, 6, 64], row stride 64 * 4
    q, scale = quantize_kv(x, torch.int8)
    q_ref, scale_ref = ref.quantize_kv(x, torch.int8)
    assert torch.equal(q, q_ref) and torch.equal(scale, scale_ref)


def test_quantize_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError):
        quantize_kv(torch.zeros(2, 64, device=DEVICE), torch.float16)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("out_dtype", INPUT_DTYPES)
@pytest.mark.parametrize("qdtype", QUANT_DTYPES)
def test_dequantize_matches_reference(
    qdtype: torch.dtype, out_dtype: torch.dtype, head_dim: int
) -> None:
    torch.manual_seed(3)
    x = torch.randn(4, 2, head_dim, device=DEVICE) * 3
    q, scale = ref.quantize_kv(x, qdtype)  # [4, 2, d], [4, 2]
    out = dequantize_kv(q, scale, out_dtype)
    expected = ref.dequantize_kv(q, scale, out_dtype)
    assert out.shape == (4, 2, head_dim) and out.dtype == out_dtype
    if out_dtype == torch.bfloat16 and DEVICE == "cpu":
        torch.testing.assert_close(out, expected, rtol=2**-7, atol=0)
    else:
        assert torch.equal(out, expected)


@pytest.mark.parametrize("qdtype", QUANT_DTYPES)
def test_round_trip_error_is_within_half_a_step(qdtype: torch.dtype) -> None:
    torch.manual_seed(4)
    x = torch.randn(16, 4, 64, device=DEVICE)
    q, scale = quantize_kv(x, qdtype)
    back = dequantize_kv(q, scale, torch.float32)
    err = (back - x).abs()  # [16, 4, 64]
    if qdtype == torch.int8:
        bound = scale[..., None] * 0.5 * (1 + 1e-6)  # half an integer step
    else:
        bound = x.abs() * 2**-4 + scale[..., None] * 2**-10  # half of e4m3's 2**-3 spacing
    assert bool((err <= bound).all())
