"""The quantized-weight GEMM on GGUF blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K, Q6_K): packing
keeps the blocks' numbers; every format on two-term int8 activations equals that arithmetic
computed in float64 from GGML's definitions of the blocks, and is close to the fp32 product; a
row's result is independent of the batch."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from kvserve.kernels import cpu_linear, cpu_qlinear
from kvserve.shared.model.quantized import QuantizedWeight

pytestmark = pytest.mark.skipif(not cpu_qlinear.available(), reason="no C++ toolchain")


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, cols / block weights * size]: random quants, small random fp16 scales (and
    offsets; Q4_K, Q5_K: random 6-bit sub-block scales and mins)."""
    g = torch.Generator().manual_seed(seed)
    weights, size = cpu_qlinear.FORMATS[fmt]
    nb = cols // weights
    b = torch.randint(0, 256, (rows, nb, size), dtype=torch.uint8, generator=g)
    d = torch.rand(rows, nb, 1, generator=g) * 0.02 + 1e-3
    if fmt == "q6_k":  # d (last) scales the int8 sub-block scales
        b[..., 208:210] = (d / 127).half().view(torch.uint8)
        return b.view(rows, nb * size)
    if fmt in ("q4_k", "q5_k"):  # d and dmin scale 6-bit numbers
        d /= 63
        b[..., 2:4] = (torch.rand(rows, nb, 1, generator=g) * 0.05 / 63).half().view(torch.uint8)
    if fmt in ("q5_0", "q5_1", "q5_k"):  # 5-bit quants: half the 4-bit scale
        d /= 2
    b[..., 0:2] = d.half().view(torch.uint8)
    if fmt in ("q4_1", "q5_1"):
        b[..., 2:4] = (torch.randn(rows, nb, 1, generator=g) * 0.05).half().view(torch.uint8)
    return b.view(rows, nb * size)


def q6_k_params(b: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Q6_K blocks [n, ns, 210] read as GGML's C reference (dequantize_row_q6_K) does: per half
    of 128 weights, weight l + 32 t (l < 32) takes ql[l + 32 (t & 1)]'s low (t < 2) or high
    nibble and bits 2t of qh[l], minus 32; sub-block of 16 j has the scale d sc[j]. Per block
    of 32: the two scales [n, nb, 2] and the quants [n, nb, 32], float64."""
    n, ns = b.shape[:2]
    ql, qh = b[..., :128].long(), b[..., 128:192].long()
    q = torch.empty(n, ns, 256, dtype=torch.long)
    for half in range(2):
        for t in range(4):
            low = ql[..., 64 * half + 32 * (t & 1) : 64 * half + 32 * (t & 1) + 32]
            nib = low & 15 if t < 2 else low >> 4
            high = (qh[..., 32 * half : 32 * half + 32] >> (2 * t)) & 3
            q[..., 128 * half + 32 * t : 128 * half + 32 * t + 32] = (nib | (high << 4)) - 32
    d = b[..., 208:210].contiguous().view(torch.float16).double()  # [n, ns, 1]
    scales = d * b[..., 192:208].contiguous().view(torch.int8).double()  # [n, ns, 16]
    return scales.reshape(n, -1, 2), q.reshape(n, -1, 32).double()


def block_params(blocks: torch.Tensor, fmt: str) -> tuple[torch.Tensor, ...]:
    """Per block of 32 weights of each row, float64: d and m [n, nb] and the quants [n, nb, 32]
    (w = d q + m), read by GGML's definitions (the k-quants' sub-block scales by gguf's own
    code); Q6_K: d [n, nb, 2], one per half (w = d q)."""
    n = blocks.shape[0]
    size = cpu_qlinear.FORMATS[fmt][1]
    b = blocks.view(n, -1, size)
    if fmt == "q6_k":
        d, q = q6_k_params(b)
        return d, torch.zeros(d.shape[:2], dtype=torch.float64), q
    d = b[..., 0:2].contiguous().view(torch.float16)[..., 0].double()  # [n, nb]
    if fmt == "q8_0":
        return d, torch.zeros_like(d), b[..., 2:].contiguous().view(torch.int8).double()
    if fmt in ("q4_k", "q5_k"):
        sc, mn = (
            torch.from_numpy(a.astype(np.int64)).view(n, -1, 8)
            for a in gguf.quants.Q4_K.get_scale_min(b[..., 4:16].reshape(-1, 12).numpy())
        )
        dmin = b[..., 2:4].contiguous().view(torch.float16).double()  # [n, nb, 1]
        qs = b[..., size - 128 :].reshape(n, -1, 4, 32).long()
        q = torch.stack((qs & 15, qs >> 4), dim=3).reshape(n, -1, 8, 32)
        if fmt == "q5_k":  # sub-block j's weight l: bit j of byte l of the 32 after the scales
            qh = b[..., 16:48].long()
            q = q + 16 * torch.stack([(qh >> j) & 1 for j in range(8)], dim=2)
        q = q.reshape(n, -1, 32).double()
        return (d[..., None] * sc).reshape(n, -1), -(dmin * mn).reshape(n, -1), q
    if fmt in ("q5_0", "q5_1"):  # weight i: nibble i (low bytes 0-15, then high), bit i of qh
        lead = size - 20
        qh = b[..., lead : lead + 4].long()
        high = torch.stack([(qh[..., i // 8] >> (i % 8)) & 1 for i in range(32)], dim=-1)
        qs = b[..., lead + 4 :].long()
        q = (torch.cat((qs & 15, qs >> 4), dim=-1) + 16 * high).double()
        if fmt == "q5_0":
            return d, torch.zeros_like(d), q - 16
        return d, b[..., 2:4].contiguous().view(torch.float16)[..., 0].double(), q
    m = b[..., 2:4].contiguous().view(torch.float16)[..., 0].double() if fmt == "q4_1" else -8 * d
    quants = b[..., size - 16 :]
    return d, m, torch.cat((quants & 15, quants >> 4), dim=-1).double()


def test_pack_keeps_every_byte_of_the_blocks() -> None:
    nr = cpu_linear.panel_width()
    blocks = random_blocks("q8_0", nr + 3, 64, seed=1)
    packed = cpu_qlinear.pack(blocks, "q8_0")
    assert packed.dtype == torch.uint8 and packed.shape == (2, 2, nr * 34)
    first = packed[0, 1]  # panel 0, block 1: NR scales, then 16 pairs of rows x NR columns
    assert torch.equal(first[: 2 * nr].view(nr, 2), blocks[:nr, 34:36])
    pairs = first[2 * nr :].view(16, nr, 2)
    assert torch.equal(pairs[:, :, 0].T, blocks[:nr, 36:68:2])
    assert torch.equal(pairs[:, :, 1].T, blocks[:nr, 37:68:2])
    assert torch.count_nonzero(packed[1, :, : 2 * nr].view(2, nr, 2)[:, 3:]) == 0  # padding


def test_pack_lays_out_4bit_quants_four_k_to_a_column() -> None:
    nr = cpu_linear.panel_width()
    blocks = random_blocks("q4_0", nr, 32, seed=2)
    packed = cpu_qlinear.pack(blocks, "q4_0")
    assert packed.shape == (1, 1, nr * 20)  # Q4_0 packed as Q4_1: d, m = -8 d, quants
    d = blocks[:, :2].contiguous().view(torch.float16)[:, 0]
    assert torch.equal(packed[0, 0, : 2 * nr].view(torch.float16), d)
    assert torch.equal(packed[0, 0, 2 * nr : 4 * nr].view(torch.float16), d * -8)
    q = torch.cat((blocks[:, 2:] & 15, blocks[:, 2:] >> 4), dim=1)  # [nr, 32]: quant k
    quants = packed[0, 0, 4 * nr :].view(4, nr, 4)  # [group, column, byte]
    for g in range(4):
        assert torch.equal(quants[g] & 15, q[:, 4 * g : 4 * g + 4])
        assert torch.equal(quants[g] >> 4, q[:, 16 + 4 * g : 20 + 4 * g])


def test_pack_keeps_q4_k_blocks_of_256_with_their_scales_as_bytes() -> None:
    nr = cpu_linear.panel_width()
    blocks = random_blocks("q4_k", nr, 256, seed=5)
    packed = cpu_qlinear.pack(blocks, "q4_k")
    assert packed.shape == (1, 1, nr * 148)  # d, dmin, 8 sc, 8 mn, 8 x 16 bytes of quants
    block = packed[0, 0]
    half = block[: 4 * nr].view(torch.float16).view(2, nr).double()  # d, dmin per column
    assert torch.equal(block[: 2 * nr].view(nr, 2), blocks[:, 0:2])
    d, m, q = block_params(blocks, "q4_k")  # [nr, 8], [nr, 8], [nr, 8, 32]
    for j in range(8):
        assert torch.equal(half[0] * block[(4 + j) * nr : (5 + j) * nr].double(), d[:, j])
        assert torch.equal(-half[1] * block[(12 + j) * nr : (13 + j) * nr].double(), m[:, j])
        quants = block[(20 + 16 * j) * nr : (36 + 16 * j) * nr].view(4, nr, 4)  # [g, column, j]
        for g in range(4):
            assert torch.equal((quants[g] & 15).double(), q[:, j, 4 * g : 4 * g + 4])
            assert torch.equal((quants[g] >> 4).double(), q[:, j, 16 + 4 * g : 20 + 4 * g])
    w = QuantizedWeight("q4_k", blocks).dequantize().view(nr, 8, 32)
    assert torch.equal(w, d.float()[..., None] * q.float() + m.float()[..., None])  # as gguf


def test_pack_keeps_q6_k_blocks_of_256_with_their_quants_as_bytes() -> None:
    nr = cpu_linear.panel_width()
    blocks = random_blocks("q6_k", nr, 256, seed=7)
    packed = cpu_qlinear.pack(blocks, "q6_k")
    assert packed.shape == (1, 1, nr * 274)  # d, 16 sc, 256 quants
    block = packed[0, 0]
    d16 = block[: 2 * nr].view(torch.float16).double()
    d, _, q = block_params(blocks, "q6_k")  # [nr, 8, 2], [nr, 8, 32]
    sc = block[2 * nr : 18 * nr].view(torch.int8).view(8, 2, nr).double()
    assert torch.equal(d16 * sc, d.permute(1, 2, 0))
    pairs = block[18 * nr :].view(torch.int8).view(8, 16, nr, 2).double()  # [b, p, column, 2]
    assert torch.equal(pairs.permute(2, 0, 1, 3).reshape(nr, 8, 32), q)


def test_q6_k_blocks_read_as_gguf_expands_them() -> None:
    blocks = random_blocks("q6_k", 5, 512, seed=6)
    d, _, q = block_params(blocks, "q6_k")
    w = d.float().repeat_interleave(16, -1) * q.float().view(5, -1, 32)  # fp32, as gguf
    assert torch.equal(QuantizedWeight("q6_k", blocks).dequantize(), w.view(5, 512))


def int8_reference(x: torch.Tensor, blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """The kernel's product in float64: each row's blocks of 32 as two int8 terms
    x ~ d (q + r / 256) (d = max|x| / 127, q = round(x / d), r = round((x - d q) 256 / d)
    clamped to +-127, to nearest even), then per block d_w d / 256 dot(q_w, 256 q + r)
    + m_w d / 256 (256 sum(q) + sum(r)) (block_params' d_w, m_w, q_w)."""
    d, m, q = block_params(blocks, fmt)
    xb = x.view(x.shape[0], -1, 32)
    dx = xb.abs().amax(-1) / 127  # [rows, nb], fp32 as the kernel computes it
    inv = torch.where(dx > 0, 1 / dx, torch.zeros_like(dx))[..., None]
    qx = torch.round(xb * inv)
    rx = torch.round((xb - dx[..., None] * qx) * inv * 256).clamp(-127, 127)
    whole = (256 * qx + rx).double()  # exact small integers
    scale = dx.double()[:, None] / 256
    if d.dim() == 3:  # one scale per half block
        dots = torch.einsum(
            "rbhk,nbhk->rnbh", whole.view(*whole.shape[:2], 2, 16), q.view(*q.shape[:2], 2, 16)
        )
        return (dots * d[None] * scale[..., None]).sum((-1, -2))
    dots = torch.einsum("rbk,nbk->rnb", whole, q)
    return (dots * d[None] * scale + m[None] * (scale * whole.sum(-1)[:, None])).sum(-1)


SHAPES = [(960, 576), (576, 1536), (50, 64), (7, 32), (300, 256), (97, 768)]


def cases(formats: list[str]) -> list[tuple[str, tuple[int, int]]]:
    """Each format with the shapes whose inputs are whole blocks of it."""
    return [(f, s) for f in formats for s in SHAPES if s[1] % cpu_qlinear.FORMATS[f][0] == 0]


@pytest.mark.parametrize(("fmt", "shape"), cases(sorted(cpu_qlinear.FORMATS)))
def test_every_format_computes_on_int8_activations(fmt: str, shape: tuple[int, int]) -> None:
    n, k = shape
    blocks = random_blocks(fmt, n, k, seed=n + k)
    packed = cpu_qlinear.pack(blocks, fmt)
    expanded = QuantizedWeight(fmt, blocks).dequantize()
    g = torch.Generator().manual_seed(n * k)  # a single block's error can reach the bound
    for rows in (1, 2, 3, 4, 5, 9, 30):
        x = torch.randn(rows, k, generator=g)
        got = cpu_qlinear.linear(x, packed, n)
        assert got is not None
        want = int8_reference(x, blocks, fmt)
        torch.testing.assert_close(got.double(), want, rtol=0, atol=2e-5 * want.abs().max())
        exact = x @ expanded.T  # ~15-bit activations: within 1e-4 of the fp32 product
        assert (got - exact).norm() / exact.norm() < 1e-4


@pytest.mark.parametrize("fmt", sorted(cpu_qlinear.FORMATS))
def test_a_rows_result_does_not_depend_on_the_batch(fmt: str) -> None:
    weight = random_blocks(fmt, 200, 256, seed=3)
    packed = cpu_qlinear.pack(weight, fmt)
    x = torch.randn(20, 256)  # past the rows from which machines without VNNI take the float path
    batch = cpu_qlinear.linear(x, packed, 200)
    assert batch is not None
    for i in range(20):
        alone = cpu_qlinear.linear(x[i : i + 1], packed, 200)
        assert alone is not None and torch.equal(alone[0], batch[i])


@pytest.mark.parametrize(("fmt", "shape"), cases(["q4_0", "q4_1", "q4_k"]))
def test_the_float_path_gives_the_integer_kernels_results(fmt: str, shape: tuple[int, int]) -> None:
    """The path for many rows on machines without VNNI (FMAs on integer-valued floats) sums the
    same integers per block: bit-identical to the integer kernel, which every machine runs."""
    n, k = shape
    packed = cpu_qlinear.pack(random_blocks(fmt, n, k, seed=n * k), fmt)
    for rows in (1, 2, 3, 4, 7, 13):
        x = torch.randn(rows, k) * torch.logspace(-3, 2, k)  # blocks of very different scales
        integer = cpu_qlinear.linear(x, packed, n, float_rows=-1)
        floats = cpu_qlinear.linear(x, packed, n, float_rows=1)
        assert integer is not None and floats is not None
        assert torch.equal(integer, floats), (shape, rows)


def test_other_inputs_are_not_for_the_kernel() -> None:
    packed = cpu_qlinear.pack(random_blocks("q8_0", 16, 32, seed=4), "q8_0")
    assert cpu_qlinear.linear(torch.randn(2, 32, dtype=torch.bfloat16), packed, 16) is None


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_every_panel_is_computed_on_any_thread_count(fmt: str) -> None:
    """Threads stream ranges of panels and take what is left of the others'; on any count,
    fewer panels than threads included, every output column is the one-thread result."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    try:
        for n in (7, 48 * 3 + 5, 48 * 13):  # from less than one panel to many
            packed = cpu_qlinear.pack(random_blocks(fmt, n, 256, seed=n), fmt)
            x = torch.randn(3, 256)
            torch.set_num_threads(1)
            want = cpu_qlinear.linear(x, packed, n)
            for threads in (2, 3, 5):
                torch.set_num_threads(threads)
                for _ in range(3):
                    # a freed block of NaN for the output: a column no thread wrote shows
                    del_me = torch.full((3, n), float("nan"))
                    del del_me
                    got = cpu_qlinear.linear(x, packed, n)
                    assert got is not None and want is not None
                    assert torch.equal(got, want), (n, threads)
    finally:
        torch.set_num_threads(before)
