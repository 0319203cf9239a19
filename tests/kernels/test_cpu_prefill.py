"""The CPU prefill attention (torch's flash kernel, causal chunk + unmasked prefix merged by
log-sum-exp) against the torch reference, on the Triton tests' matrix of dtypes and layouts."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import attention_cases, make_paged_kv
from kvserve.kernels import cpu_prefill, reference


def chunks_for(bs: int) -> list[tuple[int, int]]:
    """(q_len, context_len): a first token, a whole prompt, chunks after a cached prefix (short
    and longer than the kernel's query and key tiles), an empty chunk, one token over a long
    prefix, a chunk ending on a block boundary."""
    short = [(1, 1), (bs, bs), (5, 2 * bs + 5), (0, 7), (1, 50), (20, 3 * bs)]
    return [*short, (300, 300), (130, 700)]


@pytest.mark.parametrize(
    ("q_dtype", "cache_dtype", "atol", "rtol", "num_heads", "num_kv_heads", "head_dim", "bs"),
    attention_cases(),
)
def test_matches_reference(
    q_dtype: torch.dtype,
    cache_dtype: torch.dtype,
    atol: float,
    rtol: float,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    bs: int,
) -> None:
    chunks = chunks_for(bs)
    kv = make_paged_kv([c for _, c in chunks], num_kv_heads, head_dim, bs, cache_dtype)
    kv.poison_unused()
    cu = torch.zeros(len(chunks) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor([q for q, _ in chunks]).cumsum(0)
    torch.manual_seed(1)
    query = torch.randn(int(cu[-1]), num_heads, head_dim).to(q_dtype)
    args = (query, kv.k_cache, kv.v_cache, kv.block_tables, cu, kv.context_lens, head_dim**-0.5)
    want = reference.prefill_attention(*args, kv.k_scale, kv.v_scale)
    got = cpu_prefill.prefill_attention(*args, kv.k_scale, kv.v_scale)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), atol=atol, rtol=rtol)
