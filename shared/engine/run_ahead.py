"""When a step's next model call may run before the step's outputs are made (Engine._run_ahead,
vLLM's async scheduling): when the next step is known without them.

That is a step of single-token decodes of every running sequence, none of which can stop at
the token it draws now by length (max_tokens, the context), with room for one more token in
its last block (no allocation, so no preemption and no copy-on-write), and nothing waiting to
be admitted. The next step is then the same sequences one token on, whatever tokens they draw;
one that stops at its token (EOS, a stop token or string) computed one row for nothing, which
the step after drops. Beams, forks, drafts and exported KV tails take the regular path, as do
steps that are timed shape by shape (`on_step`) or have faults injected.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvserve.shared.engine.model_runner import StepOutput
from kvserve.shared.engine.request import Request
from kvserve.shared.engine.scheduler import Batch, Scheduler


def steady_decodes(
    batch: Batch,
    out: StepOutput,
    scheduler: Scheduler,
    requests: Mapping[str, Request],
    block_size: int,
    max_model_len: int,
) -> bool:
    """Whether `batch` (its model call just ran, its outputs not yet made) is a step whose
    next one is the same sequences one token on."""
    if scheduler.waiting or scheduler.suspects or scheduler.drafter is not None:
        return False
    if batch.block_copies or batch.preempted or out.columns is not None or out.num_drafts:
        return False
    scheduled = batch.scheduled
    n = len(scheduled)
    if n == 0 or len(scheduler.running) != n or len(out.sampling_seqs) != n:
        return False
    bs = block_size
    for s, running, sampled in zip(scheduled, scheduler.running, out.sampling_seqs, strict=True):
        seq = s.seq
        if seq is not running or seq is not sampled or s.num_new_tokens != 1 or s.num_drafts:
            return False
        req = requests[seq.request_id]
        if req.beam is not None or req.export_tail or seq.pending_forks:
            return False
        at = seq.num_computed_tokens + 1  # the next step's row (this step's is not counted yet)
        if at // bs >= len(seq.block_table) or at + 1 >= max_model_len:
            return False
        if seq.num_output_tokens + 1 >= seq.params.max_tokens:  # stops at this token
            return False
    return True
