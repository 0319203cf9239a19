from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_gguf_model(model_path: Path):  # type: ignore[no-untyped-def]
    """Hugging Face transformers' own loading of the default GGUF, fp32 (the reference)."""
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
    )
    return model.eval()
