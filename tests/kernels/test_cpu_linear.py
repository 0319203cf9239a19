"""The C++ few-row linear kernel against torch (fp32), its row independence, and the model's
Linear choosing it only where it applies."""

from __future__ import annotations

import pytest
import torch
from kvserve.kernels import cpu_linear
from kvserve.shared.model.llama import Linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="no C++ toolchain")


@pytest.mark.parametrize("rows", [1, 2, 3])
@pytest.mark.parametrize("shape", [(960, 576), (576, 1536), (37, 13), (5, 8)])
def test_matches_torch(rows: int, shape: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    w = torch.randn(*shape)
    x = torch.randn(rows, shape[1])
    got = cpu_linear.gemv(x, w)
    assert got is not None and got.shape == (rows, shape[0])
    torch.testing.assert_close(
        got, x.double() @ w.double().T, atol=1e-4, rtol=1e-5, check_dtype=False
    )


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    torch.manual_seed(0)
    w = torch.randn(300, 576)
    x = torch.randn(3, 576)
    together = cpu_linear.gemv(x, w)
    assert together is not None
    for i in range(3):
        alone = cpu_linear.gemv(x[i : i + 1], w)
        assert alone is not None and torch.equal(alone[0], together[i])


def test_not_for_other_inputs() -> None:
    w = torch.randn(8, 4)
    assert cpu_linear.gemv(torch.randn(cpu_linear.MAX_ROWS + 1, 4), w) is None
    assert cpu_linear.gemv(torch.randn(1, 4, dtype=torch.bfloat16), w.bfloat16()) is None
    assert cpu_linear.gemv(torch.randn(1, 4, dtype=torch.float64), w.double()) is None


@pytest.mark.parametrize("rows", [1, 3, 4, 40])
def test_model_linear_agrees_across_paths(rows: int) -> None:
    """Few rows take the kernel, more take oneDNN (or F.linear): the same product either way."""
    torch.manual_seed(rows)
    w = torch.randn(96, 64)
    lin = Linear(w)
    assert lin.few_rows and lin.weight is not None
    x = torch.randn(rows, 64)
    torch.testing.assert_close(lin(x), x @ w.T, atol=1e-4, rtol=1e-5)
    bf16 = Linear(w, torch.bfloat16)
    assert not bf16.few_rows  # bf16 matmuls stay on oneDNN
    torch.testing.assert_close(bf16(x), x @ w.T, atol=0.2, rtol=0.05)
