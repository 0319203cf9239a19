"""StepLog: every step an engine runs, as a JSON line of its batch's StepShape and the seconds the
whole step took (schedule, model call, outputs), written as the engine serves (a real worker's
`--step-log FILE`), so that a cost profile can be fitted on the steps of a served workload
(`kvserve bench calibrate --served`), under the conditions a server meets: its event loop, the
bus, the other processes.

Written on the engine thread, line-buffered into the file; `read_steps` reads it back.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import IO

from kvserve.shared.engine.scheduler import Batch
from kvserve.shared.engine.sim.profile import StepShape


def shape_of(batch: Batch) -> StepShape:
    """The StepShape of a batch before it runs (its sequences' computed tokens not advanced)."""
    rows = [(s.num_new_tokens, s.seq.num_computed_tokens, s.samples) for s in batch.scheduled]
    return StepShape.of_rows(rows)


class StepLog:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file: IO[str] = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open

    def __call__(self, shape: StepShape, seconds: float) -> None:
        line = {**asdict(shape), "seconds": seconds}
        self._file.write(json.dumps(line, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._file.close()


def read_steps(path: str | Path) -> list[tuple[StepShape, float]]:
    """The (shape, seconds) of every complete line of a step log."""
    names = [f.name for f in fields(StepShape)]
    out = []
    for line in Path(path).read_text().splitlines():
        try:
            row = json.loads(line)
            out.append((StepShape(**{n: int(row[n]) for n in names}), float(row["seconds"])))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a process that died while writing it
    return out
