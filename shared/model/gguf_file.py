"""Reading GGUF metadata (no torch): one parse per file, the model config it describes."""

from __future__ import annotations

import functools
from typing import Any

from kvserve.shared.config import ModelConfig


class GGUFReadError(ValueError):
    """A file that gguf cannot parse (not GGUF, truncated): a user error, one line."""


@functools.lru_cache(maxsize=2)
def open_gguf(path: str) -> Any:
    """One parsed GGUF file per path (weights and tokenizer both need it). Long only for the
    reader subclass inside it, defined here because gguf is imported when a file is read."""
    import gguf
    import numpy as np

    class Reader(gguf.GGUFReader):
        """gguf's reader with two shortcuts that build the same fields (tested part for part):
        its memory map viewed as a plain ndarray (it slices the file once per metadata value,
        ~250,000 times for a 49k-token vocabulary, and a np.memmap slice costs several times a
        plain one), and arrays of strings or scalars walked in one loop of plain slices instead
        of a recursive call and a fresh view per element (docs/benchmarks.md, model load)."""

        @property
        def data(self) -> Any:
            return self._data

        @data.setter
        def data(self, mapped: Any) -> None:
            self._data = mapped.view(np.ndarray)

        def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
            kind = gguf.GGUFValueType
            if kind(raw_type) != kind.ARRAY:
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, count = kind(int(raw_itype[0])), int(alen[0])
            offs = orig_offs + 12
            parts = [raw_itype, alen]
            if itype == kind.STRING:
                length = np.dtype(np.uint64).newbyteorder(self.byte_order)
                for _ in range(count):
                    slen = self._data[offs : offs + 8].view(length)
                    end = offs + 8 + int(slen[0])
                    parts += (slen, self._data[offs + 8 : end])
                    offs = end
                idxs = list(range(3, 2 + 2 * count, 2))
            elif (scalar := self.gguf_scalar_to_np.get(itype)) is not None:
                dtype = np.dtype(scalar).newbyteorder(self.byte_order)
                values = self._data[offs : offs + count * dtype.itemsize].view(dtype)
                parts += (values[i : i + 1] for i in range(count))
                idxs = list(range(2, 2 + count))
                offs += count * dtype.itemsize
            else:  # arrays of arrays
                return super()._get_field_parts(orig_offs, raw_type)
            return offs - orig_offs, parts, idxs, [kind.ARRAY, itype] if count else [kind.ARRAY]

    try:
        return Reader(path)
    except (ValueError, KeyError, TypeError, IndexError) as e:  # IndexError: truncated
        raise GGUFReadError(f"cannot read GGUF {path}: {e}") from e


def gguf_field(reader: Any, key: str) -> Any:
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def gguf_model_config(reader: Any) -> ModelConfig:
    arch = gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r} (only llama)")
    num_heads = int(gguf_field(reader, "llama.attention.head_count"))
    hidden = int(gguf_field(reader, "llama.embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = gguf_field(reader, "llama.vocab_size") or len(
        reader.fields["tokenizer.ggml.tokens"].data
    )
    scaling_type = gguf_field(reader, "llama.rope.scaling.type")
    scaling = None
    if scaling_type and scaling_type != "none":
        factor = gguf_field(reader, "llama.rope.scaling.factor")
        scaling = (("factor", float(factor)), ("rope_type", str(scaling_type)))
    eos = gguf_field(reader, "tokenizer.ggml.eos_token_id")
    bos = gguf_field(reader, "tokenizer.ggml.bos_token_id")
    return ModelConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(gguf_field(reader, "llama.feed_forward_length")),
        num_layers=int(gguf_field(reader, "llama.block_count")),
        num_heads=num_heads,
        num_kv_heads=int(gguf_field(reader, "llama.attention.head_count_kv") or num_heads),
        head_dim=int(gguf_field(reader, "llama.rope.dimension_count") or hidden // num_heads),
        rope_theta=float(gguf_field(reader, "llama.rope.freq_base") or 10000.0),
        rope_scaling=scaling,
        rms_norm_eps=float(gguf_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(gguf_field(reader, "llama.context_length") or 2048),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
    )
