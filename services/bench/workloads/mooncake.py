"""The `mooncake` workload of `kvserve bench serve`: the Mooncake FAST'25 trace replayed with
lengths and the 512-token block scaled down by `scale`, each hash id a deterministic token
block, arrival times kept (divided by `time_scale`), input clipped so input + output fits
`max_context`; each request's user key is its conversation (see `_conversation`)."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvserve.services.bench.workloads.sessions import Session, Turn
from kvserve.services.bench.workloads.tokens import check_vocab, random_tokens

MOONCAKE_BLOCK = 512  # tokens per hash id in the trace
MOONCAKE_TRACE = Path("/work/shared/data/mooncake/synthetic_trace.jsonl")


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


@dataclass(frozen=True)
class MooncakeTrace:
    """A trace window (start, count; count -1: to the end) replayed: lengths and the block
    size divided by `scale` (so two requests sharing leading hash ids share that many scaled
    blocks of identical tokens), arrival times relative to the window's first request divided
    by `time_scale`, output lengths at least 1, and the input clipped (from the end, keeping
    the shared prefix) to max_context - output."""

    path: Path = MOONCAKE_TRACE
    window: tuple[int, int] = (0, -1)
    scale: int = 8
    time_scale: float = 8.0
    max_context: int = 2048

    def sessions(self, vocab_size: int, seed: int = 0) -> list[Session]:
        self._check(vocab_size)
        rows = _trace_rows(self.path, *self.window)
        t0 = rows[0][1]["timestamp"]
        return [self._session(i, row, t0, vocab_size, seed) for i, row in rows]

    def _check(self, vocab_size: int) -> None:
        check_vocab(vocab_size)
        if self.scale < 1 or MOONCAKE_BLOCK % self.scale:
            raise ValueError(f"scale must divide {MOONCAKE_BLOCK}, got {self.scale}")
        if self.time_scale <= 0:
            raise ValueError(f"time scale must be > 0, got {self.time_scale}")

    def _session(
        self, i: int, row: dict[str, Any], t0: float, vocab_size: int, seed: int
    ) -> Session:
        n_out = min(max(1, round(row["output_length"] / self.scale)), self.max_context // 2)
        n_in = min(max(1, math.ceil(row["input_length"] / self.scale)), self.max_context - n_out)
        block = MOONCAKE_BLOCK // self.scale
        tokens, used = _trace_prompt(row["hash_ids"], n_in, block, vocab_size, seed, i)
        arrival = (row["timestamp"] - t0) / 1000.0 / self.time_scale
        turn = Turn(tokens, n_out)
        user = _conversation(row["hash_ids"], i)
        return Session([turn], arrival_s=arrival, tag=f"t{i}", user=user, hash_ids=used)


def _conversation(hash_ids: list[int], i: int) -> str:
    """The user key of trace line i: its conversation, named by its second hash id (in
    conversation_trace.jsonl the first is the system prompt every request shares, and the
    turns of one conversation share the blocks after it), else the line itself."""
    return f"c{hash_ids[1]}" if len(hash_ids) > 1 else f"t{i}"


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
