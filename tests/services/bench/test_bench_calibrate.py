"""`kvserve bench calibrate --quick` end to end, in a subprocess with a cache directory of its
own: the profile it writes loads, the `cpu` profile is the same one, and the fitted step cost
predicts the points it was fitted on within the error it printed (how close a fit comes is
measured, not asserted)."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvserve.kernels.cpp_build import kernel_dir
from kvserve.services.bench.lib.redis_server import redis_binaries_present
from kvserve.shared.engine.sim.profile import CostProfile, StepShape


@pytest.mark.redis
@pytest.mark.slow  # ~40 s (2-core machine)
def test_calibrate_quick_writes_a_profile_that_predicts_its_points(
    model_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not redis_binaries_present():
        pytest.skip("redis-server not installed")
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "kernels").symlink_to(kernel_dir())  # the compiled kernels, not a rebuild
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(cache))  # here and in the subprocess
    out = tmp_path / "profile.json"
    cmd = [sys.executable, "-m", "kvserve.services.cli", "bench", "calibrate", "--quick"]
    cmd += ["--out", str(out), "--gguf", str(model_path), "--threads", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])

    profile = CostProfile.load(str(out))
    assert CostProfile.load("cpu") == profile
    assert summary["out"] == str(out) and summary["profile"] == str(cache / "profiles/cpu.json")
    assert profile.source == "measured" and profile.name.startswith("cpu-")
    assert profile.model.name == model_path.stem and profile.engine.block_size == 16
    assert summary["step"] == json.loads(out.read_text())["step"]
    assert profile.store.rtt_s > 0 and profile.store.frame_bytes_per_token > 0

    points = json.loads(out.read_text())["fit"]["points"]
    assert len(points) == summary["steps"] == summary["errors"]["all"]["points"]
    errors = []
    for p in points:
        shape = StepShape(**{f.name: p[f.name] for f in dataclasses.fields(StepShape)})
        assert profile.step_seconds(shape) == pytest.approx(p["predicted_s"], rel=1e-9)
        errors.append(abs(profile.step_seconds(shape) - p["measured_s"]) / p["measured_s"])
    assert sum(errors) / len(errors) == pytest.approx(summary["errors"]["all"]["mean"], rel=1e-6)
    printed = f"{summary['errors']['all']['mean']:.1%}"
    assert printed in done.stdout
