"""The fused CPU kernels (RMSNorm, residual add + RMSNorm, RoPE, SiLU * up) against torch, their
row independence, and the model's modules giving the same results with and without them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kvserve.kernels import cpu_ops, reference
from kvserve.shared.model import llama, rope

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ toolchain")

EPS = 1e-5


def norm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xd = x.double()
    return (w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + EPS)).float()


@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("width", [576, 37])
def test_rms_norm_and_fused_add(rows: int, width: int) -> None:
    torch.manual_seed(rows + width)
    x, delta, w = torch.randn(rows, width), torch.randn(rows, width), torch.rand(width) + 0.5
    got = cpu_ops.rms_norm(x, w, EPS)
    assert got is not None
    torch.testing.assert_close(got, norm_ref(x, w), atol=1e-5, rtol=1e-5)
    residual = x.clone()
    got = cpu_ops.add_rms_norm(delta, residual, w, EPS)
    assert got is not None
    assert torch.equal(residual, x + delta)  # the residual stream, updated in place
    torch.testing.assert_close(got, norm_ref(x + delta, w), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 200])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (4, 1)], ids=["gqa", "mha", "mqa"])
def test_rope_rotates_q_and_k_in_place_and_leaves_v(rows: int, heads: tuple[int, int]) -> None:
    torch.manual_seed(rows)
    h, kvh, d = *heads, 64
    qkv = torch.randn(rows, h + 2 * kvh, d)
    positions = torch.randint(0, 1000, (rows,))
    cos_t, sin_t = torch.randn(1000, d), torch.randn(1000, d)
    want = rope.apply_rope(qkv[:, : h + kvh], cos_t[positions][:, None], sin_t[positions][:, None])
    got = qkv.clone()
    assert cpu_ops.rope_(got, h + kvh, positions, cos_t, sin_t)
    torch.testing.assert_close(got[:, : h + kvh], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, h + kvh :], qkv[:, h + kvh :])


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_mul(rows: int) -> None:
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 4
    got = cpu_ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    assert got is not None
    torch.testing.assert_close(got, F.silu(gate) * up, atol=1e-5, rtol=1e-5)


def test_a_row_does_not_depend_on_its_neighbours() -> None:
    torch.manual_seed(3)
    x, w = torch.randn(200, 576), torch.rand(576)
    gate_up = torch.randn(200, 3072)
    together = cpu_ops.rms_norm(x, w, EPS), cpu_ops.silu_mul(gate_up)
    for i in (0, 77, 199):
        alone = cpu_ops.rms_norm(x[i : i + 1], w, EPS), cpu_ops.silu_mul(gate_up[i : i + 1])
        for a, b in zip(alone, together, strict=True):
            assert a is not None and b is not None and torch.equal(a[0], b[i])


def test_not_for_other_dtypes() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    assert cpu_ops.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), EPS) is None
    residual = x.clone()
    assert cpu_ops.add_rms_norm(x, residual, torch.ones(64, dtype=torch.bfloat16), EPS) is None
    assert torch.equal(residual, x)
    assert cpu_ops.silu_mul(x) is None
    qkv = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    table = torch.randn(4, 64, dtype=torch.bfloat16)
    assert not cpu_ops.rope_(qkv, 2, torch.tensor([0, 1]), table, table)


def test_model_modules_agree_with_their_torch_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """The norms, RoPE and MLP of the model: fused kernels and plain torch (what a GPU or a
    bf16 model runs) give the same results."""
    torch.manual_seed(4)
    hidden, inter = 64, 160
    norm = llama.RMSNorm(torch.rand(hidden) + 0.5, EPS)
    weights = {
        "model.layers.0.mlp.gate_proj.weight": torch.randn(inter, hidden) * 0.1,
        "model.layers.0.mlp.up_proj.weight": torch.randn(inter, hidden) * 0.1,
        "model.layers.0.mlp.down_proj.weight": torch.randn(hidden, inter) * 0.1,
    }
    mlp = llama.MLP(llama.LayerWeights(weights, 0))
    x, delta = torch.randn(5, hidden), torch.randn(5, hidden)
    qkv = torch.randn(5, 6, 32)
    positions = torch.tensor([0, 3, 9, 2, 40])
    tables = torch.randn(64, 32), torch.randn(64, 32)

    def run() -> list[torch.Tensor]:
        residual = x.clone()
        added = norm.add(delta, residual)
        rotated = rope.Rope(positions, *tables).apply_(qkv.clone(), 4).clone()
        return [norm(x), added, residual, rotated, mlp(x)]

    fused = run()
    monkeypatch.setattr(cpu_ops, "_extension", lambda: None)
    plain = run()
    for a, b in zip(fused, plain, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 7])
def test_argmax_logsumexp(rows: int) -> None:
    torch.manual_seed(rows)
    logits = torch.randn(rows, 49152) * 5
    logits[0, 100] = logits[0, 7] = logits[0].max() + 1  # a tie: the first index, as torch
    got = cpu_ops.argmax_logsumexp(logits)
    assert got is not None
    assert torch.equal(got[0], logits.argmax(-1))
    torch.testing.assert_close(got[1], torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-6)
    assert torch.equal(got[2], logits.max(-1).values)


def test_store_kv_writes_what_the_reference_writes() -> None:
    """K and V as the model passes them (strided views of the fused QKV output)."""
    torch.manual_seed(5)
    h, kvh, d = 6, 2, 64
    qkv = torch.randn(7, h + 2 * kvh, d)
    key, value = qkv[:, h : h + kvh], qkv[:, h + kvh :]
    slots = torch.tensor([3, 17, 18, 40, 0, 63, 21])
    want_k, want_v = torch.zeros(4, 16, kvh, d), torch.zeros(4, 16, kvh, d)
    reference.store_kv(key, value, want_k, want_v, slots)
    got_k, got_v = torch.zeros_like(want_k), torch.zeros_like(want_v)
    cpu_ops.store_kv(key, value, got_k, got_v, slots)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_store_kv_quantizes_as_the_reference_does(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """int8 and fp8 caches are quantized by the kernel, bit for bit the reference's bytes and
    scales: random rows, ties rounded to even (int8: x / scale = k + 0.5; e4m3: halfway
    between neighbours, in the normal and the subnormal range), values that round up into the
    next binade, tiny values that round to (negative) zero, and an all-zero row."""
    torch.manual_seed(6)
    h, kvh, d = 6, 2, 64
    qkv = torch.randn(7, h + 2 * kvh, d) * 3
    qkv[0, h, 0], qkv[0, h, 1:4] = 127.0, torch.tensor([2.5, -3.5, 0.5])  # int8 scale 1: ties
    qkv[2, h, 0] = 448.0  # fp8 scale 1
    qkv[2, h, 1:12] = torch.tensor(
        [1.0625, 1.1875, -3.75, 1.96875, 0.0009765625, 0.0029296875, -0.0001, -0.0, 447.9,
         0.015380859375, 2.0**-7 + 2.0**-10]
    )  # fmt: skip
    qkv[1, h + kvh] = 0.0
    key, value = qkv[:, h : h + kvh], qkv[:, h + kvh :]
    slots = torch.tensor([3, 17, 18, 40, 0, 63, 21])

    def cache() -> list[torch.Tensor]:
        return [
            torch.zeros(4, 16, kvh, d).to(dtype),
            torch.zeros(4, 16, kvh, d).to(dtype),
            torch.zeros(4, 16, kvh),
            torch.zeros(4, 16, kvh),
        ]

    want, got = cache(), cache()
    reference.store_kv(key, value, want[0], want[1], slots, want[2], want[3])
    monkeypatch.setattr(reference, "store_kv", None)  # the kernel's own, not the reference's
    cpu_ops.store_kv(key, value, got[0], got[1], slots, got[2], got[3])
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a.view(torch.uint8) if a.dtype == dtype else a,
                           b.view(torch.uint8) if b.dtype == dtype else b)  # fmt: skip
    assert want[0].flatten(0, 1)[slots].view(torch.uint8).any()
