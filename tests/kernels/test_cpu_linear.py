"""The C++ panel GEMM against torch (fp32), its row independence, and the model's Linear
choosing it where it applies."""

from __future__ import annotations

import pytest
import torch
from kvserve.kernels import cpu_linear
from kvserve.shared.model.linear import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C++ toolchain")


def test_pack_lays_out_column_panels() -> None:
    nr = cpu_linear.panel_width()
    w = torch.randn(nr + 5, 7)
    packed = cpu_linear.pack(w)
    assert packed.shape == (2, 7, nr)
    assert torch.equal(packed[0], w[:nr].T)
    assert torch.equal(packed[1, :, :5], w[nr:].T)
    assert torch.count_nonzero(packed[1, :, 5:]) == 0


def row_counts() -> list[int]:
    """1, a tile and one past it, several tiles and a remainder, a prefill-sized block."""
    mr = cpu_linear.tile_rows()
    counts = [1, 2, mr, mr + 1, 4 * mr + 3, 300]
    limit = cpu_linear.max_rows()
    return [m for m in counts if limit is None or m <= limit]


@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 13), (5, 8), (97, 1)])
def test_matches_torch(shape: tuple[int, int]) -> None:
    torch.manual_seed(shape[0])
    w = torch.randn(*shape)
    packed = cpu_linear.pack(w)
    for rows in row_counts():
        x = torch.randn(rows, shape[1])
        got = cpu_linear.linear(x, packed, shape[0])
        assert got is not None and got.shape == (rows, shape[0])
        torch.testing.assert_close(
            got, x.double() @ w.double().T, atol=2e-4, rtol=1e-5, check_dtype=False
        )


def test_a_row_does_not_depend_on_its_batch() -> None:
    """Bit-identical alone, in a full tile, in a remainder tile, across panel boundaries."""
    torch.manual_seed(0)
    w = torch.randn(300, 576)
    packed = cpu_linear.pack(w)
    mr = cpu_linear.tile_rows()
    x = torch.randn(3 * mr + 2, 576)
    together = cpu_linear.linear(x, packed, 300)
    assert together is not None
    for i in range(x.shape[0]):
        alone = cpu_linear.linear(x[i : i + 1], packed, 300)
        assert alone is not None and torch.equal(alone[0], together[i])
    tail = cpu_linear.linear(x[-5:], packed, 300)
    assert tail is not None and torch.equal(tail, together[-5:])


def test_empty_input() -> None:
    got = cpu_linear.linear(torch.empty(0, 8), cpu_linear.pack(torch.randn(3, 8)), 3)
    assert got is not None and got.shape == (0, 3)


def test_not_for_other_inputs() -> None:
    packed = cpu_linear.pack(torch.randn(8, 4))
    assert cpu_linear.linear(torch.randn(1, 4, dtype=torch.bfloat16), packed, 8) is None
    assert cpu_linear.linear(torch.randn(1, 4, dtype=torch.float64), packed, 8) is None
    limit = cpu_linear.max_rows()
    if limit is not None:
        assert cpu_linear.linear(torch.randn(limit + 1, 4), packed, 8) is None


def test_a_mismatched_packing_is_an_error() -> None:
    packed = cpu_linear.pack(torch.randn(8, 4))
    with pytest.raises(RuntimeError, match="does not match"):
        cpu_linear.linear(torch.randn(2, 5), packed, 8)


@pytest.mark.parametrize("rows", [1, 3, 4, 40, 200])
def test_model_linear_agrees_across_paths(rows: int) -> None:
    """fp32 takes the panels (and oneDNN above max_rows on AVX2), bf16 oneDNN: the same
    product either way."""
    torch.manual_seed(rows)
    w = torch.randn(96, 64)
    lin = Linear(w)
    assert lin.panels is not None
    assert (lin.packed is None and lin.weight is None) == (cpu_linear.max_rows() is None)
    x = torch.randn(rows, 64)
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-4, rtol=1e-5)
    bf16 = Linear(w, torch.bfloat16)
    assert bf16.panels is None  # bf16 matmuls stay on oneDNN
    torch.testing.assert_close(bf16(x), x @ w.T, atol=0.2, rtol=0.05)


@pytest.mark.parametrize("shape", [(576, 1536), (960, 576)])
def test_a_model_row_does_not_depend_on_how_many_rows_its_call_had(
    shape: tuple[int, int],
) -> None:
    """The model's fp32 Linear: a row computed in a call of more rows than max_rows (on AVX2
    oneDNN's, where its sums are the panels' bit for bit) equals the same row computed in a
    call of a few rows (the panels'), for a K that oneDNN splits (1,536) and one it does not: a
    question's tokens get the same K/V after a cached prefix as in the whole prompt."""
    torch.manual_seed(shape[1])
    w = torch.randn(*shape) * 0.05
    lin = Linear(w)
    many = (cpu_linear.max_rows() or 64) + 85
    x = torch.randn(many, shape[1])
    together = lin(x)
    for a, b in ((0, 1), (many - 21, many), (7, 30)):
        assert torch.equal(lin(x[a:b].clone()), together[a:b])


@pytest.mark.skipif(cpu_linear.max_rows() is None, reason="the panels take every call here")
@pytest.mark.parametrize("k", [576, 1024, 1025, 1536, 2560])
def test_the_panels_sum_as_onednn_where_it_takes_the_long_calls(k: int) -> None:
    """AVX2: oneDNN takes the calls of more than max_rows rows, and the panels sum over k as it
    does (runs of 1,024, then the runs' sums in turn), bit for bit; so the model's Linear keeps
    oneDNN for those calls (none of its weights falls back to the panels for every call)."""
    torch.manual_seed(k)
    w = torch.randn(300, k) * 0.05
    x = torch.randn(cpu_linear.max_rows() + 9, k)  # type: ignore[operator]
    ours = cpu_linear.linear(x, cpu_linear.pack(w), 300, any_rows=True)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    theirs = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
    assert ours is not None and torch.equal(ours, theirs)
    lin = Linear(w)
    assert lin.packed is not None and not lin.panels_only
