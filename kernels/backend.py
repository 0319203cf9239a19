"""Choose the attention implementation: Triton on CUDA (`triton`); on the CPU the C++ kernels
for the K/V write, decode and prefill attention (`cpu`), or the pure torch reference (`torch`).

All expose the same three functions with the signatures of `kernels.reference`, stated here as
protocols so that the type checker holds every implementation to them. Prefill attention also
takes the longest chunk as a Python int (`max_query_len`, keyword-only, None: unknown): Triton
sizes its launch by it instead of reading it back from the device; the others have no use for
it and take the reference's signature behind `_sized`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from kvserve.kernels import reference

BACKENDS = ("auto", "torch", "cpu", "triton")


class StoreKV(Protocol):
    """`reference.store_kv`: write T tokens' K/V into the paged cache at `slot_mapping`."""

    def __call__(
        self,
        key: torch.Tensor,  # [T, kvh, d]
        value: torch.Tensor,  # [T, kvh, d]
        k_cache: torch.Tensor,  # [nb, bs, kvh, d]
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,  # [T] int64
        k_scale: torch.Tensor | None = None,  # [nb, bs, kvh]
        v_scale: torch.Tensor | None = None,
    ) -> None: ...


class PagedDecodeAttention(Protocol):
    """`reference.paged_decode_attention`: one query token per sequence over its cached context."""

    def __call__(
        self,
        query: torch.Tensor,  # [B, h, d]
        k_cache: torch.Tensor,  # [nb, bs, kvh, d]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        context_lens: torch.Tensor,  # [B] int32, >= 1
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
    ) -> torch.Tensor: ...


class PrefillAttention(Protocol):
    """`reference.prefill_attention` (each sequence's chunk over its cached prefix and itself)
    plus the longest chunk, when the caller knows it (a bound for the launch: cu_query_lens and
    context_lens must agree with it)."""

    def __call__(
        self,
        query: torch.Tensor,  # [T, h, d]
        k_cache: torch.Tensor,  # [nb, bs, kvh, d]
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,  # [B, max_blocks] int32
        cu_query_lens: torch.Tensor,  # [B + 1] int32
        context_lens: torch.Tensor,  # [B] int32, tokens in the cache incl. this chunk
        scale: float,
        k_scale: torch.Tensor | None = None,
        v_scale: torch.Tensor | None = None,
        *,
        max_query_len: int | None = None,
    ) -> torch.Tensor: ...


def _sized(fn: Callable[..., torch.Tensor]) -> PrefillAttention:
    """A prefill attention of the reference's signature that takes (and ignores) the
    `max_query_len` hint."""

    def prefill_attention(*args: Any, max_query_len: int | None = None, **kwargs: Any) -> Any:
        return fn(*args, **kwargs)

    return prefill_attention


@dataclass(frozen=True)
class AttentionBackend:
    """One implementation of each attention function; mypy checks each against the protocol of
    its reference signature (parameter names, types, defaults).

    `cpp_decode_step`: the K/V write and decode attention are the C++ kernels that
    `kernels.cpu_decode_step` calls, so the model may run a pure decode step's layers as that
    one call (where `cpu_decode_step.applies`) and get the layer-by-layer path's results."""

    name: str
    store_kv: StoreKV
    paged_decode_attention: PagedDecodeAttention
    prefill_attention: PrefillAttention
    cpp_decode_step: bool = False


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """`auto` picks Triton on CUDA and `cpu` elsewhere (which itself falls back to the torch
    reference when its kernel cannot be built); `torch`, `cpu` and `triton` force one (Triton
    on the CPU needs TRITON_INTERPRET=1 set before triton is imported)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "cpu"
    if name == "cpu":
        from kvserve.kernels import cpu_decode_attention, cpu_ops, cpu_prefill_attention

        return AttentionBackend(
            "cpu",
            cpu_ops.store_kv,
            cpu_decode_attention.paged_decode_attention,
            _sized(cpu_prefill_attention.prefill_attention),
            cpp_decode_step=True,
        )
    if name == "torch":
        return AttentionBackend(
            "torch",
            reference.store_kv,
            reference.paged_decode_attention,
            _sized(reference.prefill_attention),
        )
    from kvserve.kernels.paged_decode import paged_decode_attention
    from kvserve.kernels.prefill_attention import prefill_attention
    from kvserve.kernels.store_kv import store_kv

    return AttentionBackend("triton", store_kv, paged_decode_attention, prefill_attention)
