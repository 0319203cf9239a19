"""The workloads of `kvserve bench serve`: prompts as token ids, deterministic under a seed.

A workload is a list of `Session`s. A session is one or more turns sent one after another; a
turn's prompt is its own tokens, or, for a session that carries its history (`multi-round`),
every earlier turn's tokens and answers followed by its own. Single requests are sessions of one
turn. Token ids are drawn from [MIN_TOKEN_ID, vocab_size): the low ids hold the special tokens
of Llama-family vocabularies (SmolLM2's are 0..16), and sending ids rather than text means every
server under test sees exactly the same tokens.

- `random`: uniform input / output lengths in [len * (1 - r), len * (1 + r)] (vLLM's random).
- `shared-prefix`: G groups x P prompts, a per-group prefix plus a distinct question, fixed output
  length, shuffled (SGLang's generated-shared-prefix).
- `multi-round`: U users x R rounds, one system prompt shared by all users, each round appends the
  previous answer and a new question (LMCache's multi-round QA); a user's rounds are sequential.
- `mooncake`: the Mooncake FAST'25 trace replayed with lengths and the 512-token block scaled down
  by `scale`, each hash id a deterministic token block, arrival times kept (divided by
  `time_scale`), input clipped so input + output fits `max_context`.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MIN_TOKEN_ID = 100
DEFAULT_VOCAB_SIZE = 49152
MOONCAKE_BLOCK = 512  # tokens per hash id in the trace
MOONCAKE_TRACE = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")
WORKLOADS = ("random", "shared-prefix", "multi-round", "mooncake")


@dataclass
class Turn:
    tokens: list[int]  # appended to the history, then sent
    output_len: int


@dataclass
class Session:
    turns: list[Turn]
    carry_history: bool = False  # multi-round: the prompt is the whole conversation so far
    arrival_s: float | None = None  # trace replay: seconds after the start
    tag: str = ""  # e.g. "g3" (shared-prefix group), "u2" (user), "t17" (trace line)
    hash_ids: list[int] = field(default_factory=list)  # mooncake: the (scaled) blocks

    @property
    def num_requests(self) -> int:
        return len(self.turns)


def random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(n)]


def _check_vocab(vocab_size: int) -> None:
    if vocab_size <= MIN_TOKEN_ID:
        raise ValueError(f"vocab size must be > {MIN_TOKEN_ID}, got {vocab_size}")


def _uniform_len(rng: random.Random, length: int, ratio: float) -> int:
    lo = max(1, math.floor(length * (1 - ratio)))
    hi = max(lo, math.ceil(length * (1 + ratio)))
    return rng.randint(lo, hi)


def random_workload(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Session]:
    _check_vocab(vocab_size)
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(f"random:{seed}")
    out = []
    for i in range(num_requests):
        n_in = _uniform_len(rng, input_len, range_ratio)
        n_out = _uniform_len(rng, output_len, range_ratio)
        out.append(Session([Turn(random_tokens(rng, n_in, vocab_size), n_out)], tag=f"r{i}"))
    return out


def shared_prefix_workload(
    groups: int,
    prompts_per_group: int,
    prefix_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Session]:
    _check_vocab(vocab_size)
    rng = random.Random(f"shared-prefix:{seed}")
    out = []
    for g in range(groups):
        prefix = random_tokens(rng, prefix_len, vocab_size)
        for _ in range(prompts_per_group):
            question = random_tokens(rng, question_len, vocab_size)
            out.append(Session([Turn(prefix + question, output_len)], tag=f"g{g}"))
    rng.shuffle(out)
    return out


def multi_round_workload(
    users: int,
    rounds: int,
    system_len: int,
    question_len: int,
    output_len: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
    context_len: int = 0,
) -> list[Session]:
    """`context_len`: a context of each user's own (a document, a profile) after the shared
    system prompt in the first round, as in LMCache's multi-round QA benchmark."""
    _check_vocab(vocab_size)
    rng = random.Random(f"multi-round:{seed}")
    system = random_tokens(rng, system_len, vocab_size)
    out = []
    for u in range(users):
        turns = [
            Turn(random_tokens(rng, question_len, vocab_size), output_len) for _ in range(rounds)
        ]
        context = random_tokens(rng, context_len, vocab_size)
        turns[0] = Turn(system + context + turns[0].tokens, output_len)
        out.append(Session(turns, carry_history=True, tag=f"u{u}"))
    return out


# ---- Mooncake trace ---------------------------------------------------------------------------


def block_tokens(hash_id: int, block_size: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The tokens of one trace block: a function of (hash id, block size, vocab, seed) only."""
    return random_tokens(random.Random(f"mooncake:{seed}:{hash_id}"), block_size, vocab_size)


def parse_window(text: str) -> tuple[int, int]:
    """'START:COUNT' -> (start, count); COUNT may be empty (to the end of the trace)."""
    start_s, sep, count_s = text.partition(":")
    try:
        start = int(start_s) if start_s else 0
        count = int(count_s) if count_s else -1
    except ValueError:
        raise ValueError(f"window must be START:COUNT, got {text!r}") from None
    if not sep or start < 0 or (count_s and count < 1):
        raise ValueError(f"window must be START:COUNT with START >= 0, COUNT >= 1, got {text!r}")
    return start, count


def mooncake_workload(
    path: Path = MOONCAKE_TRACE,
    window: tuple[int, int] = (0, -1),
    scale: int = 8,
    time_scale: float = 8.0,
    max_context: int = 2048,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[Session]:
    """Replay of a Mooncake trace window: lengths and the block size divided by `scale` (so two
    requests sharing leading hash ids share that many scaled blocks of identical tokens), arrival
    times relative to the window's first request divided by `time_scale`, output lengths at least
    1, and the input clipped (from the end, keeping the shared prefix) to max_context - output."""
    _check_vocab(vocab_size)
    if scale < 1 or MOONCAKE_BLOCK % scale:
        raise ValueError(f"scale must divide {MOONCAKE_BLOCK}, got {scale}")
    if time_scale <= 0:
        raise ValueError(f"time scale must be > 0, got {time_scale}")
    rows = _trace_rows(path, *window)
    t0 = rows[0][1]["timestamp"]
    block = MOONCAKE_BLOCK // scale
    out = []
    for i, row in rows:
        n_out = min(max(1, round(row["output_length"] / scale)), max_context // 2)
        n_in = min(max(1, math.ceil(row["input_length"] / scale)), max_context - n_out)
        tokens, used = _trace_prompt(row["hash_ids"], n_in, block, vocab_size, seed, i)
        arrival = (row["timestamp"] - t0) / 1000.0 / time_scale
        out.append(Session([Turn(tokens, n_out)], arrival_s=arrival, tag=f"t{i}", hash_ids=used))
    return out


def _trace_rows(path: Path, start: int, count: int) -> list[tuple[int, dict[str, Any]]]:
    """(line number, request) of the trace's window (count -1: to the end); ValueError when
    it selects nothing."""
    rows: list[tuple[int, dict[str, Any]]] = []
    with open(path) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if count >= 0 and len(rows) >= count:
                break
            if line.strip():
                rows.append((i, json.loads(line)))
    if not rows:
        raise ValueError(f"the window {start}:{count} selects no request of {path}")
    return rows


def _trace_prompt(
    hash_ids: list[int], n_in: int, block: int, vocab_size: int, seed: int, i: int
) -> tuple[list[int], list[int]]:
    """A prompt of `n_in` tokens: the blocks of the row's hash ids (the same id, the same
    tokens), cut to length; and the ids it used."""
    tokens: list[int] = []
    used = []
    for h in hash_ids:
        if len(tokens) >= n_in:
            break
        tokens += block_tokens(h, block, vocab_size, seed)
        used.append(h)
    tokens = tokens[:n_in]
    if len(tokens) < n_in:  # a trace row with fewer blocks than its length (not expected)
        tokens += random_tokens(
            random.Random(f"mooncake-tail:{seed}:{i}"), n_in - len(tokens), vocab_size
        )
    return tokens, used
