"""`kvserve bench kvquant`: quality and capacity of the quantized KV cache (int8, fp8 e4m3 with
per-(token, head) scales) against the model's own dtype, on the default model.

- Text: the first --text-tokens (default 2,048) tokens of the help topics that ship with Python
  (`pydoc_data.topics`), scored in one pass with each cache dtype: perplexity, its relative
  delta, and the mean KL divergence KL(P_ref || P_quant) of the next-token distributions.
- Greedy agreement: 8 chat prompts, 256 greedy tokens generated with the unquantized cache; each
  quantized cache scores prompt + those tokens (teacher forcing) and we count the positions
  where its argmax equals the reference token. Also the length of the identical free-running
  greedy prefix.
- Capacity: KV bytes per token and tokens that fit in --budget for each dtype.
`--compare weights` measures the same for the linear layers on the GGUF file's own blocks
(`--weights file`: 4-bit blocks on int8 activations) against their fp32 expansion, both with
the fp32 KV cache. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import torch
from kvserve.services.bench.lib.flags import add_model
from kvserve.services.bench.lib.quality import agreement, text_metrics
from kvserve.services.bench.workloads.text import PROMPTS, chat_prompts, reference_text
from kvserve.services.cli_support import CliError
from kvserve.shared.config import CacheConfig, EngineConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.cache import kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.model.loader import load_weights
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

DTYPES = ("int8", "fp8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model(p)
    p.add_argument("--text-tokens", type=int, default=2048)
    p.add_argument("--gen-tokens", type=int, default=256)
    p.add_argument("--num-prompts", type=int, default=len(PROMPTS))
    p.add_argument("--budget", default="2GiB", help="memory budget for the capacity figures")
    p.add_argument(
        "--compare",
        choices=("kv", "weights"),
        default="kv",
        help="the quantized KV cache (kv) or the file's quantized weights (weights) against fp32",
    )


def parse_budget(text: str) -> int:
    from kvserve.shared.capacity import parse_size

    try:
        return int(parse_size(text))
    except ValueError as e:
        raise CliError(f"--budget: {e}") from e


def _engines(args: argparse.Namespace, weights: Any, tok: KVTokenizer) -> Callable[..., Engine]:
    """engine(kv_dtype, weights mode): fp32 weights on the loaded copy, else the file's blocks."""

    def engine(kv: str, mode: str = "fp32") -> Engine:
        cache = CacheConfig(kv_dtype=kv, num_blocks=1024)
        cfg = EngineConfig(model_path=args.model, weights=mode, cache=cache)
        if mode == "fp32":
            return Engine(cfg, tokenizer=tok, weights=weights)
        return Engine(cfg, tokenizer=tok)  # loads the file's blocks

    return engine


class Reference:
    """The unquantized engine's logits over the text and its greedy tokens for the prompts."""

    def __init__(self, base: Engine, ids: list[int], prompts: list[list[int]], n: int) -> None:
        self.ids, self.prompts = ids, prompts
        self.logits = base.score(ids)
        params = SamplingParams(max_tokens=n, ignore_eos=True)
        self.refs = [c[0] for c in base.generate(prompts, params)]

    def against(self, e: Engine) -> tuple[dict[str, float], dict[str, float]]:
        """`e`'s text metrics and greedy agreement against the reference."""
        m = text_metrics(self.logits, e.score(self.ids), self.ids)
        return m, agreement(e, self.prompts, self.refs)


def run(args: argparse.Namespace) -> int:
    for name in ("text_tokens", "gen_tokens", "num_prompts"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    budget = parse_budget(args.budget)
    weights = load_weights(args.model)
    tok = KVTokenizer.from_path(args.model)
    engine = _engines(args, weights, tok)
    prompts = chat_prompts(tok, args.num_prompts)
    ref = Reference(engine("auto"), reference_text(tok, args.text_tokens), prompts, args.gen_tokens)
    summary: dict[str, Any] = {
        "text_tokens": len(ref.ids),
        "gen_tokens": args.gen_tokens,
        "num_prompts": len(prompts),
        **_sizes(weights.config, budget),
        "budget_bytes": budget,
    }
    if args.compare == "weights":
        summary |= _file_weights(*ref.against(engine("auto", "file")), args.gen_tokens)
    else:
        for kv in DTYPES:
            summary |= _quality(kv, *ref.against(engine(kv)), summary, args.gen_tokens)
        for name, n in summary["tokens_in_budget"].items():
            size = summary["bytes_per_token"][name]
            print(f"{name}: {size} B/token, {n} tokens in {args.budget}")
    print(json.dumps(summary))
    return 0


def _file_weights(m: dict[str, float], a: dict[str, float], gen_tokens: int) -> dict[str, float]:
    """The file's quantized weights against their fp32 expansion, as summary entries."""
    print(
        f"file weights: perplexity {m['ppl']:.4f} vs {m['ppl_ref']:.4f} "
        f"({m['ppl_delta']:+.3%}), KLD {m['kld']:.5f}, greedy agreement {a['agree']:.2%} "
        f"(teacher-forced), identical free-running prefix "
        f"{a['free_prefix_mean']:.0f}/{gen_tokens}"
    )
    return {
        "kld_file": m["kld"],
        "ppl_delta_file": m["ppl_delta"],
        "ppl_file": m["ppl"],
        "ppl_fp32": m["ppl_ref"],
        "agree_file": a["agree"],
        "free_prefix_file": a["free_prefix_mean"],
    }


def _sizes(config: Any, budget: int) -> dict[str, dict[str, int]]:
    """Bytes per token of the KV cache in fp32 and each quantized dtype, and how many tokens
    fit in `budget` bytes."""
    out: dict[str, dict[str, int]] = {"bytes_per_token": {}, "tokens_in_budget": {}}
    for kv in ("auto", *DTYPES):
        name = "fp32" if kv == "auto" else kv
        bpt = kv_bytes_per_token(config, resolve_kv_dtype(kv, torch.float32))
        out["bytes_per_token"][name] = bpt
        out["tokens_in_budget"][name] = budget // bpt
    return out


def _quality(
    kv: str, m: dict[str, float], a: dict[str, float], summary: dict[str, Any], gen_tokens: int
) -> dict[str, float]:
    """One KV dtype's quality against fp32 (text metrics `m`, greedy agreement `a`) as summary
    entries, printed as a line."""
    size = summary["bytes_per_token"]
    print(
        f"{kv}: {size[kv]} B/token ({size[kv] / size['fp32']:.3f}x fp32), "
        f"perplexity {m['ppl']:.4f} vs {m['ppl_ref']:.4f} ({m['ppl_delta']:+.3%}), "
        f"KLD {m['kld']:.5f}, greedy agreement {a['agree']:.2%} (teacher-forced), "
        f"identical free-running prefix {a['free_prefix_mean']:.0f}/{gen_tokens}"
    )
    return {
        f"kld_{kv}": m["kld"],
        f"ppl_delta_{kv}": m["ppl_delta"],
        f"ppl_{kv}": m["ppl"],
        f"agree_{kv}": a["agree"],
        f"free_prefix_{kv}": a["free_prefix_mean"],
        "ppl_fp32": m["ppl_ref"],
    }
