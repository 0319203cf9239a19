"""What an engine is built from, each a timed part of start-up (`kvserve bench startup` reports
them): the compiled kernels, the weights, the tokenizer, the model with its packed weights, the
KV cache (its memory reserved) and the tiers behind it.

The model fingerprint names the numerics the K/V come from: other matmul dtypes or int8
activations give other K/V, so such blocks never meet in a shared store.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from kvserve.kernels import cpp_build, cpu_qlinear
from kvserve.shared.config import EngineConfig, ModelConfig
from kvserve.shared.engine.kv.cache import KVCache, kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.engine.kv.manager import KVCacheManager, KVIdentity
from kvserve.shared.model.llama import LlamaModel
from kvserve.shared.model.loader import LoadedWeights, load_weights
from kvserve.shared.model.quantized import QuantizedWeight
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.store.backends import open_store
from kvserve.shared.store.base import BlockStore
from kvserve.shared.store.codec import BlockMeta

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@contextlib.contextmanager
def timed(into: dict[str, float], name: str) -> Iterator[None]:
    """Record the seconds the block took as `into[name]`."""
    t0 = time.perf_counter()
    try:
        yield
    finally:
        into[name] = time.perf_counter() - t0


def kept_formats(config: EngineConfig) -> frozenset[str]:
    """The GGUF block formats the linear layers keep (EngineConfig.weights); `file` where none
    can be kept is a ValueError."""
    gguf = str(config.model_path).endswith(".gguf")
    if config.file_weights_possible and gguf and cpu_qlinear.available():
        return frozenset(cpu_qlinear.FORMATS)
    if config.weights == "file":
        why = "not a GGUF file" if not gguf else "no compiled CPU kernels"
        raise ValueError(f"weights 'file': the file's blocks cannot be used ({why})")
    return frozenset()


@dataclass(frozen=True)
class LoadedModel:
    weights: LoadedWeights
    model: LlamaModel
    tokenizer: KVTokenizer
    fingerprint: str  # the model's, with the numerics that change its K/V


def load_model(
    config: EngineConfig,
    startup_s: dict[str, float],
    weights: LoadedWeights | None = None,
    tokenizer: KVTokenizer | None = None,
) -> LoadedModel:
    """Kernels, weights (or the `weights` given), tokenizer and the model on its device."""
    phase = functools.partial(timed, startup_s)
    with phase("kernel_load"):
        if torch.device(config.device).type == "cpu":
            cpp_build.extension()
    with phase("model_read"):
        loaded = weights or load_weights(
            config.model_path, DTYPES[config.dtype], kept_formats(config)
        )
    matmul = config.resolved_matmul_dtype
    fingerprint = (
        loaded.fingerprint
        if matmul == config.dtype
        else hashlib.sha256(f"{loaded.fingerprint}/matmul={matmul}".encode()).hexdigest()
    )
    with phase("tokenizer"):
        tokenizer = tokenizer or KVTokenizer.from_path(config.model_path)
    with phase("weight_packing"):
        model = _model(loaded, DTYPES[matmul], config.device, shared=weights is not None)
    if model.int8_activations:
        fingerprint = hashlib.sha256(f"{fingerprint}/activations=int8".encode()).hexdigest()
    return LoadedModel(loaded, model, tokenizer, fingerprint)


_BUILDING = threading.Lock()  # one build at a time of a model whose weights are shared


def _model(loaded: LoadedWeights, matmul: torch.dtype, device: str, shared: bool) -> LlamaModel:
    """The model on `device`, its weights prepacked for its kernels. Where the caller gave the
    weights (one load shared between engines), a replica of the model built first on them:
    the packing (0.3-0.6 s on 2 cores) is done once and the packed weights are held once."""
    if not shared:
        return _build(loaded, matmul, device)
    key = (str(matmul), str(torch.device(device)))
    with _BUILDING:
        if key not in loaded.models:
            loaded.models[key] = _build(loaded, matmul, device)
        return loaded.models[key].replica()


def _build(loaded: LoadedWeights, matmul: torch.dtype, device: str) -> LlamaModel:
    # Weights go to the device first: the model prepacks them for that device.
    on_device = {
        k: v if isinstance(v, QuantizedWeight) else v.to(device) for k, v in loaded.weights.items()
    }
    return LlamaModel(loaded.config, on_device, matmul).eval()


def build_kv_manager(
    config: EngineConfig,
    model: ModelConfig,
    identity: tuple[str, str],
    startup_s: dict[str, float],
    open_backend: Callable[[str], BlockStore] = open_store,
) -> KVCacheManager:
    """The KV cache (its memory reserved) and the tiers behind it; `identity` is the model's
    and the tokenizer's fingerprints, `open_backend` opens the store's URL."""
    cc, phase = config.cache, functools.partial(timed, startup_s)
    kv_dtype = resolve_kv_dtype(cc.kv_dtype, DTYPES[config.dtype])
    num_blocks = cc.num_blocks or max(
        1, cc.memory_budget_bytes // (kv_bytes_per_token(model, kv_dtype) * cc.block_size)
    )
    with phase("kv_cache"):
        cache = KVCache(model, num_blocks, cc.block_size, kv_dtype, config.device, cc.populate)
    kv_format = str(kv_dtype).removeprefix("torch.")
    model_fp, tokenizer_fp = identity
    meta = BlockMeta(
        model_fp, kv_format, cc.block_size, model.num_layers, model.num_kv_heads, model.head_dim
    )
    with phase("store") if config.store.url else contextlib.nullcontext():
        return KVCacheManager(
            cache,
            KVIdentity(meta, tokenizer_fp),
            enable_caching=cc.enable_prefix_caching,
            store=config.store,
            open_backend=open_backend,
        )
