"""Fitting a CostProfile's terms to measured engine steps and store transfers (`kvserve bench
calibrate`).

A step's modelled time is linear in its shape's terms (`StepCost.terms`), and every coefficient
is a cost, so the fit is non-negative least squares; each step's residual is divided by its
measured time, so a 5 ms decode step weighs as much as a 500 ms prompt chunk (the fit minimizes
relative error). The solver is Lawson and Hanson's active-set method in numpy. Step times are
skewed (a step that another process slows takes far longer, none takes far less), so a fit on
relative error sits near the typical step and below the mean; the coefficients are then scaled
by one factor so the predicted total time of the steps equals the measured total: a simulated
engine is busy as long as the real one was.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import astuple, dataclass

import numpy as np
from kvserve.shared.engine.sim.profile import StepCost, StepShape, StoreCost

CLASSES = ("decode", "prompt", "mixed")


def step_class(shape: StepShape) -> str:
    """ "decode" (single-token rows only), "prompt" (prompt chunks only) or "mixed" (both)."""
    if not shape.prefill_chunks:
        return "decode"
    return "mixed" if shape.decode_rows else "prompt"


@dataclass(frozen=True)
class FitError:
    """Absolute relative error |predicted - measured| / measured over `points` steps."""

    points: int
    mean: float
    p90: float


@dataclass(frozen=True)
class StepFit:
    """The fitted StepCost, each step's shape with its measured and predicted seconds, and the
    errors over all steps ("all") and per class of step (those with steps only)."""

    step: StepCost
    shapes: list[StepShape]
    measured: list[float]
    predicted: list[float]
    errors: dict[str, FitError]


def relative_error(measured: Sequence[float], predicted: Sequence[float]) -> FitError:
    """The mean and 90th percentile (numpy's linear interpolation) of the absolute relative
    errors; `measured` must be positive and as long as `predicted`, and not empty."""
    m, p = np.asarray(measured, dtype=float), np.asarray(predicted, dtype=float)
    err = np.abs(p - m) / m
    return FitError(len(err), float(err.mean()), float(np.percentile(err, 90)))


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """The x >= 0 that minimizes ||a @ x - b|| (Lawson and Hanson's active-set method): add the
    coefficient whose gradient most wants to grow to the free set, solve least squares on the
    free set, and step back whenever that would make a free coefficient negative. At return
    the KKT conditions hold to float tolerance."""
    n = a.shape[1]
    x = np.zeros(n)
    free = np.zeros(n, dtype=bool)
    tol = 1e-10 * max(1.0, float(np.abs(a.T @ b).max(initial=0.0)))
    for _ in range(max_iter or 3 * n):
        gradient = a.T @ (b - a @ x)
        wanted = ~free & (gradient > tol)
        if not wanted.any():
            break
        free[np.argmax(np.where(wanted, gradient, -np.inf))] = True
        x = _solve_free(a, b, x, free)
    return x


def _solve_free(a: np.ndarray, b: np.ndarray, x: np.ndarray, free: np.ndarray) -> np.ndarray:
    """Least squares on the `free` coefficients (the rest 0), reached from the feasible `x` by
    the longest step that keeps every coefficient >= 0; the coefficient that stops the step
    (and any other at 0) leaves `free` (updated in place) and the solve repeats."""
    while True:
        z = np.zeros_like(x)
        z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
        blocking = free & (z <= 0)
        if not blocking.any():
            return z
        gap = x - z
        ratio = np.divide(x, gap, out=np.zeros_like(x), where=blocking & (gap > 0))
        stop = int(np.argmin(np.where(blocking, ratio, np.inf)))
        x = x + ratio[stop] * (z - x)
        x[stop] = 0.0
        free &= x > 0
        x[~free] = 0.0


def relative_fit(shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepCost:
    """The non-negative StepCost that minimizes the steps' squared relative errors. Needs at
    least one step, every time positive."""
    if not shapes or len(shapes) != len(seconds) or min(seconds) <= 0:
        raise ValueError("a fit needs steps, each with a positive measured time")
    zero = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    y = np.asarray(seconds, dtype=float)
    a = np.array([zero.terms(s) for s in shapes]) / y[:, None]  # each row relative to its time
    scale = np.linalg.norm(a, axis=0)
    scale[scale == 0] = 1.0  # a term no step has stays 0
    return StepCost(*(float(c) for c in nnls(a / scale, np.ones(len(y))) / scale))


def fit_step_cost(shapes: Sequence[StepShape], seconds: Sequence[float]) -> StepFit:
    """`relative_fit` scaled so that its total over the steps is the measured total, with
    each step's prediction and the error figures."""
    step = relative_fit(shapes, seconds)
    total = sum(step.seconds(s) for s in shapes)
    if total > 0:
        factor = sum(seconds) / total
        step = StepCost(*(factor * c for c in astuple(step)))
    predicted = [step.seconds(s) for s in shapes]
    return StepFit(
        step, list(shapes), list(seconds), predicted, fit_errors(shapes, seconds, predicted)
    )


def fit_errors(
    shapes: Sequence[StepShape], measured: Sequence[float], predicted: Sequence[float]
) -> dict[str, FitError]:
    """`relative_error` over every step ("all") and over each class of step that has any."""
    out = {"all": relative_error(measured, predicted)}
    for cls in CLASSES:
        idx = [i for i, s in enumerate(shapes) if step_class(s) == cls]
        if idx:
            out[cls] = relative_error([measured[i] for i in idx], [predicted[i] for i in idx])
    return out


def store_cost(
    rtt_s: float,
    load_s: float,
    load_blocks: int,
    write_s: float,
    write_blocks: int,
    frame_bytes_per_token: float,
) -> StoreCost:
    """The StoreCost of one measured load of `load_blocks` blocks and one write of
    `write_blocks`: a call is modelled as one round trip plus a cost per block, so each
    per-block figure is (time - rtt) / blocks, never below 0."""
    return StoreCost(
        rtt_s=rtt_s,
        load_s_per_block=max(0.0, (load_s - rtt_s) / load_blocks),
        write_s_per_block=max(0.0, (write_s - rtt_s) / write_blocks),
        frame_bytes_per_token=frame_bytes_per_token,
    )
