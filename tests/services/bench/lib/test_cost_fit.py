"""The cost-profile fit of `kvserve bench calibrate`: it recovers a known StepCost from the
points that StepCost gives, stays close under noise, never returns a negative coefficient,
reports the errors of the points it fitted, and turns store timings into per-block costs."""

from __future__ import annotations

import random
from dataclasses import astuple

import numpy as np
import pytest
from kvserve.services.bench.lib.cost_fit import (
    FitError,
    fit_step_cost,
    nnls,
    relative_error,
    relative_fit,
    step_class,
    store_cost,
)
from kvserve.shared.engine.sim.profile import StepCost, StepShape, StoreCost

TRUE = StepCost(
    base_s=0.006,
    per_token_s=0.0009,
    per_prefill_pair_s=4e-7,
    per_decode_context_s=2.5e-6,
    per_sampled_row_s=0.0002,
    mixed_step_s=0.003,
)


def shapes(rng: random.Random) -> list[StepShape]:
    """Decode batches, prompt chunks over cached contexts, and mixed steps, as the scheduler
    makes them (512-token chunks and budget)."""
    out = []
    for batch in (1, 2, 4, 8, 16, 32, 64):
        for context in (64, 256, 1024, 2048):
            out.append(StepShape.of_rows([(1, context + rng.randrange(16), True)] * batch))
    for chunk in (16, 64, 256, 512):
        for cached in (0, 256, 1024, 2048):
            out.append(StepShape.of_rows([(chunk, cached, rng.random() < 0.5)]))
    for decodes in (2, 8, 32):
        rows = [(1, rng.randrange(64, 2048), True) for _ in range(decodes)]
        out.append(StepShape.of_rows([*rows, (512 - decodes, rng.randrange(0, 1024), True)]))
    return out


def test_steps_are_classed_by_their_rows() -> None:
    assert step_class(StepShape.of_rows([(1, 10, True), (1, 20, True)])) == "decode"
    assert step_class(StepShape.of_rows([(32, 0, False), (16, 64, True)])) == "prompt"
    assert step_class(StepShape.of_rows([(32, 0, True), (1, 64, True)])) == "mixed"


def test_the_fit_recovers_the_cost_that_made_the_points() -> None:
    points = shapes(random.Random(0))
    fit = fit_step_cost(points, [TRUE.seconds(s) for s in points])
    assert astuple(fit.step) == pytest.approx(astuple(TRUE), rel=1e-9)
    assert fit.errors["all"].mean < 1e-9 and fit.errors["all"].points == len(points)


def test_a_term_the_points_do_not_need_comes_out_zero() -> None:
    no_mixed = StepCost(*astuple(TRUE)[:5], mixed_step_s=0.0)
    points = shapes(random.Random(1))
    fit = fit_step_cost(points, [no_mixed.seconds(s) for s in points])
    assert astuple(fit.step) == pytest.approx(astuple(no_mixed), rel=1e-9, abs=1e-15)


def test_with_noise_the_fit_stays_close() -> None:
    """5% multiplicative noise: every well-determined term within 10%, the error of the fit
    about the noise's."""
    rng = random.Random(2)
    points = shapes(rng) * 4
    measured = [TRUE.seconds(s) * rng.lognormvariate(0, 0.05) for s in points]
    fit = fit_step_cost(points, measured)
    for name in ("base_s", "per_token_s", "per_prefill_pair_s", "per_decode_context_s"):
        assert getattr(fit.step, name) == pytest.approx(getattr(TRUE, name), rel=0.1), name
    assert 0.02 < fit.errors["all"].mean < 0.06


def test_coefficients_never_come_out_negative() -> None:
    """Points whose unconstrained least squares wants a negative context cost: that term is
    0, and the others are the best fit without it (the KKT conditions hold)."""
    points = shapes(random.Random(3))
    wrong = StepCost(0.01, 0.001, 4e-7, 0.0, 0.0, 0.0)
    measured = [wrong.seconds(s) - 2e-7 * s.decode_context + 0.03 for s in points]
    assert min(measured) > 0
    step = relative_fit(points, measured)
    assert min(astuple(step)) >= 0
    assert step.per_decode_context_s == 0
    a = np.array([step.terms(s) for s in points]) / np.array(measured)[:, None]
    gradient = a.T @ (1 - a @ np.array(astuple(step)))
    scale = np.abs(a).max(axis=0)
    assert (gradient / scale)[np.array(astuple(step)) > 0] == pytest.approx(0, abs=1e-6)
    assert (gradient / scale).max() < 1e-6
    fit = fit_step_cost(points, measured)  # the same terms, scaled to the measured total
    assert sum(fit.predicted) == pytest.approx(sum(measured))
    ratios = [f / r for f, r in zip(astuple(fit.step), astuple(step), strict=True) if r]
    assert ratios == pytest.approx([ratios[0]] * len(ratios))


def test_nnls_on_a_problem_with_a_known_answer() -> None:
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, -1.0, 0.0])) == pytest.approx([0.5, 0.0])
    assert nnls(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])


def test_the_errors_are_those_of_the_points_fitted() -> None:
    points = shapes(random.Random(4))
    measured = [TRUE.seconds(s) * (1.2 if i % 3 == 0 else 1.0) for i, s in enumerate(points)]
    fit = fit_step_cost(points, measured)
    assert fit.predicted == [fit.step.seconds(s) for s in points]
    err = [abs(p - m) / m for p, m in zip(fit.predicted, measured, strict=True)]
    assert fit.errors["all"] == FitError(len(err), pytest.approx(np.mean(err)),
                                         pytest.approx(np.percentile(err, 90)))  # fmt: skip
    decode = [e for e, s in zip(err, points, strict=True) if step_class(s) == "decode"]
    assert fit.errors["decode"].points == len(decode) == 28
    assert fit.errors["decode"].mean == pytest.approx(np.mean(decode))
    assert (fit.errors["prompt"].points, fit.errors["mixed"].points) == (16, 3)


def test_relative_error_by_hand() -> None:
    got = relative_error([1.0, 2.0, 4.0, 5.0], [1.1, 2.0, 3.0, 5.0])
    assert got == FitError(4, pytest.approx((0.1 + 0 + 0.25 + 0) / 4), pytest.approx(0.205))


def test_a_fit_needs_positive_times() -> None:
    with pytest.raises(ValueError, match="positive"):
        fit_step_cost([StepShape(tokens=1)], [0.0])
    with pytest.raises(ValueError, match="positive"):
        fit_step_cost([], [])


def test_store_cost_takes_the_round_trip_off_each_call() -> None:
    cost = store_cost(rtt_s=0.001, load_s=0.033, load_blocks=64, write_s=0.017, write_blocks=32,
                      frame_bytes_per_token=100.0)  # fmt: skip
    assert cost == StoreCost(0.001, pytest.approx(0.0005), pytest.approx(0.0005), 100.0)
    assert store_cost(0.01, 0.005, 4, 0.005, 4, 1.0).load_s_per_block == 0.0
