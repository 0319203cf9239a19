"""Cost profiles for the simulator's tests: `profile_dict()` is a complete, valid profile (a
small model's KV geometry, round figures), `write_profile(path, **sections)` writes one with
sections or fields replaced."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

BASE: dict[str, Any] = {
    "version": 1,
    "name": "test",
    "source": "measured",
    "machine": "test machine",
    "reference": "round figures for tests",
    "model": {
        "name": "tiny",
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 8,
        "kv_dtype": "float32",
        "max_model_len": 4096,
    },
    "engine": {
        "num_blocks": 256,
        "block_size": 16,
        "host_tier_blocks": 64,
        "max_num_seqs": 16,
        "max_num_batched_tokens": 256,
        "max_prefill_chunk": 256,
    },
    "step": {
        "base_s": 0.004,
        "per_token_s": 0.0002,
        "per_prefill_pair_s": 1e-7,
        "per_decode_context_s": 1e-6,
        "per_sampled_row_s": 0.0003,
        "mixed_step_s": 0.002,
    },
    "store": {
        "rtt_s": 0.001,
        "load_s_per_block": 0.002,
        "write_s_per_block": 0.001,
        "frame_bytes_per_token": 200.0,
    },
}


def profile_dict(**sections: dict[str, Any]) -> dict[str, Any]:
    """BASE with the named sections' fields replaced (`step={"base_s": 0.01}`)."""
    out = copy.deepcopy(BASE)
    for name, fields in sections.items():
        out[name].update(fields)
    return out


def write_profile(path: Path, **sections: dict[str, Any]) -> Path:
    path.write_text(json.dumps(profile_dict(**sections)))
    return path
