"""A Llama-family decoder in plain PyTorch, reading and writing the paged KV cache.

RMSNorm, RoPE (default / linear / llama3 scaling), SwiGLU MLP, attention with any number of KV
heads (MHA, GQA, MQA), tied or untied LM head. Q/K/V and gate/up projections are fused into one
matmul each. The forward pass is token-flat: [T] tokens of many sequences at once.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from kvserve.kernels import cpu_decode_step, cpu_linear, cpu_ops, cpu_qlinear
from kvserve.kernels.backend import AttentionBackend
from kvserve.shared.config import ModelConfig
from kvserve.shared.model.attention import AttentionMetadata, OutputRows, PagedKV
from kvserve.shared.model.quantized import (
    LinearWeight,
    QuantizedWeight,
    StackedBlocks,
    Weight,
    expand,
    fuse,
)
from torch import nn


def _can_prepack(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
    )


class Linear(nn.Module):
    """y = x @ W.T. fp32 on the CPU: kernels.cpu_linear's GEMM over the weight packed once into
    column panels (faster than oneDNN at decode batch sizes, and a row's result does not depend
    on the batch). Where that does not apply (bf16 matmuls, no compiler, more rows than
    cpu_linear.max_rows() on an AVX2 machine) the weight prepacked for oneDNN (what
    torch.compile's CPU backend does with frozen weights; faster than F.linear's BLAS path);
    elsewhere plain F.linear. Only the copies a path needs are kept.

    A weight in its GGUF file's blocks (QuantizedWeight, or StackedBlocks of several formats:
    one panel matrix per part) is packed for kernels.cpu_qlinear,
    which computes on activations quantized to two int8 terms (`int8_activations`); without the
    compiled kernels it is expanded.

    `compute_dtype` (default: the weight's) is the dtype of the matmul itself: the weight is
    stored in it, the input is cast to it and the output back to the input's dtype (bfloat16
    matmuls in a float32 model use the CPU's bf16 dot-product instructions)."""

    def __init__(self, weight: LinearWeight, compute_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        # The file's blocks as panels with their output features: one part, or StackedBlocks'
        # parts side by side
        self.qparts: list[tuple[torch.Tensor, int]] = []
        self.panels: torch.Tensor | None = None
        self.packed: torch.Tensor | None = None
        self.weight: torch.Tensor | None = None
        self.int8_activations = False
        if isinstance(weight, QuantizedWeight | StackedBlocks):
            self.out_features, self.in_features = weight.out_features, weight.in_features
            self.compute_dtype = torch.float32
            if cpu_qlinear.available() and compute_dtype in (None, torch.float32):
                parts = weight.parts if isinstance(weight, StackedBlocks) else (weight,)
                self.qparts = [(cpu_qlinear.pack(p.blocks, p.fmt), p.out_features) for p in parts]
                self.int8_activations = True
                return
            weight = weight.dequantize()
        self.out_features, self.in_features = weight.shape
        self.compute_dtype = compute_dtype or weight.dtype
        weight = weight.to(self.compute_dtype)
        if weight.device.type == "cpu" and weight.dtype == torch.float32 and cpu_linear.available():
            self.panels = cpu_linear.pack(weight)
        if self.panels is not None and cpu_linear.max_rows() is None:
            return  # the panels take every input
        if _can_prepack(weight):
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())
            except RuntimeError:  # a torch build without the op's kernel
                self.packed = None
        if self.packed is None:
            self.weight = weight.contiguous()

    @property
    def weight_bytes(self) -> int:
        """The bytes of the copy of the weight a matmul reads (the first `forward` tries)."""
        if self.qparts:
            return sum(p.numel() for p, _ in self.qparts)
        kept = [t for t in (self.panels, self.packed, self.weight) if t is not None]
        return kept[0].numel() * kept[0].element_size()

    @property
    def qpanels(self) -> torch.Tensor | None:
        """The file's blocks as one panel matrix, or None (none, or parts side by side)."""
        return self.qparts[0][0] if len(self.qparts) == 1 else None

    @property
    def cpp_weight(self) -> torch.Tensor | None:
        """The weight as kernels.cpu_decode_step takes it (either kind of panels), or None."""
        return self.qpanels if self.qpanels is not None else self.panels

    @property
    def cpp_parts(self) -> list[tuple[torch.Tensor, int]] | None:
        """The weight as panel matrices side by side with their output features (one, or the
        parts of StackedBlocks), or None."""
        if self.qparts:
            return self.qparts
        return None if self.panels is None else [(self.panels, self.out_features)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype != self.compute_dtype:
            x = x.to(self.compute_dtype)
        y: torch.Tensor | None = None
        if self.qparts:
            outs = []
            for panels, n in self.qparts:
                part = cpu_qlinear.linear(x, panels, n)
                assert part is not None, "the quantized kernel takes every fp32 input"
                outs.append(part)
            y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
        if y is None and self.panels is not None:
            y = cpu_linear.linear(x, self.panels, self.out_features)
        if y is None and self.packed is not None:
            y = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), self.packed, None, "none", [], ""
            )
        if y is None:
            assert self.weight is not None, "no matmul path for this input"
            y = F.linear(x, self.weight)
        return y if y.dtype == dtype else y.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2], as Hugging Face computes them (float32)."""
    dim = config.head_dim
    base = config.rope_theta
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling_dict or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling["low_freq_factor"])
        high = float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif kind != "default":
        raise ValueError(f"unsupported rope scaling {kind!r}")
    return inv_freq


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, d] rotated by cos/sin [T, 1, d] (HF's rotate-half convention)."""
    return x * cos + rotate_half(x) * sin


@dataclass
class Rope:
    """The step's positions [T] and the cos / sin tables [P, d] they index."""

    positions: torch.Tensor
    cos_table: torch.Tensor
    sin_table: torch.Tensor

    @functools.cached_property
    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, d] of the step's positions (for the torch path)."""
        return self.cos_table[self.positions][:, None], self.sin_table[self.positions][:, None]

    def apply_(self, qkv: torch.Tensor, num_rotated: int) -> torch.Tensor:
        """Rotate heads [0, num_rotated) of qkv [T, heads, d]: in place with the fused kernel,
        else as a new tensor of those heads; returns the rotated heads."""
        if cpu_ops.rope_(qkv, num_rotated, self.positions, self.cos_table, self.sin_table):
            return qkv[:, :num_rotated]
        return apply_rope(qkv[:, :num_rotated], *self.gathered)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions, computed the way HF computes them."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor = rope_inv_freq(config)
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._cast: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}

    def _table(self, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cos.shape[0] < n or self._cos.device != device:
            size = max(n, 2 * self._cos.shape[0], 256)
            pos = torch.arange(size, device=device, dtype=torch.float32)
            freqs = pos[:, None] * self.inv_freq.to(device)[None, :]  # [size, d/2]
            emb = torch.cat((freqs, freqs), dim=-1)  # [size, d]
            self._cos, self._sin = emb.cos(), emb.sin()
            self._cast = {}
        return self._cos, self._sin

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> Rope:
        """The tables for the step's positions [T], in `dtype`."""
        cos_t, sin_t = self._table(int(positions.max()) + 1, positions.device)
        if dtype not in self._cast:
            self._cast[dtype] = (cos_t.to(dtype), sin_t.to(dtype))
        return Rope(positions, *self._cast[dtype])


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = cpu_ops.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)

    def add(self, delta: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += delta (in place), then the norm of residual."""
        fused = cpu_ops.add_rms_norm(delta, residual, self.weight, self.eps)
        if fused is not None:
            return fused
        residual.add_(delta)
        return self(residual)


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        w: Mapping[str, Weight],
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        p = f"model.layers.{layer}.self_attn."
        self.layer = layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv = Linear(
            fuse([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]]),
            matmul_dtype,
        )
        self.o = Linear(w[p + "o_proj.weight"], matmul_dtype)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: Rope,
        meta: AttentionMetadata,
        cache: PagedKV,
        backend: AttentionBackend,
        out_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]; with `out_rows`, K/V of all T tokens are written but
        only those rows attend: -> [len(out_rows.rows), hidden]."""
        T = x.shape[0]
        h, kvh, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv(x).view(T, h + 2 * kvh, d)  # [T, h + 2 kvh, d]
        qk = rope.apply_(qkv, h + kvh)  # q and k rotated together
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, h + kvh :]
        kc, vc = cache.k[self.layer], cache.v[self.layer]
        ks, vs = cache.k_scale[self.layer], cache.v_scale[self.layer]
        backend.store_kv(k, v, kc, vc, meta.slot_mapping, ks, vs)
        if out_rows is not None:
            q, meta = q[out_rows.rows], out_rows.meta
            T = q.shape[0]
        out = self._attend(q, kc, vc, ks, vs, meta, backend)  # [T, h, d]
        return self.o(out.reshape(T, h * d))

    def _attend(
        self,
        q: torch.Tensor,  # [T, h, d]: the prefill rows first, then the decode rows
        kc: torch.Tensor,
        vc: torch.Tensor,
        ks: torch.Tensor | None,
        vs: torch.Tensor | None,
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        P = meta.num_prefill_tokens
        parts = []
        if P:
            parts.append(
                backend.prefill_attention(
                    q[:P],
                    kc,
                    vc,
                    meta.prefill_block_tables,
                    meta.prefill_cu_query_lens,
                    meta.prefill_context_lens,
                    self.scale,
                    ks,
                    vs,
                )
            )
        if meta.num_decode_tokens:
            parts.append(
                backend.paged_decode_attention(
                    q[P:],
                    kc,
                    vc,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    self.scale,
                    ks,
                    vs,
                )
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MLP(nn.Module):
    def __init__(
        self,
        layer: int,
        w: Mapping[str, Weight],
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        p = f"model.layers.{layer}.mlp."
        gate_up = fuse([w[p + "gate_proj.weight"], w[p + "up_proj.weight"]])
        self.gate_up = Linear(gate_up, matmul_dtype)
        self.down = Linear(w[p + "down_proj.weight"], matmul_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        act = cpu_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down(act)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer: int,
        w: Mapping[str, Weight],
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        p = f"model.layers.{layer}."
        eps = config.rms_norm_eps
        self.input_norm = RMSNorm(expand(w[p + "input_layernorm.weight"]), eps)
        self.attn = Attention(config, layer, w, matmul_dtype)
        self.post_attn_norm = RMSNorm(expand(w[p + "post_attention_layernorm.weight"]), eps)
        self.mlp = MLP(layer, w, matmul_dtype)


class LlamaModel(nn.Module):
    """Weights are taken (not copied) from `weights` under Hugging Face names, as tensors or in
    their GGUF file's blocks (QuantizedWeight: the linear layers and the embedding; a lookup
    expands the rows it takes). `matmul_dtype` (default: the weights' dtype) is the dtype of
    every linear layer's matmul; norms, RoPE, attention, the residual stream and the KV cache
    keep the weights' dtype (the norms' dtype where the matrices are quantized)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Weight],
        matmul_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        embed = weights["model.embed_tokens.weight"]
        self.embed_blocks = embed if isinstance(embed, QuantizedWeight) else None
        self.embed: nn.Parameter | None = None
        if not isinstance(embed, QuantizedWeight):
            self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, weights, matmul_dtype) for i in range(config.num_layers)
        )
        self.norm = RMSNorm(expand(weights["model.norm.weight"]), config.rms_norm_eps)
        lm_head = weights.get("lm_head.weight")
        if config.tie_word_embeddings or lm_head is None:
            lm_head = embed
        self.lm_head = Linear(lm_head, matmul_dtype)
        self.rope = RotaryEmbedding(config)
        self.decoder_weights = self._decoder_weights()
        self.decode_in_cpp = True  # False: every step's layers from Python (profiling, tests)

    @property
    def int8_activations(self) -> bool:
        """Whether some linear layer computes on int8 activations (its K/V then differ from
        the fp32 expansion's)."""
        return any(m.int8_activations for m in self.modules() if isinstance(m, Linear))

    def _decoder_weights(self) -> tuple[list[Any], ...] | None:
        """Each layer's weights as kernels.cpu_decode_step takes them (the fused QKV and gate/up
        as lists of parts with their sizes), or None where some layer has no panels of either
        kind (or its norms are not fp32)."""
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        fused = [[x.attn.qkv.cpp_parts for x in layers], [x.mlp.gate_up.cpp_parts for x in layers]]
        single = [[x.attn.o.cpp_weight for x in layers], [x.mlp.down.cpp_weight for x in layers]]
        qkv, gate_up = [[p for p in ps if p is not None] for ps in fused]
        o, down = [[w for w in ws if w is not None] for ws in single]
        if any(len(ws) != len(layers) for ws in (qkv, gate_up, o, down)):
            return None
        posts = [x.post_attn_norm.weight.data for x in layers]
        nexts = [x.input_norm.weight.data for x in layers[1:]] + [self.norm.weight.data]
        if any(w.dtype != torch.float32 for w in posts + nexts):
            return None

        def split(parts: list[list[tuple[torch.Tensor, int]]]) -> list[list[Any]]:
            return [[[t for t, _ in p] for p in parts], [[n for _, n in p] for p in parts]]

        return (*split(qkv), o, *split(gate_up), down, posts, nexts)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] in the model's dtype."""
        if self.embed is not None:
            return F.embedding(input_ids, self.embed)
        assert self.embed_blocks is not None
        return self.embed_blocks.rows(input_ids).dequantize().to(self.dtype)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        cache: PagedKV,
        backend: AttentionBackend,
        out_rows: OutputRows | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], or only at `out_rows.rows`: the
        last layer then attends, projects and runs its MLP for those rows alone (every token's
        K/V is still written)."""
        x = self.embed_tokens(input_ids)  # the residual stream, added to in place
        rope = self.rope(positions, x.dtype)
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        h = layers[0].input_norm(x)
        if out_rows is None and self._decodes_in_cpp(x, meta, cache, backend):
            return self._decode_in_cpp(x, h, rope, meta, cache)
        for i, layer in enumerate(layers):
            last = i + 1 == len(layers)
            if last and out_rows is not None:
                a = layer.attn(h, rope, meta, cache, backend, out_rows)
                x = x[out_rows.rows]
            else:
                a = layer.attn(h, rope, meta, cache, backend)
            h = layer.post_attn_norm.add(a, x)
            h = (self.norm if last else layers[i + 1].input_norm).add(layer.mlp(h), x)
        return h

    def _decodes_in_cpp(
        self, x: torch.Tensor, meta: AttentionMetadata, cache: PagedKV, backend: AttentionBackend
    ) -> bool:
        """A pure decode step whose every kernel is the C++ one the Python path would call."""
        return (
            self.decode_in_cpp
            and self.decoder_weights is not None
            and meta.num_prefill_tokens == 0
            and backend.name == "cpu"
            and x.dtype == torch.float32
            and cpu_ops.takes_cache(cache.k[0], cache.v[0], cache.k_scale[0])
            and cpu_decode_step.applies(x.shape[0], self.config.head_dim)
        )

    def _decode_in_cpp(
        self, x: torch.Tensor, h: torch.Tensor, rope: Rope, meta: AttentionMetadata, cache: PagedKV
    ) -> torch.Tensor:
        weights = self.decoder_weights
        assert weights is not None
        c = self.config
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        return cpu_decode_step.decode_layers(
            x,
            h,
            *weights,
            cache.k,
            cache.v,
            *((cache.k_scale, cache.v_scale) if cache.k_scale[0] is not None else ([], [])),
            rope.positions,
            rope.cos_table,
            rope.sin_table,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            first.attn.scale,
            c.rms_norm_eps,
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32."""
        return self.lm_head(hidden).float()
