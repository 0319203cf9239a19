"""`kvserve generate` streams exactly the engine's greedy text to stdout."""

from __future__ import annotations

import pytest
from kvserve.services import cli
from kvserve.shared.sampling_params import SamplingParams


def test_generate_prints_greedy_text(make_engine, tokenizer, capsys) -> None:  # type: ignore[no-untyped-def]
    prompt = "Name two planets."
    ids = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    tokens = make_engine().generate([ids], SamplingParams(max_tokens=16))[0][0]
    assert cli.main(["generate", prompt, "--max-tokens", "16"]) == 0
    out = capsys.readouterr()
    assert out.out == tokenizer.decode(tokens) + "\n"
    assert "tok/s" in out.err


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--top-p", "0"], "--top-p"),
        (["--max-tokens", "0"], "--max-tokens"),
        (["--temperature", "-1"], "--temperature"),
        (["--store", "ftp://host/x"], "--store"),
        (["--store", "file://relative/dir"], "--store"),
    ],
)
def test_generate_bad_arguments_one_line(capsys, args: list[str], message: str) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["generate", "hi", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_generate_missing_model_names_fetch_command(capsys, tmp_path) -> None:  # type: ignore[no-untyped-def]
    assert cli.main(["generate", "hi", "--model", str(tmp_path / "nope.gguf")]) == 2
    err = capsys.readouterr().err
    assert "kvserve fetch-model" in err and err.count("\n") == 1


@pytest.mark.parametrize("size", [24, 1000, None])  # cut after the header, in the vocabulary; junk
def test_generate_unreadable_model_one_line(capsys, tmp_path, model_path, size) -> None:  # type: ignore[no-untyped-def]
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(model_path.read_bytes()[:size] if size else b"not a gguf file at all")
    assert cli.main(["generate", "hi", "--model", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvserve generate: error: cannot read GGUF") and err.count("\n") == 1
