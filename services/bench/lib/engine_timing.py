"""Timing an in-process Engine from outside: every step with the batch its scheduler produced
(`timed_steps`), a request's first token (`first_token_s`), an arm's wall time and tokens
(`ArmResult`). The engine's code is untouched: only bound methods of one engine are wrapped,
and only while a block runs."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvserve.shared.sampling_params import SamplingParams

if TYPE_CHECKING:  # no torch at import: `kvserve bench profile --help` stays fast
    from kvserve.shared.engine.engine import Engine
    from kvserve.shared.engine.outputs import RequestOutput
    from kvserve.shared.engine.scheduler import Batch

FIRST_TOKEN = SamplingParams(max_tokens=1, ignore_eos=True)


@dataclass(frozen=True)
class StepRecord:
    seconds: float
    num_seqs: int
    num_tokens: int
    num_prefill_seqs: int  # sequences with a prompt chunk of more than one token

    @classmethod
    def of(cls, batch: Batch, seconds: float) -> StepRecord:
        prefills = sum(1 for s in batch.scheduled if s.num_new_tokens > 1)
        return cls(seconds, len(batch.scheduled), batch.num_tokens, prefills)

    @property
    def decode_only(self) -> bool:
        return self.num_prefill_seqs == 0


def _no_sync() -> None:
    pass


def synchronizer(device: str) -> Callable[[], None]:
    """What to call before reading the clock at the end of a timed region on `device`: on CUDA
    torch.cuda.synchronize (kernels run asynchronously), elsewhere nothing."""
    import torch

    dev = torch.device(device)
    if dev.type != "cuda":
        return _no_sync
    return lambda: torch.cuda.synchronize(dev)


@contextlib.contextmanager
def timed_steps(engine: Engine, sync: Callable[[], None] = _no_sync) -> Iterator[list[StepRecord]]:
    """Within the block every `engine.step()` is timed with perf_counter and recorded with the
    Batch its scheduler produced, or the batch of the model call it ran ahead of its outputs
    (Engine._run_ahead: no schedule); a step that ran nothing is not recorded. `sync` is
    called before the clock is read at a step's end (`synchronizer`). Only these bound
    methods are replaced, and put back after; the engine's code is untouched."""
    records: list[StepRecord] = []
    scheduler, runner = engine.scheduler, engine.runner
    schedule, step = scheduler.schedule, engine.step
    run_ahead = getattr(runner, "run_ahead", None)  # a simulated runner has none
    last: list[Batch] = []

    def capture() -> Batch:
        batch = schedule()
        last.append(batch)
        return batch

    def capture_ahead(batch: Batch, *args: Any) -> Any:
        last.append(batch)
        assert run_ahead is not None
        return run_ahead(batch, *args)

    def timed() -> list[RequestOutput]:
        last.clear()
        t0 = time.perf_counter()
        outputs = step()
        sync()
        seconds = time.perf_counter() - t0
        if last and last[-1]:
            records.append(StepRecord.of(last[-1], seconds))
        return outputs

    scheduler.schedule = capture  # type: ignore[method-assign]
    engine.step = timed  # type: ignore[method-assign]
    if run_ahead is not None:
        runner.run_ahead = capture_ahead  # type: ignore[method-assign,union-attr]
    try:
        yield records
    finally:
        scheduler.schedule = schedule  # type: ignore[method-assign]
        engine.step = step  # type: ignore[method-assign]
        if run_ahead is not None:
            runner.run_ahead = run_ahead  # type: ignore[method-assign,union-attr]


def first_token_s(engine: Any, rid: str, ids: list[int]) -> float:
    """Seconds from add_request to the step that produced the first token of a 1-token
    request, stepped until the engine has nothing left to do."""
    t0 = time.perf_counter()
    engine.add_request(rid, ids, FIRST_TOKEN)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.completions[0].token_ids:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft


@dataclass(frozen=True)
class ArmResult:
    name: str
    wall_s: float
    useful_tokens: int  # tokens the requests asked for
    generated_tokens: int  # tokens computed, waste included

    @property
    def tok_s(self) -> float:
        return self.useful_tokens / self.wall_s
