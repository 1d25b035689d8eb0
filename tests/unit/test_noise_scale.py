"""The gradient noise scale: McCandlish's two-batch estimator on gradients drawn from a known
distribution (true gradient G, per-sequence covariance Sigma), where B_noise = tr(Sigma) / |G|^2
is known exactly; and the large-batch warnings the operator and the planner derive from it."""

from __future__ import annotations

import datetime
import math

import numpy as np
import pytest

from meshtrain.operator.policy import noise_condition, progress_status
from meshtrain.planner import estimate as plan_estimate
from meshtrain.trainer.guards import noise_scale

NOW = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)


def simulated_run(small: int, replicas: int, steps: int, seed: int = 0) -> tuple[float, float]:
    """(true noise scale, tracker's estimate) for replicas whose b-sequence gradients are G + N(0, Sigma/b)."""
    rng = np.random.default_rng(seed)
    dim = 200
    true_gradient = rng.normal(size=dim) * 0.1
    per_sequence_std = rng.uniform(0.5, 1.5, size=dim)  # diagonal Sigma
    truth = float(np.sum(per_sequence_std**2) / np.sum(true_gradient**2))
    tracker = noise_scale.Tracker(small, small * replicas)
    for _ in range(steps):
        grads = true_gradient + rng.normal(size=(replicas, dim)) * per_sequence_std / math.sqrt(
            small
        )
        small_square = float(np.mean(np.sum(grads**2, axis=1)))
        large_square = float(np.sum(grads.mean(axis=0) ** 2))
        tracker.update(small_square, large_square)
    assert tracker.value is not None
    return truth, tracker.value


@pytest.mark.parametrize("small,replicas", [(2, 8), (8, 2), (4, 64)])
def test_the_tracker_finds_the_known_noise_scale(small, replicas):
    truth, found = simulated_run(small, replicas, steps=400)
    assert found == pytest.approx(truth, rel=0.25)


def test_one_step_estimates_are_unbiased():
    # The paper's estimators: averaged over many steps, each equals its true value.
    rng = np.random.default_rng(1)
    gradient = np.full(50, 0.2)
    sigma = np.full(50, 1.0)
    small, large = 4, 16
    estimates = []
    for _ in range(4000):
        grads = gradient + rng.normal(size=(4, 50)) * sigma / math.sqrt(small)
        estimates.append(
            noise_scale.estimate(
                float(np.mean(np.sum(grads**2, axis=1))),
                float(np.sum(grads.mean(axis=0) ** 2)),
                small,
                large,
            )
        )
    assert np.mean([e.gradient_square for e in estimates]) == pytest.approx(50 * 0.04, rel=0.1)
    assert np.mean([e.trace for e in estimates]) == pytest.approx(50.0, rel=0.05)


def test_non_finite_steps_are_ignored_and_bad_batches_refused():
    tracker = noise_scale.Tracker(2, 4)
    assert tracker.update(float("nan"), 1.0) is None
    with pytest.raises(ValueError, match="small batch < large batch"):
        noise_scale.estimate(1.0, 1.0, 4, 4)


def test_operator_condition_turns_true_far_above_the_noise_scale_and_warns_once():
    conds, warning = noise_condition.changes([], 4096, 100.0, 40, NOW)
    [found] = conds
    assert found["type"] == "BatchAboveNoiseScale" and found["status"] == "True"
    assert warning is not None and "41x the measured gradient noise scale 100" in warning
    conds, again = noise_condition.changes(conds, 4096, 90.0, 40, NOW)
    assert again is None  # still True: no second Event
    conds, quiet = noise_condition.changes(conds, 512, 100.0, 40, NOW)
    assert quiet is None and conds[0]["status"] == "False"
    assert noise_condition.changes([], 4096, None, 40, NOW) == ([], None)


def test_progress_report_carries_the_noise_scale_into_status():
    changes = progress_status.status_changes(
        {"step": 5, "gradient_noise_scale": 321.5, "updated_at": "2026-01-01T00:00:00Z"}
    )
    assert changes["progress"]["gradientNoiseScale"] == 321.5
    assert "gradientNoiseScale" not in progress_status.status_changes({"step": 5})["progress"]
    # a polled gang without an estimate clears the previous gang's (null in the merge patch)
    assert progress_status.polled_changes({"step": 5})["progress"]["gradientNoiseScale"] is None
    assert progress_status.polled_changes({"step": 0, "updated_at": None}) == {}


def test_the_noise_condition_waits_for_warm_up_and_does_not_flap_near_the_threshold():
    early, _ = noise_condition.changes([], 4096, 100.0, noise_condition.WARMUP_STEPS - 1, NOW)
    assert early == []
    far, warning = noise_condition.changes([], 1000, 90.0, noise_condition.WARMUP_STEPS, NOW)
    assert far[0]["status"] == "True" and warning is not None  # 11x
    held, _ = noise_condition.changes(far, 1000, 110.0, 40, NOW)  # 9.1x: inside the band
    assert held[0]["status"] == "True"
    near, _ = noise_condition.changes(held, 1000, 130.0, 41, NOW)  # 7.7x: below it
    assert near[0]["status"] == "False"
    fresh, _ = noise_condition.changes([], 1000, 110.0, 40, NOW)  # 9.1x with no condition yet
    assert fresh[0]["status"] == "False"


def test_planner_warns_against_the_measured_noise_scale_when_there_is_one():
    measured = plan_estimate.BatchCheck(
        sequences=2048, tokens=2048 * 1024, critical_tokens=4 * 2**20, noise_scale=64.0
    )
    assert (
        measured.warning is not None
        and "32x the job's measured gradient noise scale" in measured.warning
    )
    near = plan_estimate.BatchCheck(2048, 2048 * 1024, 1, noise_scale=1024.0)
    assert near.warning is None  # the measured value replaces the token threshold
    unmeasured = plan_estimate.BatchCheck(2048, 2048 * 1024, 1)
    assert unmeasured.warning is not None and "critical batch size" in unmeasured.warning
