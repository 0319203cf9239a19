"""Model configs of a given attention shape, for the tests of the KV cache, the KV-cache manager,
the scheduler and the capacity calculator."""

from __future__ import annotations

from kvserve.shared.config import ModelConfig


def model_config(
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    vocab_size: int = 32,
    intermediate_size: int | None = None,
) -> ModelConfig:
    """A ModelConfig with these attention dimensions; what the KV cache does not read is filled
    in: hidden_size = num_heads * head_dim, intermediate_size twice that unless given, a vocabulary
    of 32 tokens unless given; every other field its default."""
    hidden_size = num_heads * head_dim
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size if intermediate_size is None else intermediate_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
    )
