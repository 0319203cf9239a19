"""StepLog: every step an engine runs as a JSON line of its shape and seconds, read back by
read_steps (a line cut short by a dying process is skipped)."""

from __future__ import annotations

from pathlib import Path

from kvserve.shared.config import EngineConfig, SimConfig
from kvserve.shared.engine.engine import Engine
from kvserve.shared.engine.sim.profile import StepShape
from kvserve.shared.engine.sim.step_log import StepLog, read_steps
from kvserve.shared.model.tokenizer import KVTokenizer
from kvserve.shared.sampling_params import SamplingParams

from tests.shared.engine.sim.profiles import write_profile


def test_every_step_is_logged_with_its_shape_before_it_ran(
    tmp_path: Path, model_path: Path, tokenizer: KVTokenizer
) -> None:
    profile = write_profile(tmp_path / "p.json", step={"base_s": 0.001})
    sim = SimConfig(str(profile), time_scale=0.01)
    engine = Engine(EngineConfig(model_path=str(model_path), simulate=sim), tokenizer=tokenizer)
    log = tmp_path / "steps.jsonl"
    engine.on_step = step_log = StepLog(log)
    engine.generate([list(range(100, 140))], SamplingParams(max_tokens=3))
    step_log.close()
    with log.open("a") as f:
        f.write('{"tokens": 1, "prefill_pa')  # a process killed mid-line
    steps = read_steps(log)
    assert [shape for shape, _ in steps] == [
        StepShape.of_rows([(40, 0, True)]),
        StepShape.of_rows([(1, 40, True)]),
        StepShape.of_rows([(1, 41, True)]),
    ]
    assert all(seconds > 0 for _, seconds in steps)
