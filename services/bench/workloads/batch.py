"""Workload W1 of `kvserve bench engine` (and the zero-hit arm of `bench prefix`): N requests
submitted at once to an in-process engine, prompt and output lengths uniform in their ranges
(EOS ignored), prompt tokens from workloads/tokens.py, the same for every arm under a seed."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

from kvserve.services.bench.workloads.tokens import random_tokens
from kvserve.services.cli_support import CliError


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    min_prompt: int
    max_prompt: int
    min_output: int
    max_output: int
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> WorkloadSpec:
        """The spec of `--num-requests`, `--min-/--max-prompt`, `--min-/--max-output` and
        `--seed`; CliError (one line) for sizes below 1 or a min above its max."""
        spec = cls(*(getattr(args, f) for f in cls.__dataclass_fields__))
        if spec.num_requests < 1 or spec.min_prompt < 1 or spec.min_output < 1:
            raise CliError("--num-requests, --min-prompt and --min-output must be >= 1")
        if spec.min_prompt > spec.max_prompt or spec.min_output > spec.max_output:
            raise CliError("each --min-* must be <= its --max-*")
        return spec


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    output_len: int  # tokens to generate; EOS is ignored

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + self.output_len


def make_requests(spec: WorkloadSpec, vocab_size: int) -> list[BenchRequest]:
    """The same requests for the same spec, whatever arm runs them. Lengths are drawn before
    any token id, so they do not depend on the vocabulary size."""
    rng = random.Random(spec.seed)
    n = spec.num_requests
    prompt_lens = [rng.randint(spec.min_prompt, spec.max_prompt) for _ in range(n)]
    output_lens = [rng.randint(spec.min_output, spec.max_output) for _ in range(n)]
    return [
        BenchRequest(random_tokens(rng, p, vocab_size), o)
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]
