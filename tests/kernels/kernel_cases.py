"""The kernel tests' cases (a helper module, not a test module): paged caches with their block
tables, empty caches for the K/V write, the attention test matrix, and prefill batches.

Importing it does not import triton, so the Triton test modules set TRITON_INTERPRET first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch
from kvserve.kernels.reference import is_quantized, quantize_kv

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@dataclass
class PagedKV:
    """One layer's paged cache holding `context_lens[b]` tokens for each sequence b.

    Sequences own disjoint, randomly placed blocks; every block table has at least one extra
    trailing entry, a valid id of a spare block no sequence owns (as a table sized for a longer
    batch would), so a kernel that reads past a sequence's length meets poison.
    """

    k_cache: torch.Tensor  # [nb, bs, kvh, d]
    v_cache: torch.Tensor  # [nb, bs, kvh, d]
    k_scale: torch.Tensor | None  # [nb, bs, kvh] fp32 for an int8/fp8 cache
    v_scale: torch.Tensor | None
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32

    def poison_unused(self) -> None:
        """Overwrite every slot past each sequence's length with NaN (values or scales)."""
        nb, bs = self.k_cache.shape[:2]
        live = torch.zeros(nb * bs, dtype=torch.bool, device=self.k_cache.device)
        for b, ctx in enumerate(self.context_lens.tolist()):
            pos = torch.arange(ctx, device=live.device)
            blocks = self.block_tables[b].long()[pos // bs]
            live[blocks * bs + pos % bs] = True
        dead = ~live.view(nb, bs)  # [nb, bs]
        if self.k_scale is not None and self.v_scale is not None:
            self.k_scale[dead] = float("nan")
            self.v_scale[dead] = float("nan")
            self.k_cache.view(torch.uint8)[dead] = 0x7F  # NaN in e4m3, 127 in int8
            self.v_cache.view(torch.uint8)[dead] = 0x7F
        else:
            self.k_cache[dead] = float("nan")
            self.v_cache[dead] = float("nan")


# A layer's cache as the K/V write takes it: k_cache, v_cache, k_scale, v_scale
CacheTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]


def empty_cache(nb: int, bs: int, kvh: int, d: int, dtype: torch.dtype) -> CacheTensors:
    """Zeroed K/V caches [nb, bs, kvh, d] (and zeroed scales [nb, bs, kvh] when quantized)."""
    k = torch.zeros(nb, bs, kvh, d, device=DEVICE).to(dtype)
    v = torch.zeros(nb, bs, kvh, d, device=DEVICE).to(dtype)
    if is_quantized(dtype):
        return (
            k,
            v,
            torch.zeros(nb, bs, kvh, device=DEVICE),
            torch.zeros(nb, bs, kvh, device=DEVICE),
        )
    return k, v, None, None


def make_paged_kv(
    context_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    cache_dtype: torch.dtype,
    spare_blocks: int = 2,  # >= 1
    seed: int = 0,
) -> PagedKV:
    """Random K/V ~ N(0, 1) (quantized with reference.quantize_kv for int8/fp8 caches), placed
    from a fixed torch seed."""
    torch.manual_seed(seed)
    blocks_per_seq = [(n + block_size - 1) // block_size for n in context_lens]
    nb = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(nb).tolist()
    max_blocks = max(blocks_per_seq) + 1
    rows, used = [], 0
    for n in blocks_per_seq:
        own = perm[used : used + n]
        used += n
        spare = perm[nb - spare_blocks :]
        tail = [spare[i % spare_blocks] for i in range(max_blocks - n)]
        rows.append(own + tail)
    shape = (nb, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, device=DEVICE)  # [nb, bs, kvh, d]
    v = torch.randn(shape, device=DEVICE)
    if is_quantized(cache_dtype):
        k_cache, k_scale = quantize_kv(k, cache_dtype)
        v_cache, v_scale = quantize_kv(v, cache_dtype)
        return PagedKV(
            k_cache, v_cache, k_scale, v_scale,
            torch.tensor(rows, dtype=torch.int32, device=DEVICE),
            torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
        )  # fmt: skip
    return PagedKV(
        k.to(cache_dtype), v.to(cache_dtype), None, None,
        torch.tensor(rows, dtype=torch.int32, device=DEVICE),
        torch.tensor(context_lens, dtype=torch.int32, device=DEVICE),
    )  # fmt: skip


# Attention test matrix. Tolerances: |got - want| <= atol + rtol * |want| on O(1) outputs. The
# reference computes scores in the query dtype and rounds dequantized K/V to it once; the kernels
# keep scores in fp32 and round P once more; the interpreter truncates fp32 -> bf16 casts.
# (query dtype, cache dtype, atol, rtol)
FP32 = (torch.float32, torch.float32, 1e-4, 1e-4)
FP16 = (torch.float16, torch.float16, 2e-3, 2e-3)
BF16 = (torch.bfloat16, torch.bfloat16, 2e-2, 2e-2)
BF16_INT8 = (torch.bfloat16, torch.int8, 3e-2, 2e-2)
BF16_FP8 = (torch.bfloat16, torch.float8_e4m3fn, 3e-2, 2e-2)
FP32_INT8 = (torch.float32, torch.int8, 1e-4, 1e-4)  # dequantization is exact arithmetic
# (num_heads, num_kv_heads, head_dim, block_size)
MHA = (4, 4, 64, 16)
GQA = (8, 2, 128, 32)
MQA = (4, 1, 64, 32)
GQA3 = (6, 3, 128, 16)  # three KV heads: not a power of two


@dataclass(frozen=True)
class AttentionCase:
    """One cell of the attention test matrix: the dtypes, their tolerance and the layout."""

    q_dtype: torch.dtype
    cache_dtype: torch.dtype
    atol: float
    rtol: float
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int

    def paged_kv(self, context_lens: list[int]) -> PagedKV:
        """`make_paged_kv` of this layout and cache dtype."""
        return make_paged_kv(
            context_lens, self.num_kv_heads, self.head_dim, self.block_size, self.cache_dtype
        )

    def assert_close(self, got: torch.Tensor, want: torch.Tensor) -> None:
        torch.testing.assert_close(got, want, atol=self.atol, rtol=self.rtol)


def attention_cases() -> list[Any]:
    """Every layout for the unquantized caches; two layouts per quantized cache, between them
    covering head_dim 64 and 128, block sizes 16 and 32, and MHA, GQA and MQA. Parameters of
    one AttentionCase each."""
    names = {FP32: "fp32", FP16: "fp16", BF16: "bf16", BF16_INT8: "bf16-int8",
             BF16_FP8: "bf16-fp8", FP32_INT8: "fp32-int8"}  # fmt: skip
    layouts = {MHA: "mha-d64-bs16", GQA: "gqa-d128-bs32", MQA: "mqa-d64-bs32",
               GQA3: "gqa3-d128-bs16"}  # fmt: skip
    pairs = [(p, lay) for p in (FP32, FP16, BF16) for lay in layouts]
    pairs += [(BF16_INT8, GQA), (BF16_INT8, MHA), (BF16_FP8, GQA3), (BF16_FP8, MQA)]
    pairs += [(FP32_INT8, MQA)]
    return [
        pytest.param(AttentionCase(*p, *lay), id=f"{names[p]}-{layouts[lay]}") for p, lay in pairs
    ]


def cu_query_lens(q_lens: list[int]) -> torch.Tensor:
    """[B + 1] int32 offsets of each sequence's queries in a prefill batch (on the CPU)."""
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return cu


def prefill_batch(
    chunks: list[tuple[int, int]], num_heads: int, kv: PagedKV, q_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(query [T, h, d] ~ N(0, 1) on DEVICE, cu_query_lens [B + 1] int32 on DEVICE) for
    (q_len, context_len) chunks over `kv`."""
    cu = cu_query_lens([q for q, _ in chunks])
    d = kv.k_cache.shape[-1]
    query = torch.randn(int(cu[-1]), num_heads, d, device=DEVICE).to(q_dtype)
    return query, cu.to(DEVICE)
