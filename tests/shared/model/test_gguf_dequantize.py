"""The loader's own Q4_1 / Q8_0 dequantization is bit-identical to gguf's, for every tensor of the
default model (and other types still go through gguf)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import torch
from kvserve.shared.model.gguf_file import open_gguf
from kvserve.shared.model.quantized import BlockRows, QuantizedWeight, dequantize


def test_every_tensor_of_the_default_model_matches_gguf_bit_for_bit(model_path: Path) -> None:
    reader = open_gguf(str(model_path))
    types: Counter[str] = Counter()
    for t in reader.tensors:
        raw = np.asarray(t.data)
        want = gguf.quants.dequantize(raw, t.tensor_type).astype(np.float32)
        got = dequantize(raw, t.tensor_type)
        assert got.dtype == np.float32 and got.shape == want.shape, t.name
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), t.name
        assert got.flags.writeable, t.name  # a copy, never a view of the file
        types[t.tensor_type.name] += 1
    assert types["Q4_1"] > 100 and types["Q8_0"] >= 1 and types["F32"] > 0  # every path ran


def test_block_rows_lookups_are_the_dequantized_rows_bit_for_bit(model_path: Path) -> None:
    """An embedding lookup in blocks split once (BlockRows) gives the bytes of dequantizing the
    rows looked up, for the default model's Q4_1 and Q8_0 weights."""
    reader = open_gguf(str(model_path))
    seen: set[str] = set()
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind not in ("q4_1", "q8_0") or kind in seen or len(t.data.shape) != 2:
            continue
        seen.add(kind)
        weight = QuantizedWeight(kind, torch.from_numpy(np.array(t.data)))
        rows = BlockRows(weight)
        index = torch.tensor([0, weight.out_features - 1, 3, 3, weight.out_features // 2])
        got, want = rows.lookup(index), weight.rows(index).dequantize()
        assert got.dtype == torch.float32 and got.shape == want.shape, t.name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), t.name
        assert rows.weight is None  # split, not looked up through `dequantize`
    assert {"q4_1", "q8_0"} <= seen
