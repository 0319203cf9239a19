"""The C++ CPU decode kernel against the torch reference (exact semantics; fp32 and int8
caches)."""

from __future__ import annotations

import pytest
import torch
from kvserve.kernels import cpu_decode_attention, reference

pytestmark = pytest.mark.skipif(not cpu_decode_attention.available(), reason="no C++ toolchain")


@pytest.mark.parametrize("heads", [(4, 4), (6, 2), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("block_size", [8, 16, 24, 32])
def test_matches_reference(heads: tuple[int, int], head_dim: int, block_size: int) -> None:
    torch.manual_seed(0)
    h, kvh = heads
    lens = [1, block_size, block_size + 1, 3 * block_size, 77]
    n = max((x + block_size - 1) // block_size for x in lens)
    nb = len(lens) * n + 3
    kc = torch.randn(nb, block_size, kvh, head_dim)
    vc = torch.randn(nb, block_size, kvh, head_dim)
    tables = torch.randperm(nb)[: len(lens) * n].view(len(lens), n).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), h, head_dim)
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, head_dim**-0.5)
    got = cpu_decode_attention.paged_decode_attention(q, kc, vc, tables, ctx, head_dim**-0.5)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("heads", [(4, 4), (9, 3), (4, 1)], ids=["mha", "gqa", "mqa"])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_quantized_cache_matches_reference(
    heads: tuple[int, int], head_dim: int, dtype: torch.dtype
) -> None:
    """An int8 or fp8 cache is read in place (widened in registers, its scales applied to the
    dot products and the softmax weights): the reference's result on the dequantized values,
    and a sequence's result is the same alone as in the batch. Slots past a sequence's length
    hold NaN scales, which must not be read."""
    torch.manual_seed(1)
    h, kvh = heads
    bs, lens = 16, [1, 16, 17, 40, 77]
    n = max((x + bs - 1) // bs for x in lens)
    nb = len(lens) * n + 2
    kq, ks = reference.quantize_kv(torch.randn(nb, bs, kvh, head_dim), dtype)
    vq, vs = reference.quantize_kv(torch.randn(nb, bs, kvh, head_dim), dtype)
    tables = torch.randperm(nb)[: len(lens) * n].view(len(lens), n).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), h, head_dim)
    want = reference.paged_decode_attention(q, kq, vq, tables, ctx, head_dim**-0.5, ks, vs)
    for b, length in enumerate(lens):  # poison every slot past each sequence's length
        for pos in range(length, n * bs):  # (the reference needs them finite)
            ks[tables[b, pos // bs], pos % bs] = float("nan")
            vs[tables[b, pos // bs], pos % bs] = float("nan")
    scale = head_dim**-0.5
    got = cpu_decode_attention.paged_decode_attention(q, kq, vq, tables, ctx, scale, ks, vs)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b in (0, 3):
        alone = cpu_decode_attention.paged_decode_attention(
            q[b : b + 1], kq, vq, tables[b : b + 1], ctx[b : b + 1], head_dim**-0.5, ks, vs
        )
        assert torch.equal(alone[0], got[b])


def test_every_e4m3_value_is_widened_exactly() -> None:
    """All 254 finite e4m3 values (normals, subnormals, both zeros) as V, one token attended
    at a time with scales 1: bit for bit the kernel's result on an fp32 cache holding the same
    values (torch's exact conversion), and within a rounding of the values themselves."""
    values = torch.arange(256, dtype=torch.uint8)
    values = values[(values & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # no NaN
    n, d = values.numel(), 32
    vc = values[:, None, None, None].expand(n, 1, 1, d).contiguous()
    ones = torch.ones(n, 1, 1)
    args = (torch.arange(n, dtype=torch.int32)[:, None], torch.ones(n, dtype=torch.int32), 1.0)
    q = torch.zeros(n, 1, d)
    got = cpu_decode_attention.paged_decode_attention(
        q, torch.zeros_like(vc), vc, *args, ones, ones
    )
    fp32 = vc.float()
    want = cpu_decode_attention.paged_decode_attention(q, torch.zeros_like(fp32), fp32, *args)
    assert torch.equal(got, want)
    torch.testing.assert_close(got[:, 0, 0], values.float(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("heads", [(6, 2), (4, 1)], ids=["gqa", "mqa"])
def test_shared_prefix_blocks_read_once_give_each_sequence_its_solo_result(
    heads: tuple[int, int],
) -> None:
    """Tables that start with the same physical blocks (prefix-cache hits, n > 1, beams) take
    the kernel's grouped path: the result matches the reference, and every sequence's output is
    bit-identical to running it alone (batch independence)."""
    torch.manual_seed(2)
    h, kvh, d, bs = *heads, 64, 16
    nb = 64
    kc = torch.randn(nb, bs, kvh, d)
    vc = torch.randn(nb, bs, kvh, d)
    prefix_a, prefix_b = [5, 9, 2], [7, 11]
    own = iter(range(20, nb))
    # (table, context length): groups sharing 3 and 2 blocks, a member whose context ends
    # inside the shared blocks, and a sequence sharing nothing.
    rows = [
        ([*prefix_a, next(own)], 3 * bs + 5),
        ([*prefix_a, next(own), next(own)], 4 * bs + 1),
        (prefix_a, 2 * bs + 3),
        ([*prefix_b, next(own)], 2 * bs + 16),
        ([next(own), next(own)], 20),
        ([*prefix_b, next(own), next(own)], 3 * bs + 9),
        ([*prefix_a, next(own)], 3 * bs),
    ]
    width = max(len(t) for t, _ in rows)
    tables = torch.tensor([t + [0] * (width - len(t)) for t, _ in rows], dtype=torch.int32)
    ctx = torch.tensor([n for _, n in rows], dtype=torch.int32)
    q = torch.randn(len(rows), h, d)
    got = cpu_decode_attention.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for b in range(len(rows)):
        alone = cpu_decode_attention.paged_decode_attention(
            q[b : b + 1], kc, vc, tables[b : b + 1], ctx[b : b + 1], d**-0.5
        )
        assert torch.equal(alone[0], got[b]), f"sequence {b} differs from its solo result"


def test_a_sequence_alone_equals_it_in_a_batch() -> None:
    """A sequence's result is bit-identical alone and in a batch, and matches the reference."""
    torch.manual_seed(3)
    h, kvh, d, bs = 9, 3, 64, 16
    kc = torch.randn(80, bs, kvh, d)
    vc = torch.randn(80, bs, kvh, d)
    tables = torch.randperm(80)[:72].view(8, 9).int()
    ctx = torch.tensor([140, 33, 70, 144, 1, 16, 100, 90], dtype=torch.int32)
    q = torch.randn(8, h, d)
    batch = cpu_decode_attention.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    for i in (0, 3, 4):
        alone = cpu_decode_attention.paged_decode_attention(
            q[i : i + 1], kc, vc, tables[i : i + 1], ctx[i : i + 1], d**-0.5
        )
        assert torch.equal(alone[0], batch[i])
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5)
    torch.testing.assert_close(batch, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int8], ids=["fp32", "int8"])
@pytest.mark.parametrize("heads", [(9, 3), (4, 4), (2, 1)], ids=["gqa", "mha", "mqa"])
def test_heads_split_over_threads_give_the_same_bits(
    heads: tuple[int, int], dtype: torch.dtype
) -> None:
    """With fewer sequences than threads (one at batch 1) the kernel splits each sequence's
    heads over the threads: every row is bit-identical whatever the thread count (one thread
    computes all heads) and in a batch large enough to need no split, and matches the
    reference."""
    torch.manual_seed(4)
    h, kvh = heads
    d, bs, lens = 64, 16, [77, 140, 5, 33]
    nb = 40
    kc, vc = torch.randn(nb, bs, kvh, d), torch.randn(nb, bs, kvh, d)
    ks = vs = None
    if dtype != torch.float32:
        (kc, ks), (vc, vs) = reference.quantize_kv(kc, dtype), reference.quantize_kv(vc, dtype)
    tables = torch.randperm(nb)[:36].view(4, 9).int()
    ctx = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(4, h, d)

    def attend(rows: slice, threads: int) -> torch.Tensor:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return cpu_decode_attention.paged_decode_attention(
                q[rows], kc, vc, tables[rows], ctx[rows], d**-0.5, ks, vs
            )
        finally:
            torch.set_num_threads(before)

    batch = attend(slice(0, 4), 1)
    for threads in (2, 3, 8):
        assert torch.equal(attend(slice(0, 1), threads)[0], batch[0]), threads
        assert torch.equal(attend(slice(1, 3), threads), batch[1:3]), threads
    want = reference.paged_decode_attention(q, kc, vc, tables, ctx, d**-0.5, ks, vs)
    torch.testing.assert_close(batch, want, atol=1e-5, rtol=1e-5)
