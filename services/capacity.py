"""`kvserve capacity`: the KV-cache size calculator.

For a model (the default GGUF, a `.gguf` file or Hugging Face directory, a config.json, or a named
preset) and each KV dtype (fp32, bf16, int8, fp8) it prints the KV bytes per token, the cache size
of `batch x seq_len` tokens (`2 * batch * seq_len * num_layers * num_kv_heads * head_dim * bytes`,
plus the per-(token, head) float32 scales of int8/fp8), how many tokens and how many sequences of
`seq_len` fit in a memory budget, and the same numbers for the model with MHA
(`num_kv_heads = num_heads`), so the saving of GQA/MQA shows as a ratio.

Only the GGUF path imports the model loader (and with it torch); presets and config files do not.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from kvserve.services.cli_support import CliError
from kvserve.shared.capacity import (
    KV_DTYPE_BYTES,
    PRESETS,
    REPORT_KV_DTYPES,
    CapacityReport,
    attention_kind,
    capacity_report,
    format_size,
    get_preset,
    kv_scale_bytes_per_token,
    parameter_count,
    parse_size,
)
from kvserve.shared.config import (
    FETCH_MODEL_COMMAND,
    CacheConfig,
    ModelConfig,
    default_model_path,
)

# Without --memory: the engine's default KV-cache budget (CacheConfig.memory_budget_bytes).
DEFAULT_MEMORY_BYTES = CacheConfig().memory_budget_bytes
DEFAULT_BLOCK_SIZE = CacheConfig().block_size


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "capacity",
        help="KV-cache size per token / per batch and what fits in a memory budget",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_model_source(p)
    # Numbers are parsed in run() so that bad values give one-line CliErrors, not argparse usage.
    p.add_argument("--batch", default="1", metavar="B", help="sequences in the batch (default 1)")
    p.add_argument(
        "--seq-len",
        default=None,
        metavar="L",
        help="tokens per sequence (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--memory",
        default=None,
        metavar="SIZE",
        help="memory budget for the KV cache, e.g. 24GiB, 80GB, 512MiB or bytes "
        f"(default: the engine's {format_size(DEFAULT_MEMORY_BYTES)})",
    )
    p.add_argument(
        "--weights-dtype",
        default=None,
        metavar="DTYPE",
        help="subtract the weights (parameter count x bytes of DTYPE: "
        f"{', '.join(KV_DTYPE_BYTES)}) from --memory",
    )
    p.add_argument(
        "--block-size",
        default=str(DEFAULT_BLOCK_SIZE),
        metavar="N",
        help="paged-cache block size in tokens; capacity is counted in whole blocks "
        f"(default {DEFAULT_BLOCK_SIZE}; 1 = no paging)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--list-presets", action="store_true", help="list the presets and exit")
    p.set_defaults(handler=run)


def _add_model_source(p: argparse.ArgumentParser) -> None:
    """--model, --config or --preset: where the architecture comes from (one at most)."""
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--model",
        metavar="PATH",
        help="a .gguf file or a Hugging Face directory with config.json "
        "(default: the default model file)",
    )
    src.add_argument("--config", metavar="CONFIG_JSON", help="a Hugging Face config.json")
    src.add_argument("--preset", metavar="NAME", help=f"a named architecture: {', '.join(PRESETS)}")


def _positive_int(value: str, flag: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise CliError(f"{flag}: expected a positive integer, got {value!r}") from None
    if n < 1:
        raise CliError(f"{flag}: must be a positive integer, got {value!r}")
    return n


def _load_gguf_config(path: Path, flag: str) -> ModelConfig:
    from kvserve.shared.model.gguf_file import GGUFReadError, gguf_model_config, open_gguf

    try:
        return gguf_model_config(open_gguf(str(path)))
    except GGUFReadError as e:
        raise CliError(f"{flag}: {e}") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CliError(f"{flag}: cannot read GGUF {path}: {e}") from None


def _load_json_config(path: Path, flag: str) -> ModelConfig:
    try:
        return ModelConfig.from_json_file(path)
    except FileNotFoundError:
        raise CliError(f"{flag}: no such file: {path}") from None
    except json.JSONDecodeError as e:
        raise CliError(f"{flag}: {path} is not valid JSON: {e}") from None
    except KeyError as e:
        raise CliError(f"{flag}: {path} lacks the field {e}") from None
    except (OSError, ValueError, TypeError) as e:
        raise CliError(f"{flag}: cannot read {path}: {e}") from None


def resolve_config(args: argparse.Namespace) -> tuple[str, ModelConfig]:
    """(a description of the source, its ModelConfig) from --preset, --config, --model or the
    default model file."""
    if args.preset is not None:
        try:
            return f"preset {args.preset}", get_preset(args.preset)
        except ValueError as e:
            raise CliError(f"--preset: {e}") from None
    if args.config is not None:
        path = Path(args.config)
        return str(path), _load_json_config(path, "--config")
    if args.model is not None:
        path = Path(args.model)
        if not path.exists():
            raise CliError(f"--model: no such file or directory: {path}")
        if path.is_file() and path.suffix == ".gguf":
            return str(path), _load_gguf_config(path, "--model")
        if path.is_dir() and (path / "config.json").is_file():
            return str(path), _load_json_config(path / "config.json", "--model")
        raise CliError(f"--model: {path} is neither a .gguf file nor a directory with config.json")
    path = default_model_path()
    if not path.is_file():
        raise CliError(f"default model not found at {path}; fetch it with: {FETCH_MODEL_COMMAND}")
    return str(path), _load_gguf_config(path, "default model")


def _model_dict(source: str, config: ModelConfig) -> dict[str, Any]:
    return {
        "source": source,
        "num_layers": config.num_layers,
        "num_heads": config.num_heads,
        "num_kv_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "attention": attention_kind(config),
        "parameter_count": parameter_count(config),
    }


def _print_table(
    source: str, config: ModelConfig, reports: list[CapacityReport], args: argparse.Namespace
) -> None:
    kind = attention_kind(config)
    group = config.num_heads // config.num_kv_heads
    print(
        f"model: {source}\n"
        f"  {config.num_layers} layers, {config.num_heads} heads, {config.num_kv_heads} KV heads "
        f"({kind}" + (f", {group} query heads per KV head" if kind == "GQA" else "") + "), "
        f"head_dim {config.head_dim}, {parameter_count(config) / 1e9:.3f} B parameters"
    )
    first = reports[0]
    fit = first.fit
    assert fit is not None
    budget = f"memory {format_size(fit.memory_bytes)}"
    if args.weights_dtype is not None:
        budget += (
            f" - weights {format_size(fit.weights_bytes)} ({args.weights_dtype})"
            f" = {format_size(fit.available_bytes)} for the KV cache"
        )
    print(f"  batch {first.batch} x seq_len {first.seq_len}; {budget}; block_size {fit.block_size}")
    print()
    _print_dtype_rows(reports)
    print()
    scales = kv_scale_bytes_per_token(config, "int8")
    print(
        f"int8/fp8 include float32 scales per (token, KV head) for K and V: "
        f"2 x {config.num_layers} layers x {config.num_kv_heads} KV heads x 4 B "
        f"= {scales:,} B/token."
    )
    if fit.available_bytes <= 0:
        print("warning: the weights take the whole memory budget; no KV cache fits.")


def _print_dtype_rows(reports: list[CapacityReport]) -> None:
    """One row per KV dtype: its sizes, what fits, and the same cache under MHA."""
    first = reports[0]
    cache_col = f"cache {first.batch}x{first.seq_len}"
    header = (
        f"{'KV dtype':<8} {'bytes/token':>12} {cache_col:>16} {'tokens fit':>14} "
        f"{'seqs fit':>10} {'MHA bytes/tok':>14} {'MHA cache':>12} {'MHA/this':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in reports:
        assert r.fit is not None
        print(
            f"{r.kv_dtype:<8} {r.bytes_per_token:>12,} {format_size(r.cache_bytes):>16} "
            f"{r.fit.tokens:>14,} {r.fit.sequences:>10,} {r.mha_bytes_per_token:>14,} "
            f"{format_size(r.mha_cache_bytes):>12} {r.kv_saving:>8.2f}x"
        )


def _list_presets(as_json: bool) -> int:
    if as_json:
        print(json.dumps({name: _model_dict(f"preset {name}", c) for name, c in PRESETS.items()}))
        return 0
    header = (
        f"{'preset':<14} {'layers':>6} {'heads':>6} {'kv_heads':>8} {'head_dim':>8} "
        f"{'hidden':>7} {'ffn':>6} {'vocab':>7} {'params':>9}"
    )
    print(header)
    print("-" * len(header))
    for name, c in PRESETS.items():
        print(
            f"{name:<14} {c.num_layers:>6} {c.num_heads:>6} {c.num_kv_heads:>8} "
            f"{c.head_dim:>8} {c.hidden_size:>7} {c.intermediate_size:>6} {c.vocab_size:>7} "
            f"{parameter_count(c) / 1e9:>8.3f}B"
        )
    return 0


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        return _list_presets(args.json)
    batch = _positive_int(args.batch, "--batch")
    block_size = _positive_int(args.block_size, "--block-size")
    memory = _memory(args.memory)
    if args.weights_dtype is not None and args.weights_dtype not in KV_DTYPE_BYTES:
        raise CliError(
            f"--weights-dtype: unknown dtype {args.weights_dtype!r} "
            f"(known: {', '.join(KV_DTYPE_BYTES)})"
        )
    # Validate the numbers before loading a model, so bad input fails fast.
    seq_len_arg = None if args.seq_len is None else _positive_int(args.seq_len, "--seq-len")
    source, config = resolve_config(args)
    seq_len = config.max_position_embeddings if seq_len_arg is None else seq_len_arg
    reports = [
        capacity_report(
            config,
            dtype,
            batch,
            seq_len,
            memory_bytes=memory,
            weights_dtype=args.weights_dtype,
            block_size=block_size,
        )
        for dtype in REPORT_KV_DTYPES
    ]
    if args.json:
        print(json.dumps(_json_report(source, config, reports, args.weights_dtype)))
    else:
        _print_table(source, config, reports, args)
    return 0


def _memory(text: str | None) -> int:
    """--memory in bytes (default: the engine's KV-cache budget)."""
    if text is None:
        return DEFAULT_MEMORY_BYTES
    try:
        memory = parse_size(text)
    except ValueError as e:
        raise CliError(f"--memory: {e}") from None
    if memory < 1:
        raise CliError(f"--memory: must be positive, got {text!r}")
    return memory


def _json_report(
    source: str, config: ModelConfig, reports: list[CapacityReport], weights_dtype: str | None
) -> dict[str, Any]:
    first = reports[0]
    fit = first.fit
    assert fit is not None
    return {
        "model": _model_dict(source, config),
        "batch": first.batch,
        "seq_len": first.seq_len,
        "block_size": fit.block_size,
        "memory_bytes": fit.memory_bytes,
        "weights_dtype": weights_dtype,
        "weights_bytes": fit.weights_bytes,
        "available_bytes": fit.available_bytes,
        "kv_dtypes": {r.kv_dtype: dataclasses.asdict(r) for r in reports},
    }
