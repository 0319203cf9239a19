"""CostProfile: the step-time terms, a batch's shape, and a profile that does not parse or lacks
a term refused with a one-line message naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvserve.shared.engine.sim.profile import (
    CostProfile,
    ProfileError,
    StepShape,
    profile_path,
)

from tests.shared.engine.sim.profiles import BASE, profile_dict, write_profile


def test_a_batch_shape_counts_tokens_pairs_and_context() -> None:
    # a 4-token chunk after 10 cached tokens (sampled), a 3-token chunk from scratch (not
    # sampled), two decodes at contexts 5 and 7 (the new token included)
    shape = StepShape.of_rows([(4, 10, True), (3, 0, False), (1, 4, True), (1, 6, True)])
    assert shape == StepShape(
        tokens=9,
        prefill_pairs=(4 * 10 + 4 * 5 // 2) + (3 * 4 // 2),
        decode_context=5 + 7,
        sampled_rows=3,
        prefill_chunks=2,
        decode_rows=2,
    )


def test_step_seconds_is_the_sum_of_its_terms() -> None:
    prof = CostProfile.from_json(json.dumps(BASE))
    s = prof.step
    decode = StepShape(tokens=8, decode_context=800, sampled_rows=8, decode_rows=8)
    assert prof.step_seconds(decode) == pytest.approx(
        s.base_s + 8 * s.per_token_s + 800 * s.per_decode_context_s + 8 * s.per_sampled_row_s
    )
    mixed = StepShape(tokens=100, prefill_pairs=5050, sampled_rows=1, prefill_chunks=1)
    assert prof.step_seconds(mixed) == pytest.approx(
        s.base_s
        + 100 * s.per_token_s
        + 5050 * s.per_prefill_pair_s
        + s.per_sampled_row_s
        + s.mixed_step_s
    )
    assert s.terms(mixed) == [1.0, 100.0, 5050.0, 0.0, 1.0, 1.0]


def test_a_profile_round_trips_through_json(tmp_path: Path) -> None:
    prof = CostProfile.load(str(write_profile(tmp_path / "p.json")))
    again = CostProfile.from_json(prof.to_json({"fit": {"points": 3}}))
    assert again == prof
    assert prof.model.kv_bytes_per_token == 2 * 2 * 2 * 8 * 4


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["step"].pop("per_token_s"), "step.per_token_s"),
        (lambda d: d["store"].update(rtt_s="fast"), "store.rtt_s"),
        (lambda d: d["store"].update(load_s_per_block=-1), "store.load_s_per_block"),
        (lambda d: d["engine"].update(num_blocks=0), "engine.num_blocks"),
        (lambda d: d["engine"].update(block_size=16.5), "engine.block_size"),
        (lambda d: d.pop("model"), "model"),
        (lambda d: d["model"].update(kv_dtype="int4"), "model.kv_dtype"),
        (lambda d: d.update(source="guessed"), "source"),
        (lambda d: d.update(version=2), "version"),
        (lambda d: d.pop("name"), "name"),
    ],
)
def test_a_bad_profile_names_the_field(tmp_path: Path, change, field: str) -> None:  # type: ignore[no-untyped-def]
    raw = profile_dict()
    change(raw)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ProfileError) as err:
        CostProfile.load(str(path))
    message = str(err.value)
    assert f"'{field}'" in message and str(path) in message and "\n" not in message


def test_not_json_and_a_missing_file_are_one_line_errors(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    path.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        CostProfile.load(str(path))
    with pytest.raises(ProfileError, match="cannot read"):
        CostProfile.load(str(tmp_path / "absent.json"))


def test_cpu_names_this_machines_calibration(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path))
    assert profile_path("cpu") == tmp_path / "profiles" / "cpu.json"
    with pytest.raises(ProfileError, match="bench calibrate"):
        CostProfile.load("cpu")
    (tmp_path / "profiles").mkdir()
    write_profile(tmp_path / "profiles" / "cpu.json")
    assert CostProfile.load("cpu").name == "test"


def test_the_shipped_gpu_profile_gives_blis_step_times() -> None:
    """BLIS's H100 / Llama-3.1-8B blackbox: 6472.01 + 19.797 * prefill + 304.40 * decode (us)."""
    prof = CostProfile.load("gpu")
    assert prof.source == "published" and "BLIS" in prof.reference
    assert prof.model.kv_bytes_per_token == 131072
    for batch in (1, 32, 128):
        decode = StepShape.of_rows([(1, 1000, True)] * batch)
        assert prof.step_seconds(decode) == pytest.approx((6472.01 + 304.40 * batch) * 1e-6)
    prefill = StepShape.of_rows([(1024, 0, False)])
    assert prof.step_seconds(prefill) == pytest.approx((6472.01 + 19.797 * 1024) * 1e-6)


def test_extra_keys_never_replace_the_profiles_own(tmp_path: Path) -> None:
    prof = CostProfile.load(str(write_profile(tmp_path / "p.json")))
    with pytest.raises(ValueError, match="store"):
        prof.to_json({"store": {}})
