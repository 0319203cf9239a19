"""Triton prefill_attention against kernels.reference.

Tolerances (|got - want| <= atol + rtol * |want|, outputs are O(1)):
- fp32 query and cache: atol 1e-4, rtol 1e-4
- fp16: atol 2e-3, rtol 2e-3
- bf16: atol 2e-2, rtol 2e-2
- int8 / fp8 cache with a bf16 query: atol 3e-2, rtol 2e-2
- int8 cache with an fp32 query: atol 1e-4, rtol 1e-4.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton decorates the kernels
pytest.importorskip("triton")

from kvserve.kernels import reference as ref
from kvserve.kernels.prefill_attention import launch_prefill_attention, prefill_attention

from tests.kernels.kernel_cases import (
    AttentionCase,
    PagedKV,
    attention_cases,
    make_paged_kv,
    prefill_batch,
)


def chunks_for(block_size: int) -> list[tuple[int, int]]:
    """(q_len, context_len) per sequence: a first token, a whole-block prompt, a chunk after a
    cached prefix, a ragged prompt spanning two query tiles, an empty chunk, a single token over
    a long prefix, a chunk ending on a block boundary."""
    bs = block_size
    return [(1, 1), (bs, bs), (5, 2 * bs + 5), (37, 37), (0, 7), (1, 50), (20, 3 * bs)]


def run_both(
    kv: PagedKV,
    query: torch.Tensor,
    cu: torch.Tensor,
    block_m: int | None = None,
    block_n: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = query.shape[-1] ** -0.5
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, scale)
    want = ref.prefill_attention(*args, kv.k_scale, kv.v_scale)
    if block_m is None:
        got = prefill_attention(*args, kv.k_scale, kv.v_scale)
    else:
        got = launch_prefill_attention(
            *args, kv.k_scale, kv.v_scale, block_m=block_m, block_n=block_n
        )
    return got, want


@pytest.mark.parametrize("case", attention_cases())
def test_prefill_matches_reference(case: AttentionCase) -> None:
    chunks = chunks_for(case.block_size)
    kv = case.paged_kv([c for _, c in chunks])
    query, cu = prefill_batch(chunks, case.num_heads, kv, case.q_dtype)
    got, want = run_both(kv, query, cu)
    assert got.shape == query.shape and got.dtype == case.q_dtype
    case.assert_close(got, want)


@pytest.mark.parametrize(
    ("block_m", "block_n"), [(16, 16), (16, 64), (64, 16)], ids=["16x16", "16x64", "64x16"]
)
def test_prefill_tile_shapes(block_m: int, block_n: int) -> None:
    """Tiles smaller and larger than a page, and the diagonal band in every position."""
    chunks = [(70, 70), (33, 90), (1, 17), (16, 16)]
    kv = make_paged_kv([c for _, c in chunks], 2, 64, 16, torch.float32)
    query, cu = prefill_batch(chunks, 4, kv, torch.float32)
    got, want = run_both(kv, query, cu, block_m, block_n)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.int8, torch.float8_e4m3fn])
def test_prefill_never_reads_past_a_sequence(cache_dtype: torch.dtype) -> None:
    """NaN in every slot beyond the context lengths must not reach the output."""
    chunks = [(9, 9), (4, 21), (16, 32)]
    kv = make_paged_kv([c for _, c in chunks], 2, 64, 16, cache_dtype)
    kv.poison_unused()
    query, cu = prefill_batch(chunks, 4, kv, torch.float32)
    got, want = run_both(kv, query, cu)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_prefill_rejects_a_context_shorter_than_its_chunk() -> None:
    kv = make_paged_kv([4], 2, 64, 16, torch.float32)
    query, cu = prefill_batch([(5, 4)], 4, kv, torch.float32)
    with pytest.raises(AssertionError):
        prefill_attention(query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 1.0)


def test_prefill_sized_on_the_host_gives_the_same_output() -> None:
    """The longest chunk given as a Python int (the launch then reads nothing back from the
    device) gives the output of the launch that reads it, bit for bit; a looser bound too."""
    chunks = chunks_for(16)
    kv = make_paged_kv([c for _, c in chunks], 2, 64, 16, torch.float32)
    query, cu = prefill_batch(chunks, 4, kv, torch.float32)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, 0.125)
    want = prefill_attention(*args)
    rows = int(cu[-1])
    for bound in (max(q for q, _ in chunks), query.shape[0]):
        got = prefill_attention(*args, max_query_len=bound)
        assert torch.equal(got[:rows], want[:rows])
