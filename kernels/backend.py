"""Choose the attention implementation: Triton on CUDA; on the CPU small C++ kernels for the
K/V write and decode attention and torch's flash kernel for prefill attention (`cpu`), or the
pure torch reference (`torch`).

All expose the same three functions with the signatures of `kernels.reference`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from kvserve.kernels import reference

BACKENDS = ("auto", "torch", "cpu", "triton")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    store_kv: Any
    paged_decode_attention: Any
    prefill_attention: Any


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
            cpu_prefill_attention.prefill_attention,
        )
    if name == "torch":
        return AttentionBackend(
            "torch",
            reference.store_kv,
            reference.paged_decode_attention,
            reference.prefill_attention,
        )
    from kvserve.kernels.paged_decode import paged_decode_attention
    from kvserve.kernels.prefill_attention import prefill_attention
    from kvserve.kernels.store_kv import store_kv

    return AttentionBackend("triton", store_kv, paged_decode_attention, prefill_attention)
