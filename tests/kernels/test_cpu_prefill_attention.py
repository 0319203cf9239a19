"""The CPU prefill attention against the torch reference, on the Triton tests' matrix of dtypes
and layouts: fp32 takes the C++ kernel (over a dequantized copy of the context for quantized
caches), fp16/bf16 torch's flash kernel (causal chunk + unmasked prefix merged by log-sum-exp).
Then the C++ kernel's independence of chunking and batching."""

from __future__ import annotations

import pytest
import torch
from kvserve.kernels import cpu_prefill_attention, reference

from tests.kernels.kernel_cases import AttentionCase, attention_cases, cu_query_lens


def chunks_for(bs: int) -> list[tuple[int, int]]:
    """(q_len, context_len): a first token, a whole prompt, chunks after a cached prefix (short
    and longer than the kernel's query and key tiles), an empty chunk, one token over a long
    prefix, a chunk ending on a block boundary."""
    short = [(1, 1), (bs, bs), (5, 2 * bs + 5), (0, 7), (1, 50), (20, 3 * bs)]
    return [*short, (300, 300), (130, 700)]


@pytest.mark.parametrize("case", attention_cases())
def test_matches_reference(case: AttentionCase) -> None:
    chunks = chunks_for(case.block_size)
    kv = case.paged_kv([c for _, c in chunks])
    kv.poison_unused()
    cu = cu_query_lens([q for q, _ in chunks])
    torch.manual_seed(1)
    query = torch.randn(int(cu[-1]), case.num_heads, case.head_dim).to(case.q_dtype)
    scale = case.head_dim**-0.5
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, scale)
    want = reference.prefill_attention(*args, kv.k_scale, kv.v_scale)
    got = cpu_prefill_attention.prefill_attention(*args, kv.k_scale, kv.v_scale)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    case.assert_close(got.float(), want.float())


needs_kernel = pytest.mark.skipif(not cpu_prefill_attention.available(), reason="no C++ toolchain")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor,
            chunks: list[tuple[int, int]], scales: tuple = (None, None),
            ) -> torch.Tensor:  # fmt: skip
    """The kernel over (q_len, context_len) chunks of sequences whose queries are stacked in q."""
    cu = cu_query_lens([n for n, _ in chunks])
    ctx = torch.tensor([c for _, c in chunks], dtype=torch.int32)
    d = q.shape[-1]
    return cpu_prefill_attention.prefill_attention(q, k, v, tables, cu, ctx, d**-0.5, *scales)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_a_prompt_gives_the_same_bits_however_it_is_chunked_or_batched(kv_dtype) -> None:  # type: ignore[no-untyped-def]
    """A 150-token prompt attended in one chunk, in chunks of 70 / 50 / 30 tokens (each after
    the cached rest), and beside other sequences: every token's output is bit-identical, with
    a float32 cache and with an int8 / fp8 one (what makes a store hit's answer the same as a
    cold run's: its tokens see the same cached values either way)."""
    torch.manual_seed(4)
    h, kvh, d, bs = 9, 3, 64, 16
    k = torch.randn(40, bs, kvh, d)
    v = torch.randn(40, bs, kvh, d)
    scales: tuple = (None, None)
    if kv_dtype != torch.float32:
        (k, ks), (v, vs) = reference.quantize_kv(k, kv_dtype), reference.quantize_kv(v, kv_dtype)
        scales = (ks, vs)
    table = torch.randperm(40)[:10].int()
    q = torch.randn(150, h, d)
    whole = _attend(q, k, v, table[None], [(150, 150)], scales)
    chunked = torch.cat([
        _attend(q[a:b], k, v, table[None], [(b - a, b)], scales)
        for a, b in [(0, 70), (70, 120), (120, 150)]
    ])  # fmt: skip
    assert torch.equal(chunked, whole)
    other = torch.randperm(40)[:10].int()
    tables = torch.stack([other, table, other])
    q_other = torch.randn(40 + 30, h, d)
    batch = _attend(
        torch.cat([q_other[:40], q[50:120], q_other[40:]]), k, v, tables,
        [(40, 100), (70, 120), (30, 30)], scales,
    )  # fmt: skip
    assert torch.equal(batch[40:110], whole[50:120])
    want = reference.prefill_attention(
        q, k, v, table[None], torch.tensor([0, 150], dtype=torch.int32),
        torch.tensor([150], dtype=torch.int32), d**-0.5, *scales,
    )  # fmt: skip
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)


def _threads(n: int, fn):  # type: ignore[no-untyped-def]
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


@needs_kernel
@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
def test_a_quantized_cache_read_in_place_equals_its_dequantized_copy(kv_dtype) -> None:  # type: ignore[no-untyped-def]
    """An int8 / fp8 cache is read in place, each code times its scale as the key tile is
    gathered: the same bits as the kernel over a float32 cache holding the dequantized values
    (`reference.dequantize_kv`), for chunks after a cached prefix past a key span."""
    torch.manual_seed(7)
    h, kvh, d, bs = 9, 3, 64, 16
    (k, ks), (v, vs) = (reference.quantize_kv(torch.randn(80, bs, kvh, d), kv_dtype) for _ in "kv")
    tables = torch.randperm(80).int().view(2, 40)
    chunks = [(40, 440), (25, 600)]
    q = torch.randn(65, h, d)
    got = _attend(q, k, v, tables, chunks, (ks, vs))
    dk = reference.dequantize_kv(k, ks, torch.float32)
    dv = reference.dequantize_kv(v, vs, torch.float32)
    assert torch.equal(got, _attend(q, dk, dv, tables, chunks))


@needs_kernel
def test_keys_in_spans_give_the_same_bits_however_the_prompt_is_chunked() -> None:
    """Past kKeySpan (512) keys a row's keys are attended span by span, each span a work item
    of its own, and merged: a 1,200-token prompt gives the same bits in one chunk, in chunks
    that cross a span's start (rows before it have no key in that span), beside another
    sequence and on any number of threads; and the reference's values."""
    torch.manual_seed(6)
    h, kvh, d, bs = 9, 3, 64, 16
    k = torch.randn(160, bs, kvh, d)
    v = torch.randn(160, bs, kvh, d)
    table = torch.randperm(160)[:76].int()
    n = 1200
    q = torch.randn(n, h, d)
    whole = _attend(q, k, v, table[None], [(n, n)])
    cuts = [(0, 500), (500, 530), (530, 1030), (1030, 1188), (1188, 1200)]
    for threads in (1, 2, 3):
        chunked = _threads(threads, lambda: torch.cat([
            _attend(q[a:b], k, v, table[None], [(b - a, b)]) for a, b in cuts
        ]))  # fmt: skip
        assert torch.equal(chunked, whole), threads
    other = torch.randperm(160)[:76].int()
    q_other = torch.randn(7, h, d)
    batch = _attend(
        torch.cat([q[1030:1188], q_other]), k, v, torch.stack([table, other]),
        [(158, 1188), (7, 900)],
    )  # fmt: skip
    assert torch.equal(batch[:158], whole[1030:1188])
    want = reference.prefill_attention(
        q, k, v, table[None], torch.tensor([0, n], dtype=torch.int32),
        torch.tensor([n], dtype=torch.int32), d**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(whole, want, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [32, 80, 96])
def test_other_head_dims_match_reference(head_dim: int) -> None:
    torch.manual_seed(5)
    k = torch.randn(20, 16, 2, head_dim)
    v = torch.randn(20, 16, 2, head_dim)
    tables = torch.randperm(20)[:18].view(2, 9).int()
    q = torch.randn(100 + 37, 4, head_dim)
    got = _attend(q, k, v, tables, [(100, 130), (37, 37)])
    want = reference.prefill_attention(
        q, k, v, tables, torch.tensor([0, 100, 137], dtype=torch.int32),
        torch.tensor([130, 37], dtype=torch.int32), head_dim**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_unsupported_head_dim_takes_the_torch_path() -> None:
    torch.manual_seed(6)
    k = torch.randn(4, 16, 1, 48)
    v = torch.randn(4, 16, 1, 48)
    tables = torch.arange(4, dtype=torch.int32)[None]
    q = torch.randn(50, 2, 48)
    got = _attend(q, k, v, tables, [(50, 50)])
    want = reference.prefill_attention(
        q, k, v, tables, torch.tensor([0, 50], dtype=torch.int32),
        torch.tensor([50], dtype=torch.int32), 48**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
