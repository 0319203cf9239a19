"""KV-cache capacity arithmetic: how many bytes the paged KV cache needs, and what fits in memory.

Pure Python (no torch), so `kvserve capacity` starts fast and works without the engine installed.

The cache holds K and V for every layer and every KV head:

    cache_bytes = 2 * batch * seq_len * num_layers * num_kv_heads * head_dim * element_bytes
                  (+ scales, for int8 / fp8)

int8 and fp8 caches keep one float32 scale per (token, KV head) for K and one for V in every
layer (DESIGN.md section 3: per-(token, head) float scales in a side tensor), which adds
`2 * num_layers * num_kv_heads * 4` bytes per token on top of the one byte per element.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from typing import Any

from kvserve.shared.config import ModelConfig

# Bytes per stored K/V element.
KV_DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2, "int8": 1, "fp8": 1}
# Quantized KV dtypes carry a float32 scale per (token, KV head), for K and for V, per layer.
QUANTIZED_KV_DTYPES = frozenset({"int8", "fp8"})
SCALE_BYTES = 4
# The dtypes `kvserve capacity` tabulates (fp16 is the same size as bf16).
REPORT_KV_DTYPES = ("fp32", "bf16", "int8", "fp8")


def _llama(
    layers: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    ffn: int,
    vocab: int,
    **extra: Any,
) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=ffn,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        **extra,
    )


# Published architectures (the models' Hugging Face config.json files).
PRESETS: dict[str, ModelConfig] = {
    "llama-2-7b": _llama(32, 32, 32, 128, 4096, 11008, 32000, max_position_embeddings=4096),
    "llama-2-70b": _llama(80, 64, 8, 128, 8192, 28672, 32000, max_position_embeddings=4096),
    "llama-3-8b": _llama(
        32, 32, 8, 128, 4096, 14336, 128256, rope_theta=500000.0, max_position_embeddings=8192
    ),
    "llama-3-70b": _llama(
        80, 64, 8, 128, 8192, 28672, 128256, rope_theta=500000.0, max_position_embeddings=8192
    ),
    # Mistral-7B-v0.1 (vocab 32000).
    "mistral-7b": _llama(32, 32, 8, 128, 4096, 14336, 32000, max_position_embeddings=32768),
    # SmolLM2-135M(-Instruct), kvserve's default model.
    "smollm2-135m": _llama(
        30,
        9,
        3,
        64,
        576,
        1536,
        49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        max_position_embeddings=8192,
    ),
}


def get_preset(name: str) -> ModelConfig:
    """The preset `name`; ValueError naming the known presets if there is none."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r} (known: {', '.join(PRESETS)})") from None


def _element_bytes(kv_dtype: str) -> int:
    try:
        return KV_DTYPE_BYTES[kv_dtype]
    except KeyError:
        raise ValueError(
            f"unknown KV dtype {kv_dtype!r} (known: {', '.join(KV_DTYPE_BYTES)})"
        ) from None


def attention_kind(config: ModelConfig) -> str:
    """ "MHA" (num_kv_heads = num_heads), "MQA" (num_kv_heads = 1) or "GQA" (anything between)."""
    if config.num_kv_heads == config.num_heads:
        return "MHA"
    return "MQA" if config.num_kv_heads == 1 else "GQA"


def kv_scale_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """Scale bytes per token: `2 * num_layers * num_kv_heads * 4` for int8/fp8, else 0."""
    _element_bytes(kv_dtype)
    if kv_dtype not in QUANTIZED_KV_DTYPES:
        return 0
    return 2 * config.num_layers * config.num_kv_heads * SCALE_BYTES


def kv_bytes_per_token(config: ModelConfig, kv_dtype: str) -> int:
    """K and V of one token over all layers, scales included:
    `2 * num_layers * num_kv_heads * head_dim * element_bytes` (+ the int8/fp8 scales)."""
    elements = 2 * config.num_layers * config.num_kv_heads * config.head_dim
    return elements * _element_bytes(kv_dtype) + kv_scale_bytes_per_token(config, kv_dtype)


def kv_cache_bytes(config: ModelConfig, kv_dtype: str, batch: int, seq_len: int) -> int:
    """Cache for `batch` sequences of `seq_len` tokens:
    `2 * batch * seq_len * num_layers * num_kv_heads * head_dim * element_bytes` (+ scales)."""
    if batch < 1 or seq_len < 1:
        raise ValueError("batch and seq_len must be >= 1")
    return batch * seq_len * kv_bytes_per_token(config, kv_dtype)


def mha_equivalent(config: ModelConfig) -> ModelConfig:
    """The same model with multi-head attention: one KV head per query head."""
    return dataclasses.replace(config, num_kv_heads=config.num_heads)


def parameter_count(config: ModelConfig) -> int:
    """Parameters of a Llama-family decoder: embeddings (+ lm_head unless tied), per layer the
    Q/K/V/O projections, the gated MLP (gate, up, down) and two RMSNorm weights, the final norm.
    No biases (Llama has none)."""
    h, d = config.hidden_size, config.head_dim
    attn = h * config.num_heads * d * 2 + h * config.num_kv_heads * d * 2  # q, o; k, v
    mlp = 3 * h * config.intermediate_size
    per_layer = attn + mlp + 2 * h
    embeddings = config.vocab_size * h * (1 if config.tie_word_embeddings else 2)
    return embeddings + config.num_layers * per_layer + h


def weights_bytes(config: ModelConfig, dtype: str) -> int:
    """Weight memory: `parameter_count * bytes per element of dtype` (quantization scales of
    int8/fp8 weights and activations are not counted)."""
    return parameter_count(config) * _element_bytes(dtype)


@dataclass(frozen=True)
class Fit:
    """What fits in a memory budget for one KV dtype.

    `available_bytes = memory_bytes - weights_bytes` (may be negative: nothing fits). The paged
    cache allocates whole blocks of `block_size` tokens, so `num_blocks = available //
    (block_size * bytes_per_token)`, `tokens = num_blocks * block_size` and a sequence of
    `seq_len` tokens takes `ceil(seq_len / block_size)` blocks. With block_size 1 this is the plain
    `available // bytes_per_token` and `available // (seq_len * bytes_per_token)`.
    """

    memory_bytes: int
    weights_bytes: int
    available_bytes: int
    block_size: int
    num_blocks: int
    tokens: int
    sequences: int


def fit_in_memory(
    config: ModelConfig,
    kv_dtype: str,
    memory_bytes: int,
    seq_len: int,
    *,
    weights_dtype: str | None = None,
    block_size: int = 1,
) -> Fit:
    """Tokens, and sequences of `seq_len` tokens, whose KV cache fits in `memory_bytes`, after
    subtracting the weights (`parameter_count * bytes of weights_dtype`) when `weights_dtype` is
    given."""
    if memory_bytes < 0:
        raise ValueError("memory_bytes must be >= 0")
    if seq_len < 1 or block_size < 1:
        raise ValueError("seq_len and block_size must be >= 1")
    weights = 0 if weights_dtype is None else weights_bytes(config, weights_dtype)
    available = memory_bytes - weights
    num_blocks = max(available, 0) // (block_size * kv_bytes_per_token(config, kv_dtype))
    return Fit(
        memory_bytes=memory_bytes,
        weights_bytes=weights,
        available_bytes=available,
        block_size=block_size,
        num_blocks=num_blocks,
        tokens=num_blocks * block_size,
        sequences=num_blocks // math.ceil(seq_len / block_size),
    )


@dataclass(frozen=True)
class CapacityReport:
    """KV-cache size of `batch x seq_len` tokens for one KV dtype, next to the same model with
    MHA (`num_kv_heads = num_heads`); `kv_saving = mha_bytes_per_token / bytes_per_token`, which
    is `num_heads / num_kv_heads` (1.0 for MHA). `fit` is set when a memory budget was given."""

    kv_dtype: str
    batch: int
    seq_len: int
    bytes_per_token: int
    scale_bytes_per_token: int
    cache_bytes: int
    mha_bytes_per_token: int
    mha_cache_bytes: int
    kv_saving: float
    fit: Fit | None = None


def capacity_report(
    config: ModelConfig,
    kv_dtype: str,
    batch: int,
    seq_len: int,
    *,
    memory_bytes: int | None = None,
    weights_dtype: str | None = None,
    block_size: int = 1,
) -> CapacityReport:
    """Everything `kvserve capacity` prints for one KV dtype (see `CapacityReport`)."""
    mha = mha_equivalent(config)
    per_token = kv_bytes_per_token(config, kv_dtype)
    mha_per_token = kv_bytes_per_token(mha, kv_dtype)
    fit = None
    if memory_bytes is not None:
        fit = fit_in_memory(
            config,
            kv_dtype,
            memory_bytes,
            seq_len,
            weights_dtype=weights_dtype,
            block_size=block_size,
        )
    return CapacityReport(
        kv_dtype=kv_dtype,
        batch=batch,
        seq_len=seq_len,
        bytes_per_token=per_token,
        scale_bytes_per_token=kv_scale_bytes_per_token(config, kv_dtype),
        cache_bytes=kv_cache_bytes(config, kv_dtype, batch, seq_len),
        mha_bytes_per_token=mha_per_token,
        mha_cache_bytes=kv_cache_bytes(mha, kv_dtype, batch, seq_len),
        kv_saving=mha_per_token / per_token,
        fit=fit,
    )


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]i?)?b?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1,
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "p": 10**15,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
    "pi": 2**50,
}


def parse_size(text: str) -> int:
    """Bytes in a size such as `24GiB`, `80GB`, `512MiB`, `1.5 GiB` or `1048576`.

    Units are case-insensitive; `KiB/MiB/GiB/TiB/PiB` (or `Ki`, `Gi`, ...) are powers of 1024,
    `KB/MB/GB/TB/PB` (or `K`, `G`, ...) powers of 1000, a bare number or `B` is bytes. The result
    must be a whole number of bytes. ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if m is None:
        raise ValueError(f"invalid size {text!r} (examples: 24GiB, 80GB, 512MiB, 1048576)")
    try:
        value = Decimal(m.group(1)) * _SIZE_UNITS[(m.group(2) or "").lower()]
    except InvalidOperation:  # pragma: no cover - the regex admits only decimal numbers
        raise ValueError(f"invalid size {text!r}") from None
    if value != value.to_integral_value():
        raise ValueError(f"size {text!r} is not a whole number of bytes")
    return int(value)


def format_size(num_bytes: float) -> str:
    """`num_bytes` in binary units with two decimals (`1.50 GiB`); exact below 1 KiB."""
    if abs(num_bytes) < 1024:
        return f"{int(num_bytes)} B"
    value = float(num_bytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024 or unit == "TiB":
            break
    return f"{value:.2f} {unit}"
