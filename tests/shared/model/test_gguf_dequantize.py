"""The loader's own Q4_1 / Q8_0 dequantization is bit-identical to gguf's, for every tensor of the
default model (and other types still go through gguf)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
from kvserve.shared.model.gguf_file import open_gguf
from kvserve.shared.model.quantized import dequantize


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
