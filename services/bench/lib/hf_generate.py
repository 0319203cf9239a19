"""Arm 2 of `kvserve bench engine`: Hugging Face transformers' `generate()` on the same fp32
weights, in static batches, left-padded, greedy, every row generating the batch's longest target;
only each request's own target counts as output (the rest is padding waste)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from kvserve.services.bench.lib.engine_timing import ArmResult, synchronizer
from kvserve.services.bench.workloads.batch import BenchRequest


def load_hf_model(model_path: Path, device: str = "cpu") -> Any:
    import transformers

    extra: dict[str, Any]
    if model_path.is_file():
        where, extra = str(model_path.parent), {"gguf_file": model_path.name}
    else:  # safetensors only, as kvserve's own loader: never a pickled checkpoint
        where, extra = str(model_path), {"use_safetensors": True}
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        where, dtype=torch.float32, **extra
    )
    return model.to(device).eval()


def hf_pad_token_id(model: Any) -> int:
    """The model's pad id, else its (first) EOS id; rows never stop early (min_new_tokens)."""
    gen = model.generation_config
    pad = gen.pad_token_id if gen.pad_token_id is not None else gen.eos_token_id
    if isinstance(pad, list):
        pad = pad[0] if pad else None
    return int(pad) if pad is not None else 0


def left_padded(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask [B, longest], prompts right-aligned."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def hf_generate_batch(model: Any, batch: list[BenchRequest], pad_id: int) -> int:
    """Greedy generation of the batch's longest target for every row, on the model's device;
    returns tokens made."""
    ids, mask = left_padded([r.prompt for r in batch], pad_id)
    ids, mask = ids.to(model.device), mask.to(model.device)
    n = max(r.output_len for r in batch)
    exactly_n = {"max_new_tokens": n, "min_new_tokens": n}
    out = model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, pad_token_id=pad_id, **exactly_n
    )
    return int(out.shape[0] * (out.shape[1] - ids.shape[1]))


def run_hf(
    model_path: Path, requests: list[BenchRequest], batch_size: int, device: str = "cpu"
) -> ArmResult:
    """The model and its inputs on `device`; on CUDA the clock stops after a synchronize."""
    model = load_hf_model(model_path, device)
    pad_id = hf_pad_token_id(model)
    sync = synchronizer(device)
    hf_generate_batch(model, [BenchRequest(requests[0].prompt[:8], 2)], pad_id)  # warm-up
    sync()
    generated = 0
    t0 = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        generated += hf_generate_batch(model, requests[start : start + batch_size], pad_id)
    sync()
    wall = time.perf_counter() - t0
    return ArmResult("hf", wall, sum(r.output_len for r in requests), generated)
