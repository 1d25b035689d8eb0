"""The loss guard's policy, step by step."""

from __future__ import annotations

import math

import pytest

from meshtrain.trainer.guards import loss_guard


def _guard(**kw):
    return loss_guard.LossGuard(
        spike_factor=kw.get("spike", 0.0),
        window=kw.get("window", 3),
        max_consecutive_skips=kw.get("k", 3),
    )


@pytest.mark.parametrize(
    ("loss", "norm", "reason"),
    [
        (math.nan, 1.0, "loss is nan"),
        (math.inf, 1.0, "loss is inf"),
        (2.0, math.nan, "gradient norm is nan"),
    ],
)
def test_non_finite_loss_or_norm_is_skipped(loss, norm, reason):
    verdict = _guard().judge(loss, norm)
    assert verdict.skip and verdict.reason == reason


def test_spike_is_measured_against_the_median_of_a_full_window():
    guard = _guard(spike=2.0, window=3)
    assert not guard.judge(100.0, 1.0).skip  # window not full: no spike test yet
    for loss in (4.0, 5.0):
        assert not guard.judge(loss, 1.0).skip
    verdict = guard.judge(10.5, 1.0)  # median of (100, 4, 5) is 5
    assert verdict.skip and "median 5" in verdict.reason
    assert not guard.judge(9.9, 1.0).skip


def test_k_skips_in_a_row_trip_and_an_accepted_step_resets_the_count():
    guard = _guard(k=3)
    guard.judge(math.nan, 1.0)
    guard.judge(math.nan, 1.0)
    guard.judge(2.0, 1.0)  # resets
    guard.judge(math.nan, 1.0)
    guard.judge(math.nan, 1.0)
    with pytest.raises(loss_guard.LossGuardTripped, match="3 consecutive updates skipped"):
        guard.judge(math.nan, 1.0)
    assert guard.skipped_total == 5


def test_state_round_trips():
    guard = _guard(spike=2.0)
    for loss in (3.0, 4.0, math.nan):
        guard.judge(loss, 1.0)
    fresh = _guard(spike=2.0)
    fresh.load_state_dict(guard.state_dict())
    assert (
        fresh.state_dict()
        == guard.state_dict()
        == {
            "recent": [3.0, 4.0],
            "skipped_total": 1,
            "consecutive": 1,
        }
    )
