"""What one forward step's attention needs to know about the batch's layout in the paged cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


class PagedKV(Protocol):
    """The paged KV cache as the model reads and writes it: per layer, K and V
    [num_blocks, block_size, num_kv_heads, head_dim] and, for an int8 / fp8 cache, their
    per-(token, head) scales [num_blocks, block_size, num_kv_heads] (None otherwise). The engine's
    KVCache is one; the model never allocates or frees blocks."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scale: list[torch.Tensor | None]
    v_scale: list[torch.Tensor | None]


@dataclass(frozen=True)
class AttentionMetadata:
    """Tokens of a step are laid out prefill chunks first, then decode tokens.

    - `slot_mapping` [T]: cache slot of every token of the step (both parts).
    - prefill part: `num_prefill_tokens` tokens from `len(prefill_context_lens)` sequences;
      `prefill_cu_query_lens` [P + 1] their offsets, `prefill_context_lens` [P] cache length
      after this step, `prefill_block_tables` [P, max_blocks].
    - decode part: one token each for `len(decode_context_lens)` sequences,
      `decode_block_tables` [D, max_blocks].
    - host-side sizes (Python ints, None where the caller has none): `prefill_max_query_len`
      the longest prefill chunk, `max_seq_len` the longest sequence after this step (its last
      position + 1). On a GPU they size launches and tables without reading device tensors
      back (a host-device synchronisation).
    """

    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    prefill_cu_query_lens: torch.Tensor
    prefill_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    decode_block_tables: torch.Tensor
    prefill_max_query_len: int | None = None
    max_seq_len: int | None = None

    @property
    def num_decode_tokens(self) -> int:
        return int(self.decode_context_lens.shape[0])


@dataclass(frozen=True)
class OutputRows:
    """The rows of a step whose hidden states are wanted (those that sample), and the attention
    metadata for them alone: each wanted prefill row as a one-token chunk at its position (the
    decode part unchanged). The last layer needs every token's K/V but only these rows'
    attention output, o projection and MLP."""

    rows: torch.Tensor  # [N] int64 indices into the step's tokens
    meta: AttentionMetadata
