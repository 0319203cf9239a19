"""Give a Hugging Face model directory that holds only config.json and the tokenizer's files
random weights (seeded, saved as safetensors), for runs that measure speed or compare two
implementations of the same weights on a machine that cannot fetch the real ones (vLLM's
`--load-format dummy`, as a file). Its answers are not the model's.

    python ops/random_weights.py DIR [--seed 0] [--std 0.02]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path, help="holds config.json and tokenizer.json")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--std", type=float, default=None, help="init std (default: the config's)")
    args = p.parse_args(argv)
    if not (args.dir / "config.json").is_file():
        print(f"random_weights: no config.json in {args.dir}", file=sys.stderr)
        return 2
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(str(args.dir))
    if args.std is not None:
        cfg.initializer_range = args.std
    torch.manual_seed(args.seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(str(args.dir), safe_serialization=True)
    n = sum(t.numel() for t in model.parameters())
    print(f"random_weights: {n / 1e6:.1f}M parameters (seed {args.seed}) into {args.dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
