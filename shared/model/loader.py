"""Weight loaders: GGUF (through the `gguf` package) and Hugging Face layout (safetensors).

Both return weights under Hugging Face Llama names (`model.layers.{i}.self_attn.q_proj.weight`,
...), dequantized to the requested dtype, plus the `ModelConfig` and a fingerprint of the
weights (names, shapes and contents) computed once here.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from kvserve.shared.config import FETCH_MODEL_COMMAND, ModelConfig
from kvserve.shared.model.gguf_file import gguf_model_config, open_gguf
from kvserve.shared.model.quantized import QuantizedWeight, Weight, dequantize

if TYPE_CHECKING:
    from kvserve.shared.model.llama import LlamaModel

log = logging.getLogger(__name__)


class ModelNotFoundError(FileNotFoundError):
    """The model file or directory does not exist; the message says how to fetch it."""


@dataclass(frozen=True)
class LoadedWeights:
    config: ModelConfig
    weights: dict[str, Weight]  # expanded tensors, or the file's blocks (QuantizedWeight)
    fingerprint: str  # hex sha256 over sorted (name, shape, bytes) of the weights as stored
    # The models built on these weights, by (matmul dtype, device): the engines given one
    # LoadedWeights share their packed weights (startup.load_model).
    models: dict[tuple[str, str], LlamaModel] = field(
        default_factory=dict, compare=False, repr=False
    )

    @property
    def quantized(self) -> dict[str, str]:
        """Name -> format of the weights kept in the file's blocks."""
        return {k: w.fmt for k, w in self.weights.items() if isinstance(w, QuantizedWeight)}


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def resolve_model_path(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelNotFoundError(f"model not found at {p}; fetch it with: {FETCH_MODEL_COMMAND}")
    return p


def load_weights(
    path: str | Path, dtype: torch.dtype = torch.float32, keep: frozenset[str] = frozenset()
) -> LoadedWeights:
    """Load a `.gguf` file or a Hugging Face model directory. A GGUF's linear-layer weights
    (and the embedding) whose format is in `keep` (kernels.cpu_qlinear.FORMATS keys) stay in
    the file's blocks; with `keep`, each other quantized format met is named in one log line
    and expanded."""
    p = resolve_model_path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _load_gguf(p, dtype, keep)
    if p.is_dir() and (p / "config.json").exists():
        return _load_hf_dir(p, dtype)
    raise ValueError(f"{p}: expected a .gguf file or a directory with config.json")


def _unpermute_rope_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF's rotate-half halves)."""
    # w: [n_head * head_dim, in]
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def _load_gguf(path: Path, dtype: torch.dtype, keep: frozenset[str]) -> LoadedWeights:
    reader = open_gguf(str(path.resolve()))
    config = gguf_model_config(reader)
    fp = hashlib.sha256()
    weights: dict[str, Weight] = {}
    expanded: set[str] = set()
    for t in sorted(reader.tensors, key=lambda t: t.name):
        raw = np.asarray(t.data)
        fp.update(t.name.encode() + b"\0" + str(list(t.shape)).encode() + b"\0")
        fp.update(raw.tobytes())
        name = _gguf_to_hf_name(t.name)
        fmt = t.tensor_type.name.lower()
        quantized = t.tensor_type.name not in _FLOAT_TYPES
        kept = quantized and fmt in keep and raw.ndim == 2
        arr = raw if kept else dequantize(raw, t.tensor_type)
        if keep and quantized and not kept:
            expanded.add(t.tensor_type.name)
        if name.endswith("self_attn.q_proj.weight"):  # rows: the same on blocks or floats
            arr = _unpermute_rope_rows(arr, config.num_heads)
        elif name.endswith("self_attn.k_proj.weight"):
            arr = _unpermute_rope_rows(arr, config.num_kv_heads)
        tensor = torch.from_numpy(np.array(arr, order="C"))  # a copy: raw is the file's map
        weights[name] = QuantizedWeight(fmt, tensor) if kept else tensor.to(dtype)
    for kind in sorted(expanded):
        log.info("GGUF tensor type %s has no quantized kernel: expanded to fp32", kind)
    return LoadedWeights(config, weights, fp.hexdigest())


def _gguf_to_hf_name(name: str) -> str:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.{i}.{kind}.weight
    if parts[0] != "blk" or parts[2] not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"


def _load_hf_dir(path: Path, dtype: torch.dtype) -> LoadedWeights:
    from safetensors import safe_open

    config = ModelConfig.from_json_file(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no *.safetensors files")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():  # noqa: SIM118 (safe_open is not a mapping)
                raw[k] = sf.get_tensor(k)
    fp = hashlib.sha256()
    for name in sorted(raw):
        t = raw[name]
        fp.update(name.encode() + b"\0" + str(list(t.shape)).encode() + b"\0")
        fp.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    weights: dict[str, Weight] = {k: v.to(dtype) for k, v in raw.items()}
    return LoadedWeights(config, weights, fp.hexdigest())
