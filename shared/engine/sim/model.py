"""SimulatedModel: what a simulated engine is built from instead of weights: the cost profile,
the tokenizer, the KV cache's geometry (the payload) and the engine settings the profile fixes.

The payload is the modelled model's true KV geometry ("true": store frames of the true size,
their transfers real) or one layer of one 8-wide head ("small": 64 bytes a token in fp32, the
transfers' time modelled from the true size by ModelledTransfers). A simulated engine's blocks
have a fingerprint of their own (the profile's name and the payload), so they never meet a real
engine's, or another geometry's, in a shared store.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass

import torch
from kvserve.shared.config import EngineConfig, ModelConfig
from kvserve.shared.engine.kv.cache import KVCache
from kvserve.shared.engine.sim.profile import CostProfile
from kvserve.shared.model.tokenizer import KVTokenizer

SMALL_LAYERS, SMALL_HEADS, SMALL_HEAD_DIM = 1, 1, 8
# The profile's KV dtype -> (EngineConfig.dtype, CacheConfig.kv_dtype) of a true payload.
_CACHE_DTYPES = {
    "float32": ("float32", "auto"),
    "bfloat16": ("bfloat16", "auto"),
    "float16": ("float16", "auto"),
    "int8": ("float32", "int8"),
    "fp8": ("float32", "fp8"),
}


@dataclass(frozen=True)
class SimulatedModel:
    profile: CostProfile
    tokenizer: KVTokenizer
    config: ModelConfig  # the KV cache's geometry (the payload's)
    fingerprint: str
    true_payload: bool
    engine_config: EngineConfig  # the caller's, with the profile's capacity and limits

    @property
    def payload_bytes_per_token(self) -> int:
        """KV bytes a token takes in this engine's cache."""
        return payload_bytes_per_token(self.profile, self.true_payload)

    def describe(self) -> str:
        """One line for the logs and the benchmarks' output: what is real, what is modelled."""
        p = self.profile
        payload = (
            "true KV payload (store transfers real)"
            if self.true_payload
            else f"small KV payload ({self.payload_bytes_per_token} B/token; store transfers "
            f"modelled at {p.model.kv_bytes_per_token} B/token)"
        )
        return (
            f"simulated {p.model.name} ({p.source}: {p.machine}), {p.engine.num_blocks} blocks "
            f"of {p.engine.block_size}, {payload}, time scale {self.time_scale:g}"
        )

    @property
    def time_scale(self) -> float:
        sim = self.engine_config.simulate
        return sim.time_scale if sim is not None else 1.0


def load_simulated(config: EngineConfig, tokenizer: KVTokenizer | None = None) -> SimulatedModel:
    """The profile named by `config.simulate` (ProfileError if unusable) and the tokenizer of
    `config.model_path` (the model file's tokenizer alone: no weights are read)."""
    sim = config.simulate
    assert sim is not None
    profile = CostProfile.load(sim.profile)
    tokenizer = tokenizer or KVTokenizer.from_path(config.model_path)
    m = profile.model
    true_bytes = profile.engine.num_blocks * profile.engine.block_size * m.kv_bytes_per_token
    true = sim.payload == "true" or (
        sim.payload == "auto" and true_bytes <= sim.true_payload_max_bytes
    )
    layers, heads, dim = (
        (m.num_layers, m.num_kv_heads, m.head_dim)
        if true
        else (SMALL_LAYERS, SMALL_HEADS, SMALL_HEAD_DIM)
    )
    payload = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        hidden_size=heads * dim,
        intermediate_size=heads * dim,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=dim,
        max_position_embeddings=m.max_model_len,
        eos_token_ids=tuple(tokenizer.eos_token_ids),
    )
    ident = f"sim/{profile.name}/{m.name}/{layers}x{heads}x{dim}/{tokenizer.fingerprint}"
    fingerprint = hashlib.sha256(ident.encode()).hexdigest()
    return SimulatedModel(
        profile, tokenizer, payload, fingerprint, true, _engine_config(config, profile, true)
    )


def _engine_config(config: EngineConfig, profile: CostProfile, true: bool) -> EngineConfig:
    """The profile's KV capacity, block size, scheduler limits and host tier (in blocks of
    the payload), and the cache dtype of a true payload."""
    e, m = profile.engine, profile.model
    dtype, kv_dtype = _CACHE_DTYPES[m.kv_dtype] if true else ("float32", "auto")
    payload_block = e.block_size * payload_bytes_per_token(profile, true)
    cache = dataclasses.replace(
        config.cache,
        num_blocks=e.num_blocks,
        block_size=e.block_size,
        kv_dtype=kv_dtype,
        populate="eager" if true else "lazy",
    )
    scheduler = dataclasses.replace(
        config.scheduler,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        max_prefill_chunk=e.max_prefill_chunk,
    )
    # A small payload is no real KV: its frames are stored as they are (native) unless told
    # otherwise; their transfer time is modelled from the true size either way.
    fmt = config.store.format if true or config.store.format != "auto" else "native"
    store = dataclasses.replace(
        config.store, host_tier_bytes=e.host_tier_blocks * payload_block, format=fmt
    )
    return dataclasses.replace(
        config, dtype=dtype, cache=cache, scheduler=scheduler, store=store, weights="fp32"
    )


def payload_bytes_per_token(profile: CostProfile, true: bool) -> int:
    """KV bytes a token takes in a simulated engine's cache."""
    if true:
        return profile.model.kv_bytes_per_token
    return 2 * SMALL_LAYERS * SMALL_HEADS * SMALL_HEAD_DIM * 4


def fill_like_kv(cache: KVCache, seed: int = 0) -> None:
    """Give a true payload's blocks KV-like contents (normal values, a different pattern per
    layer, the same in every block), so that its store frames compress as real ones do rather
    than as zeros."""
    gen = torch.Generator().manual_seed(seed)
    for tensors in (cache.k, cache.v):
        for t in tensors:
            if t.dtype in (torch.int8, torch.float8_e4m3fn):
                pattern = torch.randint(-127, 128, t.shape[1:], generator=gen, dtype=torch.int8)
                t.view(torch.int8).copy_(pattern.expand_as(t))
            else:
                pattern = torch.randn(t.shape[1:], generator=gen).to(t.dtype)
                t.copy_(pattern.expand_as(t))
