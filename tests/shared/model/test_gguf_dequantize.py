"""The loader's own Q4_1 / Q8_0 dequantization is bit-identical to gguf's, for every tensor of the
default model (and other types still go through gguf)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from kvserve.kernels import cpu_ops
from kvserve.shared.model.gguf_file import open_gguf
from kvserve.shared.model.quantized import BlockRows, QuantizedWeight, dequantize

SEED = torch.Generator().manual_seed(0)


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


@pytest.mark.parametrize("path", ["cpp", "torch"])
def test_block_rows_lookups_are_the_dequantized_rows_bit_for_bit(
    model_path: Path, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding lookup in blocks split once (BlockRows) gives the bytes of dequantizing the
    rows looked up, for the default model's Q4_1 and Q8_0 weights: in the one C++ call and in
    the torch ops that stand in where the kernels are not built."""
    calls = []
    if path == "torch":
        monkeypatch.setattr(cpu_ops, "embed_rows", lambda *args: calls.append(args))
    elif not cpu_ops.available():
        pytest.skip("no C++ toolchain")
    reader = open_gguf(str(model_path))
    seen: set[str] = set()
    for t in reader.tensors:
        kind = t.tensor_type.name.lower()
        if kind not in ("q4_1", "q8_0") or kind in seen or len(t.data.shape) != 2:
            continue
        seen.add(kind)
        weight = QuantizedWeight(kind, torch.from_numpy(np.array(t.data)))
        rows = BlockRows(weight)
        n = weight.out_features
        picked = [0, n - 1, 3, 3, n // 2, *torch.randint(0, n, (59,), generator=SEED).tolist()]
        index = torch.tensor(picked)
        got, want = rows.lookup(index), weight.rows(index).dequantize()
        assert got.dtype == torch.float32 and got.shape == want.shape, t.name
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), t.name
        assert rows.weight is None  # split, not looked up through `dequantize`
        if path == "cpp":
            with pytest.raises(RuntimeError, match="out of range"):
                rows.lookup(torch.tensor([1, n]))
    assert {"q4_1", "q8_0"} <= seen
    assert len(calls) == (2 if path == "torch" else 0)  # the stand-in was asked, and declined
