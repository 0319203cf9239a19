"""open_gguf's reader builds exactly the fields gguf's own reader builds (its array shortcut
included): every part's dtype, shape and bytes, every data index, type and value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
from kvserve.shared.model.gguf_file import open_gguf


def assert_same_fields(ours: Any, theirs: Any) -> None:
    assert list(ours.fields) == list(theirs.fields)
    for key, want in theirs.fields.items():
        got = ours.fields[key]
        assert (got.offset, got.name, got.data, got.types) == (
            want.offset,
            want.name,
            want.data,
            want.types,
        ), key
        assert len(got.parts) == len(want.parts), key
        for a, b in zip(got.parts, want.parts, strict=True):
            assert (a.dtype, a.shape, a.tobytes()) == (b.dtype, b.shape, b.tobytes()), key
        assert got.contents() == want.contents(), key
    assert [(t.name, t.data_offset) for t in ours.tensors] == [
        (t.name, t.data_offset) for t in theirs.tensors
    ]


def test_the_default_model_parses_as_gguf_parses_it(model_path: Path) -> None:
    assert_same_fields(open_gguf(str(model_path)), gguf.GGUFReader(model_path))


def test_arrays_of_every_kind(tmp_path: Path) -> None:
    path = tmp_path / "arrays.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("t.strings", ["", "a", "héllo wörld", "x" * 300])
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False, True])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_string("t.string", "plain")
    writer.add_uint32("t.scalar", 7)
    writer.add_tensor("w", np.arange(6, dtype=np.float32).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours = open_gguf(str(path))
    assert ours.fields["t.strings"].contents() == ["", "a", "héllo wörld", "x" * 300]
    assert ours.fields["t.bools"].contents() == [True, False, True]
    assert_same_fields(ours, gguf.GGUFReader(path))
