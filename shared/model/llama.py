"""A Llama-family decoder in plain PyTorch, reading and writing the paged KV cache.

RMSNorm, SwiGLU MLP, attention with any number of KV heads (MHA, GQA, MQA), tied or untied LM
head; RoPE in `rope`, the linear layers in `linear`. Q/K/V and gate/up projections are fused
into one matmul each. The forward pass is token-flat: [T] tokens of many sequences at once.
A pure decode step runs its layers as one C++ call where the backend offers it
(`AttentionBackend.cpp_decode_step`) and the kernels take the step.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from kvserve.kernels import cpu_decode_step, cpu_ops
from kvserve.kernels.backend import AttentionBackend
from kvserve.shared.config import ModelConfig
from kvserve.shared.model.attention import AttentionMetadata, OutputRows, PagedKV
from kvserve.shared.model.linear import Linear, gather_on_huge_pages
from kvserve.shared.model.quantized import BlockRows, QuantizedWeight, Weight, expand, fuse
from kvserve.shared.model.rope import Rope, RotaryEmbedding
from torch import nn


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


@dataclass(frozen=True)
class LayerWeights:
    """Decoder layer `layer`'s weights, looked up under their Hugging Face names
    (`model.layers.{layer}.{name}.weight`) in `weights` (taken, not copied), and the dtype of
    its matmuls."""

    weights: Mapping[str, Weight]
    layer: int
    matmul_dtype: torch.dtype | None = None

    def __getitem__(self, name: str) -> Weight:
        return self.weights[f"model.layers.{self.layer}.{name}.weight"]

    def linear(self, *names: str) -> Linear:
        """The linear layer of one weight, or of several stacked along the output rows (one
        fused matmul)."""
        parts = [self[name] for name in names]
        return Linear(parts[0] if len(parts) == 1 else fuse(parts), self.matmul_dtype)

    def norm(self, name: str, eps: float) -> RMSNorm:
        return RMSNorm(expand(self[name]), eps)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, w: LayerWeights) -> None:
        super().__init__()
        self.layer = w.layer
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.qkv = w.linear("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")
        self.o = w.linear("self_attn.o_proj")

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
        scales = cache.k_scale[self.layer], cache.v_scale[self.layer]
        backend.store_kv(k, v, kc, vc, meta.slot_mapping, *scales)
        if out_rows is not None:
            q, meta = q[out_rows.rows], out_rows.meta
        out = self._attend(q, kc, vc, scales, meta, backend)  # [rows, h, d]
        return self.o(out.reshape(q.shape[0], h * d))

    def _attend(
        self,
        q: torch.Tensor,  # [T, h, d]: the prefill rows first, then the decode rows
        kc: torch.Tensor,
        vc: torch.Tensor,
        scales: tuple[torch.Tensor | None, torch.Tensor | None],
        meta: AttentionMetadata,
        backend: AttentionBackend,
    ) -> torch.Tensor:
        P = meta.num_prefill_tokens
        parts = []
        if P:
            prefill = (
                meta.prefill_block_tables,
                meta.prefill_cu_query_lens,
                meta.prefill_context_lens,
                self.scale,
                *scales,
            )
            longest = meta.prefill_max_query_len  # sizes the launch with no device read
            parts.append(backend.prefill_attention(q[:P], kc, vc, *prefill, max_query_len=longest))
        if meta.num_decode_tokens:
            decode = meta.decode_block_tables, meta.decode_context_lens
            parts.append(
                backend.paged_decode_attention(q[P:], kc, vc, *decode, self.scale, *scales)
            )
        return parts[0] if len(parts) == 1 else torch.cat(parts)


class MLP(nn.Module):
    def __init__(self, w: LayerWeights) -> None:
        super().__init__()
        self.gate_up = w.linear("mlp.gate_proj", "mlp.up_proj")
        self.down = w.linear("mlp.down_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(x)
        act = cpu_ops.silu_mul(gate_up)
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down(act)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, w: LayerWeights) -> None:
        super().__init__()
        self.input_norm = w.norm("input_layernorm", config.rms_norm_eps)
        self.attn = Attention(config, w)
        self.post_attn_norm = w.norm("post_attention_layernorm", config.rms_norm_eps)
        self.mlp = MLP(w)


class WholeStep(NamedTuple):
    """A step of single-token decodes as LlamaModel.decode_tokens takes it: the model's
    decode_model object and the step's tensors (positions, RoPE tables, slots, block tables,
    context lengths)."""

    model: Any
    tensors: tuple[torch.Tensor, ...]


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
        self.embed_blocks = BlockRows(embed) if isinstance(embed, QuantizedWeight) else None
        self.embed: nn.Parameter | None = None
        if not isinstance(embed, QuantizedWeight):
            self.embed = nn.Parameter(embed, requires_grad=False)
        self.layers = nn.ModuleList(
            DecoderLayer(config, LayerWeights(weights, i, matmul_dtype))
            for i in range(config.num_layers)
        )
        self.norm = RMSNorm(expand(weights["model.norm.weight"]), config.rms_norm_eps)
        lm_head = weights.get("lm_head.weight")
        if config.tie_word_embeddings or lm_head is None:
            lm_head = embed
        self.lm_head = Linear(lm_head, matmul_dtype)
        self.rope = RotaryEmbedding(config)
        gather_on_huge_pages([*self.linears(), self.lm_head])
        self.decoder_weights = self._decoder_weights()
        self.token_weights = self._token_weights()
        self._bound: tuple[PagedKV, Any] | None = None  # (the cache, its decode_model object)
        self.decode_in_cpp = True  # False: every step's layers from Python (profiling, tests)

    def replica(self) -> LlamaModel:
        """A model over the same weights, with state of its own: the cache its C++ step is
        bound to, `decode_in_cpp`, the RoPE tables. The layers are this model's (read-only in a
        forward pass); an attribute or submodule set on the replica leaves this model's alone."""
        twin = copy.copy(self)
        for name, value in vars(self).items():
            if isinstance(value, dict):  # nn.Module's modules, parameters, buffers and hooks
                twin.__dict__[name] = type(value)(value)
        twin.rope = RotaryEmbedding(self.config)
        twin._bound = None
        twin.decode_in_cpp = True
        return twin

    @property
    def int8_activations(self) -> bool:
        """Whether some linear layer computes on int8 activations (its K/V then differ from
        the fp32 expansion's)."""
        return any(m.int8_activations for m in self.modules() if isinstance(m, Linear))

    def linears(self) -> list[Linear]:
        """The layers' linear layers in the order a forward pass runs them."""
        return [
            linear
            for layer in self.layers
            if isinstance(layer, DecoderLayer)
            for linear in (layer.attn.qkv, layer.attn.o, layer.mlp.gate_up, layer.mlp.down)
        ]

    def _decoder_weights(self) -> Any | None:
        """Each layer's weights as kernels.cpu_decode_step takes them (the fused QKV and gate/up
        as lists of parts with their sizes, in one object), or None where some layer has no
        panels of either kind (or its norms are not fp32, or the kernels are not built)."""
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

        return cpu_decode_step.decoder_weights(*split(qkv), o, *split(gate_up), down, posts, nexts)

    def _token_weights(self) -> tuple[Any, ...] | None:
        """The embedding (an fp32 table, or the file's Q8_0 / Q4_1 rows as quants, scales and
        mins), the first input norm and the LM head (its panels, its rows) as
        kernels.cpu_decode_step's `decode_model` takes them, or None where it cannot take one
        of them (or the layers)."""
        first = self.layers[0]
        head = self.lm_head.cpp_weight
        if self.decoder_weights is None or head is None or not isinstance(first, DecoderLayer):
            return None
        norm = first.input_norm.weight.data
        embed: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]
        if self.embed is not None and self.embed.dtype == torch.float32:
            embed = (self.embed.data, None, None)
        elif self.embed_blocks is not None and self.embed_blocks.weight is None:
            embed = (self.embed_blocks.q, self.embed_blocks.d, self.embed_blocks.m)
        else:
            return None
        if norm.dtype != torch.float32:
            return None
        return (*embed, norm, head, self.lm_head.out_features)

    def _decode_model(self, cache: PagedKV) -> Any:
        """decode_model's object for `cache` (made once for the cache the steps use)."""
        if self._bound is None or self._bound[0] is not cache:
            assert self.token_weights is not None
            bound = cpu_decode_step.decode_model(
                *self.token_weights, self.decoder_weights, *_cache_args(cache), *self._shapes()
            )
            self._bound = (cache, bound)
        return self._bound[1]

    def _shapes(self) -> tuple[int, int, int, int, float, float]:
        """The model's shapes as the C++ decode step takes them: heads, KV heads, head size,
        MLP width, attention scale, norm epsilon."""
        c = self.config
        first = self.layers[0]
        assert isinstance(first, DecoderLayer)
        return (
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.intermediate_size,
            first.attn.scale,
            c.rms_norm_eps,
        )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> [T, hidden] in the model's dtype."""
        if self.embed is not None:
            return F.embedding(input_ids, self.embed)
        assert self.embed_blocks is not None
        return self.embed_blocks.lookup(input_ids).to(self.dtype)

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
        launched: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm, [T, hidden], or only at `out_rows.rows`: the
        last layer then attends, projects and runs its MLP for those rows alone (every token's
        K/V is still written). `launched` is called as the layers begin, after the Python
        before them: work it hands another thread then finds the GIL free while the layers'
        kernels run, instead of taking it from the embedding's and the norm's small ops."""
        x = self.embed_tokens(input_ids)  # the residual stream, added to in place
        rope = self.rope(positions, x.dtype, meta.max_seq_len)
        layers = [layer for layer in self.layers if isinstance(layer, DecoderLayer)]
        h = layers[0].input_norm(x)
        in_cpp = out_rows is None and self._decodes_in_cpp(
            x.shape[0], x.dtype, meta, cache, backend
        )
        if launched is not None:
            launched()
        if in_cpp:
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
        self,
        rows: int,
        dtype: torch.dtype,
        meta: AttentionMetadata,
        cache: PagedKV,
        backend: AttentionBackend,
    ) -> bool:
        """A pure decode step of `rows` rows whose every kernel is the C++ one the Python path
        would call."""
        return (
            self.decode_in_cpp
            and self.decoder_weights is not None
            and meta.num_prefill_tokens == 0
            and backend.cpp_decode_step
            and dtype == torch.float32
            and cpu_ops.takes_cache(cache.k[0], cache.v[0], cache.k_scale[0])
            and cpu_decode_step.applies(rows, self.config.head_dim)
        )

    def _decode_in_cpp(
        self, x: torch.Tensor, h: torch.Tensor, rope: Rope, meta: AttentionMetadata, cache: PagedKV
    ) -> torch.Tensor:
        weights = self.decoder_weights
        assert weights is not None
        return cpu_decode_step.decode_layers(
            x,
            h,
            weights,
            *_cache_args(cache),
            rope.positions,
            rope.cos_table,
            rope.sin_table,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
            *self._shapes(),
        )

    def whole_step(
        self,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        cache: PagedKV,
        backend: AttentionBackend,
    ) -> WholeStep | None:
        """What `decode_tokens` needs for a step of single-token decodes at `positions` but
        their tokens, or None where the one C++ call cannot run it (the caller runs forward
        instead)."""
        if self.token_weights is None or not self._decodes_in_cpp(
            positions.shape[0], self.dtype, meta, cache, backend
        ):
            return None
        rope = self.rope(positions, torch.float32, meta.max_seq_len)
        step = (rope.positions, rope.cos_table, rope.sin_table, meta.slot_mapping)
        tables = (meta.decode_block_tables, meta.decode_context_lens)
        return WholeStep(self._decode_model(cache), (*step, *tables))

    def decode_tokens(
        self,
        tokens: list[int],
        step: WholeStep,
        launched: Callable[[], None] | None = None,
        head_threads: int | None = None,
        argmax: bool = False,
    ) -> tuple[torch.Tensor, list[int], list[float]]:
        """A step of single-token decodes `tokens` (`step`: `whole_step`'s) as one C++ call,
        from the ids to the logits [B, vocab] (forward's, then compute_logits' bits; the LM
        head on `head_threads`), with `argmax` each row's argmax and its logprob as well (the
        sampler's greedy draw), else two empty lists. `launched` is called just before the
        call."""
        if launched is not None:
            launched()
        return cpu_decode_step.decode_tokens(
            step.model, tokens, *step.tensors, head_threads or 0, argmax
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] in float32."""
        return self.lm_head(hidden).float()


def _cache_args(cache: PagedKV) -> tuple[list[Any], list[Any], list[Any], list[Any]]:
    """The KV cache as the C++ decode step takes it: every layer's K and V, and their scales
    (empty lists for an fp32 cache)."""
    if cache.k_scale[0] is None:
        return cache.k, cache.v, [], []
    return cache.k, cache.v, cache.k_scale, cache.v_scale
