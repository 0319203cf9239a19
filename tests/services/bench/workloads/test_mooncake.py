"""The Mooncake trace loader (services/bench/workloads/mooncake.py) on the real trace: lengths
and blocks scaled, shared hash ids as identical token blocks, arrival times kept, windows, user
keys."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvserve.services.bench.workloads.mooncake import (
    MOONCAKE_TRACE,
    MooncakeTrace,
    block_tokens,
    parse_window,
)

VOCAB = 49152


def test_mooncake_loader_on_the_real_trace() -> None:
    raw = [json.loads(line) for line in MOONCAKE_TRACE.read_text().splitlines()[:300]]
    s = MooncakeTrace(window=(0, 300), scale=8, time_scale=2.0, max_context=2048).sessions(VOCAB)
    assert s == MooncakeTrace(window=(0, 300), scale=8, time_scale=2.0, max_context=2048).sessions(
        VOCAB
    )
    assert len(s) == 300
    for x, row in zip(s, raw, strict=True):
        n_in, n_out = len(x.turns[0].tokens), x.turns[0].output_len
        assert n_out == max(1, round(row["output_length"] / 8))
        assert n_in == min(-(-row["input_length"] // 8), 2048 - n_out)
        assert n_in + n_out <= 2048
        assert x.arrival_s == pytest.approx(row["timestamp"] / 1000 / 2.0)
    # Shared hash ids -> identical 64-token blocks at the same positions.
    owners: dict[int, list[tuple[int, int]]] = {}
    for k, x in enumerate(s):
        for pos, h in enumerate(x.hash_ids):
            if (pos + 1) * 64 <= len(x.turns[0].tokens):
                owners.setdefault(h, []).append((k, pos))
    shared = {h: o for h, o in owners.items() if len(o) > 1}
    assert shared, "the trace window should share some blocks"
    for h, o in list(shared.items())[:50]:
        blocks = {tuple(s[k].turns[0].tokens[p * 64 : (p + 1) * 64]) for k, p in o}
        assert blocks == {tuple(block_tokens(h, 64, VOCAB))}
    assert block_tokens(1, 64, VOCAB) != block_tokens(2, 64, VOCAB)
    # A window: the same requests, times relative to its first one.
    w = MooncakeTrace(window=(100, 20), scale=8, time_scale=2.0).sessions(VOCAB)
    assert len(w) == 20 and w[0].arrival_s == 0
    assert [x.turns for x in w] == [x.turns for x in s[100:120]]
    assert w[5].arrival_s == pytest.approx(s[105].arrival_s - s[100].arrival_s)
    assert parse_window("5:") == (5, -1)
    for bad in ("5", "a:b", "-1:3", "0:0"):
        with pytest.raises(ValueError):
            parse_window(bad)


def test_mooncake_user_keys_are_conversations(tmp_path: Path) -> None:
    """A row's user key: `c` and its second hash id (the first is the system prompt every
    conversation shares), else `t` and its line."""
    rows = [[0, 7, 8], [0, 9], [0, 7, 8, 10], [5]]
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        "".join(
            json.dumps({"timestamp": i, "input_length": 600, "output_length": 8, "hash_ids": h})
            + "\n"
            for i, h in enumerate(rows)
        )
    )
    s = MooncakeTrace(path=trace, window=(0, -1), scale=8).sessions(VOCAB)
    assert [x.user for x in s] == ["c7", "c9", "c7", "t3"]
    later = MooncakeTrace(path=trace, window=(2, 2), scale=8).sessions(VOCAB)
    assert [x.user for x in later] == ["c7", "t3"]  # line numbers of the file, not the window
