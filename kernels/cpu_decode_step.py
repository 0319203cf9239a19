"""The decoder layers of a pure decode step in one C++ call, for the CPU.

A batch-1 decode step runs ~10 kernels per layer, each a few microseconds of work, and the
Python between them (module calls, views, argument checks) costs about as much as the kernels
themselves, where the step's floor is reading the weights once. This calls the same kernels
(cpu_linear, cpu_ops, cpu_decode_attention), with the same arguments, in the same order as
`LlamaModel.forward` does from Python, so its results are bit-identical to that path (tested),
and a sequence's tokens do not depend on which path a step took. Only pure decode steps come
here: a step with prompt chunks has enough work per call that Python does not matter. This is
what CUDA graphs do for a GPU server; torch.compile would break its graph at every C++ call."""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from kvserve.kernels import cpp_build, cpu_decode_attention, cpu_linear


def _extension() -> Any | None:
    return cpp_build.extension()


def applies(rows: int, head_dim: int) -> bool:
    """Whether a decode step of `rows` tokens can run here (the kernels are built, and every
    one of them takes these shapes)."""
    limit = cpu_linear.max_rows()
    return (
        _extension() is not None
        and head_dim in cpu_decode_attention.HEAD_DIMS
        and (limit is None or rows <= limit)
    )


def decoder_weights(*weights: Any) -> Any | None:
    """The layers' weights as one C++ object (DecoderWeights in the C++ source), converted once
    for every step's call; None where the kernels are not built."""
    ext = _extension()
    return None if ext is None else ext.DecoderWeights(*weights)


def decode_layers(x: torch.Tensor, h: torch.Tensor, weights: Any, *args: Any) -> torch.Tensor:
    """See the C++ source for the arguments (`weights`: `decoder_weights`'); `applies` must
    hold."""
    ext = _extension()
    assert ext is not None
    out: torch.Tensor = ext.decode_layers(x, h, weights, *args)
    return out


def decode_model(*bound: Any) -> Any | None:
    """A model's whole decode step bound once, for `decode_tokens` (DecodeModel in the C++
    source, which lists its parts: the embedding, the first input norm, the LM head, the
    layers' `decoder_weights`, the KV cache's tensors and the shapes); None where the kernels
    are not built."""
    ext = _extension()
    return None if ext is None else ext.DecodeModel(*bound)


def decode_tokens(
    model: Any, ids: list[int], *step: Any
) -> tuple[torch.Tensor, list[int], list[float]]:
    """A whole decode step in one call, from the rows' token ids to their logits, and with
    `argmax` (the last argument) each row's argmax and its logprob: `decode_layers` between
    the embedding and the LM head (`model`: `decode_model`'s). See the C++ source for the
    step's arguments; `applies` must hold."""
    ext = _extension()
    assert ext is not None
    logits, tokens, logprobs = ext.decode_tokens(model, ids, *step)
    return logits, tokens, logprobs


class LayerSeconds(NamedTuple):
    """Seconds decode_layers spent in the layers' linear projections, attention and the rest
    (RoPE, KV writes, norms, activations)."""

    linear: float
    attention: float
    other: float


class StepSeconds(NamedTuple):
    """The layers' seconds, and those of decode_tokens' LM head matmul."""

    layers: LayerSeconds
    lm_head: float


def timing(on: bool) -> StepSeconds | None:
    """The decode_layers and decode_tokens seconds summed since the last call (then zeroed),
    and timing turned on or off from now (off by default: no clock is read). None where the
    kernels are not built. For measurements (`kvserve bench engine`): one engine's steps at a
    time."""
    ext = _extension()
    if ext is None:
        return None
    linear, attention, other, lm_head = ext.decode_timing(on)
    return StepSeconds(LayerSeconds(linear, attention, other), lm_head)
