"""Workload W1 (services/bench/workloads/batch.py): seeded, lengths drawn before token ids,
every id an ordinary one below the vocabulary size."""

from __future__ import annotations

from kvserve.services.bench.workloads.batch import WorkloadSpec, make_requests
from kvserve.services.bench.workloads.tokens import MIN_TOKEN_ID

WORKLOAD = {
    "num_requests": 4,
    "min_prompt": 8,
    "max_prompt": 16,
    "min_output": 4,
    "max_output": 8,
    "seed": 0,
}
VOCAB = MIN_TOKEN_ID + 100


def test_workload_is_seeded_and_in_range() -> None:
    spec = WorkloadSpec(**WORKLOAD)
    requests = make_requests(spec, vocab_size=VOCAB)
    assert requests == make_requests(spec, vocab_size=VOCAB)
    assert requests != make_requests(WorkloadSpec(**{**WORKLOAD, "seed": 1}), vocab_size=VOCAB)
    assert [r.output_len for r in requests] == [8, 7, 7, 6]
    assert [len(r.prompt) for r in requests] == [14, 14, 8, 12]
    for r in requests:
        assert 8 <= len(r.prompt) <= 16
        assert all(MIN_TOKEN_ID <= t < VOCAB for t in r.prompt)
