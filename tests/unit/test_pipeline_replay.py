"""The pipeline replay with shared cores against timelines worked out by hand.

Two stages, four micro-batches, forward 1 CPU second and backward 2 per
micro-batch on each stage, free sends.  The expectations are the
hand-drawn timelines below, not the replay's arithmetic.
"""

from __future__ import annotations

import pytest

from meshtrain.planner.timing import pipeline_replay, pipeline_window

STAGES = [pipeline_window.StageDurations(forward=1.0, backward=2.0)] * 2
FREE = pipeline_replay.Messages(activations=0.0, gradients=0.0)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_dedicated_cores_give_the_closed_form(schedule: str) -> None:
    # Two single-thread ranks on two cores: each owns a core.  Huang et al. 2019:
    # window (m + p - 1) (f + b) = 5 x 3, stage 0 idle (p - 1) / (m + p - 1) = 0.2.
    window = pipeline_replay.replay(
        schedule, 4, STAGES, FREE, pipeline_replay.Sharing(cores=2, threads=1)
    )
    assert window.seconds == pytest.approx(15.0)
    assert window.idle_share(0) == pytest.approx(0.2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_one_core_shared_by_two_stages(schedule: str) -> None:
    # One core for both ranks.  Work conservation: 24 CPU seconds on a core that
    # is never idle while either stage can run -> a 24 s window.  Stage 0 idles
    # only while stage 1 runs alone, at the whole core:
    #   1F1B:  F1 of stage 0 alone [0,1]; F2 (s0) with F1 (s1) at half speed [1,3];
    #          B1 (s1) alone [3,5] (s0 waits); ... B4 (s1) finishes alone [21,22];
    #          B4 (s0) alone [22,24]  -> idle 2 + 1 = 3 s.
    #   GPipe: forwards pair up until F4 (s1) alone [7,8]; B1 (s1) alone [8,10];
    #          backwards pair up [10,22]; B4 (s0) alone [22,24] -> idle 1 + 2 = 3 s.
    # Bubble 3 / 24 = 0.125, below the dedicated 0.2: the waiting stage's core
    # served the other one.
    window = pipeline_replay.replay(
        schedule, 4, STAGES, FREE, pipeline_replay.Sharing(cores=1, threads=1)
    )
    assert window.seconds == pytest.approx(24.0)
    assert window.idle_share(0) == pytest.approx(0.125)


def test_replicas_share_the_cores_with_their_stage() -> None:
    # dp2 x pp2 on two cores: four ranks, two per stage.  While both stages run
    # each rank has half a core, while one runs its two ranks have a core each:
    # the same timeline as two ranks on one core, so the same 24 s and 0.125.
    window = pipeline_replay.replay(
        "1f1b", 4, STAGES, FREE, pipeline_replay.Sharing(cores=2, threads=1), replicas=2
    )
    assert window.seconds == pytest.approx(24.0)
    assert window.idle_share(0) == pytest.approx(0.125)


@pytest.mark.parametrize(
    ("activations", "gradients", "window_seconds"),
    [
        # GPipe on dedicated cores, 0.5 s per message both ways: stage 1's F1 starts
        # at 1.5, its forwards end at 5.5 (it never waits again: stage 0's F4 arrives
        # at 4.5), its backwards run [5.5, 13.5]; stage 0's B_i may start at the end
        # of stage 1's B_i + 0.5: 8, then back to back until 16.
        (0.5, 0.5, 16.0),
        # Free activations: stage 1's forwards end at 5, its backwards at 7, 9, 11,
        # 13; stage 0's B_i starts 0.5 after each (7.5 ... 13.5), so B4 ends at 15.5.
        (0.0, 0.5, 15.5),
    ],
)
def test_messages_delay_each_hop(
    activations: float, gradients: float, window_seconds: float
) -> None:
    window = pipeline_replay.replay(
        "gpipe",
        4,
        STAGES,
        pipeline_replay.Messages(activations=activations, gradients=gradients),
        pipeline_replay.Sharing(cores=2, threads=1),
    )
    assert window.seconds == pytest.approx(window_seconds)
    assert window.busy == (pytest.approx(12.0), pytest.approx(12.0))


def test_loop_work_between_actions_is_not_compute() -> None:
    # GPipe on dedicated cores, 0.5 CPU s of loop before every action, which may only
    # start once its input is there.  Stage 0's forwards end at 6 (four 0.5 + 1 slots);
    # stage 1 starts each forward 0.5 after it arrives, so its F4 ends at 7.5 and its
    # backwards (2.5 each) at 10, 12.5, 15, 17.5; stage 0 starts each backward 0.5
    # after stage 1's: B4 ends at 17.5 + 0.5 + 2 = 20.  Stage 0 computes 12 of those
    # 20 seconds: a bubble of 0.4 (0.2 without the loop).
    window = pipeline_replay.replay(
        "gpipe", 4, STAGES, FREE, pipeline_replay.Sharing(cores=2, threads=1), between=0.5
    )
    assert window.seconds == pytest.approx(20.0)
    assert window.busy[0] == pytest.approx(12.0)
    assert window.idle_share(0) == pytest.approx(0.4)


def test_loop_work_inside_the_actions_is_compute() -> None:
    # The same 0.5 CPU s of loop per action as above, but run inside each action
    # (the planner charges calibration's measured share outside every event between
    # actions, the rest inside): forward 1.5, backward 2.5 on dedicated cores.
    # Closed form (Huang et al. 2019): window (m + p - 1)(f + b) = 5 x 4 = 20, the
    # same 20 s as with the loop between, but stage 0 now computes 4 x 4 = 16 of
    # them: a bubble of 0.2 instead of 0.4.
    inside = [pipeline_window.StageDurations(forward=1.5, backward=2.5)] * 2
    window = pipeline_replay.replay(
        "gpipe", 4, inside, FREE, pipeline_replay.Sharing(cores=2, threads=1)
    )
    assert window.seconds == pytest.approx(20.0)
    assert window.busy[0] == pytest.approx(16.0)
    assert window.idle_share(0) == pytest.approx(0.2)
