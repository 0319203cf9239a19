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
from typing import Any

import torch
from kvserve.services.cli_support import CliError
from kvserve.shared.config import CacheConfig, EngineConfig, default_model_path
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.kv.cache import kv_bytes_per_token, resolve_kv_dtype
from kvserve.shared.model.loader import load_weights
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

PROMPTS = [
    "Explain how a hash table works.",
    "Write a short story about a lighthouse keeper.",
    "What are the causes of the French Revolution?",
    "Describe the water cycle for a ten-year-old.",
    "Give three tips for learning a new programming language.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet.",
    "How do vaccines train the immune system?",
]
DTYPES = ("int8", "fp8")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=str(default_model_path()))
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


def reference_text(tokenizer: KVTokenizer, n: int) -> list[int]:
    """At least n tokens of English prose from Python's own help topics (not in the repo)."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for key in sorted(topics):
        ids += tokenizer.encode(topics[key])
        if len(ids) >= n:
            return ids[:n]
    raise RuntimeError(f"pydoc topics hold fewer than {n} tokens")


def text_metrics(ref: torch.Tensor, quant: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """ref/quant logits [T, V] over `ids`: perplexities and mean KLD of next-token dists."""
    target = torch.tensor(ids[1:])
    lp_ref = torch.log_softmax(ref[:-1], -1)
    lp_q = torch.log_softmax(quant[:-1], -1)
    nll_ref = -lp_ref.gather(1, target[:, None]).mean()
    nll_q = -lp_q.gather(1, target[:, None]).mean()
    kld = (lp_ref.exp() * (lp_ref - lp_q)).sum(-1).mean()
    ppl_ref, ppl_q = float(nll_ref.exp()), float(nll_q.exp())
    return {"ppl_ref": ppl_ref, "ppl": ppl_q, "ppl_delta": ppl_q / ppl_ref - 1, "kld": float(kld)}


def agreement(engine: Engine, prompts: list[list[int]], refs: list[list[int]]) -> dict[str, float]:
    """Teacher-forced top-1 agreement with the reference tokens, and free-running prefix."""
    hits = total = 0
    for prompt, ref in zip(prompts, refs, strict=True):
        logits = engine.score(prompt + ref[:-1])[len(prompt) - 1 :]  # predicts ref[0..]
        hits += int((logits.argmax(-1) == torch.tensor(ref)).sum())
        total += len(ref)
    params = SamplingParams(max_tokens=len(refs[0]), ignore_eos=True)
    free = engine.generate(prompts, params)
    same = []
    for out, ref in zip(free, refs, strict=True):
        n = next((i for i, (a, b) in enumerate(zip(out[0], ref, strict=True)) if a != b), len(ref))
        same.append(n)
    return {"agree": hits / total, "free_prefix_mean": sum(same) / len(same)}


def parse_budget(text: str) -> int:
    from kvserve.shared.capacity import parse_size

    try:
        return int(parse_size(text))
    except ValueError as e:
        raise CliError(f"--budget: {e}") from e


def run(args: argparse.Namespace) -> int:
    for name in ("text_tokens", "gen_tokens", "num_prompts"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name.replace('_', '-')} must be >= 1")
    budget = parse_budget(args.budget)
    weights = load_weights(args.model)
    tok = KVTokenizer.from_path(args.model)

    def engine(kv: str, mode: str = "fp32") -> Engine:
        cache = CacheConfig(kv_dtype=kv, num_blocks=1024)
        cfg = EngineConfig(model_path=args.model, weights=mode, cache=cache)
        if mode == "fp32":
            return Engine(cfg, tokenizer=tok, weights=weights)
        return Engine(cfg, tokenizer=tok)  # loads the file's blocks

    ids = reference_text(tok, args.text_tokens)
    prompts = [tok.encode_chat([{"role": "user", "content": p}]) for p in PROMPTS]
    prompts = prompts[: args.num_prompts]
    base = engine("auto")
    ref_logits = base.score(ids)
    params = SamplingParams(max_tokens=args.gen_tokens, ignore_eos=True)
    refs = [c[0] for c in base.generate(prompts, params)]
    summary: dict[str, Any] = {
        "text_tokens": len(ids),
        "gen_tokens": args.gen_tokens,
        "num_prompts": len(prompts),
        **_sizes(weights.config, budget),
        "budget_bytes": budget,
    }
    if args.compare == "weights":
        e = engine("auto", "file")
        m = text_metrics(ref_logits, e.score(ids), ids)
        a = agreement(e, prompts, refs)
        print(
            f"file weights: perplexity {m['ppl']:.4f} vs {m['ppl_ref']:.4f} "
            f"({m['ppl_delta']:+.3%}), KLD {m['kld']:.5f}, greedy agreement {a['agree']:.2%} "
            f"(teacher-forced), identical free-running prefix "
            f"{a['free_prefix_mean']:.0f}/{args.gen_tokens}"
        )
        summary |= {
            "kld_file": m["kld"],
            "ppl_delta_file": m["ppl_delta"],
            "ppl_file": m["ppl"],
            "ppl_fp32": m["ppl_ref"],
            "agree_file": a["agree"],
            "free_prefix_file": a["free_prefix_mean"],
        }
        print(json.dumps(summary))
        return 0
    for kv in DTYPES:
        e = engine(kv)
        m = text_metrics(ref_logits, e.score(ids), ids)
        summary |= _quality(kv, m, agreement(e, prompts, refs), summary, args.gen_tokens)
    for name, n in summary["tokens_in_budget"].items():
        print(f"{name}: {summary['bytes_per_token'][name]} B/token, {n} tokens in {args.budget}")
    print(json.dumps(summary))
    return 0


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
