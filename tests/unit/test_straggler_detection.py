"""runPolicy.stragglerPolicy: the trainer's detector (pure) and the spec's refusals."""

from __future__ import annotations

import random
import statistics

import numpy as np
import pytest

from meshtrain.api import layout as layout_mod
from meshtrain.api import loading
from meshtrain.trainer.guards import stragglers
from meshtrain.trainer.telemetry import progress
from meshtrain.trainer.telemetry.recorder import make_recorder
from tests.builders import JobBuilder
from tests.unit.test_telemetry_exporter import families, free_base


def dp(data):
    return layout_mod.ParallelLayout(data=data, pipeline=1, tensor=1)


def feed(detector, steps, base, slow_rank=None, factor=1.0, from_step=1, noise=0.0, seed=0):
    """Feed ``steps`` steps of compute times; return the first step at which slow_rank was flagged."""
    rng = random.Random(seed)
    world = len(base)
    first = None
    for step in range(1, steps + 1):
        times = [base[r] * (1 + rng.uniform(-noise, noise)) for r in range(world)]
        if slow_rank is not None and step >= from_step:
            times[slow_rank] *= factor
        detector.observe(step, times)
        if first is None and slow_rank is not None and detector.verdict(step).is_flagged(slow_rank):
            first = step
    return first


def test_a_rank_slowed_1_5x_is_flagged_after_just_over_half_a_window():
    layout = layout_mod.ParallelLayout(data=4, pipeline=1, tensor=1)
    detector = stragglers.Detector(layout, threshold=1.25, window=20)
    first = feed(detector, 60, [0.1] * 4, slow_rank=2, factor=1.5, from_step=21, noise=0.05)
    # Ratios are judged by their median: the 11th slow step of 20 tips it.
    assert first == 21 + 10
    verdict = detector.verdict(60)
    assert [f.rank for f in verdict.flagged] == [2]
    assert verdict.worst.slowdown == pytest.approx(1.5, rel=0.1)
    assert verdict.worst.since_step == 31
    assert all(abs(verdict.slowdowns[r] - 1) < 0.1 for r in (0, 1, 3))


def test_two_replicas_compare_with_each_other_not_with_their_mean():
    # The mean of 1.0 and 1.5 would make the slow one only 1.2x; its peer's median says 1.5x.
    detector = stragglers.Detector(dp(2), threshold=1.25, window=8)
    feed(detector, 8, [1.0, 1.0], slow_rank=1, factor=1.5)
    verdict = detector.verdict(8)
    assert verdict.slowdowns[1] == pytest.approx(1.5)
    assert verdict.slowdowns[0] == pytest.approx(1 / 1.5)
    assert [f.rank for f in verdict.flagged] == [1]


def test_peers_are_the_data_parallel_group_so_unequal_stages_are_not_stragglers():
    # dp2·pp2: stage 1 computes twice as long as stage 0 (the loss, the head), which is normal.
    layout = layout_mod.ParallelLayout(data=2, pipeline=2, tensor=1)
    detector = stragglers.Detector(layout, threshold=1.25, window=8)
    base = [0.0] * 4
    for rank in range(4):
        base[rank] = 0.2 if layout.coords(rank).pp == 1 else 0.1
    assert feed(detector, 30, base, noise=0.02) is None
    assert detector.verdict(30).flagged == ()
    assert detector.verdict(30).slowdowns == pytest.approx([1.0] * 4, rel=0.05)


def test_transient_slow_steps_and_a_slowdown_below_the_threshold_are_not_flagged():
    layout = dp(4)
    spiky = stragglers.Detector(layout, threshold=1.25, window=10)
    for step in range(1, 51):
        times = [0.1] * 4
        if step % 3 == 0:  # one slow step in three, e.g. a checkpoint's page cache
            times[1] = 0.3
        spiky.observe(step, times)
    assert spiky.verdict(50).flagged == ()
    mild = stragglers.Detector(layout, threshold=1.25, window=10)
    assert feed(mild, 50, [0.1] * 4, slow_rank=0, factor=1.2) is None


def test_a_rank_that_recovers_is_no_longer_flagged():
    detector = stragglers.Detector(dp(3), threshold=1.25, window=6)
    feed(detector, 10, [0.1] * 3, slow_rank=0, factor=2.0)
    assert detector.verdict(10).is_flagged(0)
    for step in range(11, 20):
        detector.observe(step, [0.1] * 3)
    assert not detector.verdict(19).is_flagged(0)


def test_a_step_some_rank_has_not_reported_is_skipped_and_no_peers_judge_nothing():
    detector = stragglers.Detector(dp(2), threshold=1.25, window=4)
    detector.observe(0, [0.0, 0.0])  # the first step of a run: nothing before it
    assert detector.verdict(0).slowdowns == (None, None)
    alone = stragglers.Detector(
        layout_mod.ParallelLayout(data=1, pipeline=2, tensor=1), threshold=1.25, window=4
    )
    assert not alone.judged
    alone.observe(1, [0.1, 0.5])
    assert alone.verdict(1).slowdowns == (None, None)
    with pytest.raises(ValueError, match="compute times for a world of 2"):
        detector.observe(1, [0.1])


def test_the_detector_refuses_a_threshold_that_flags_everyone():
    with pytest.raises(ValueError, match="threshold=1.0 must be above 1"):
        stragglers.Detector(dp(2), threshold=1.0, window=4)


def job(data=2, claim="ckpt", **policy):
    builder = JobBuilder().layout(data=data).run_policy(stragglerPolicy=policy)
    if claim:
        builder.checkpoint(claimName=claim)
    return builder.raw()


def problems(raw):
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(raw)
    return err.value.problems


def test_defaults_report_at_1_25_over_20_steps():
    policy = loading.parse_spec(JobBuilder().raw()).run_policy.straggler_policy
    assert (policy.action, policy.threshold, policy.window, policy.max_replacements) == (
        "report",
        1.25,
        20,
        3,
    )


@pytest.mark.parametrize("threshold", [1, 1.0, 0.9, 0])
def test_a_threshold_not_above_one_is_refused_naming_the_field(threshold):
    [problem] = problems(job(threshold=threshold))
    assert problem.path == "spec.runPolicy.stragglerPolicy.threshold"
    assert "greater than 1" in problem.message


@pytest.mark.parametrize(
    ("policy", "path", "words"),
    [
        ({"window": 3}, "spec.runPolicy.stragglerPolicy.window", "greater than or equal to 4"),
        ({"action": "evict"}, "spec.runPolicy.stragglerPolicy.action", "'replace'"),
        ({"maxReplacements": -1}, "spec.runPolicy.stragglerPolicy.maxReplacements", "0"),
    ],
)
def test_other_bad_values_are_refused_naming_the_field(policy, path, words):
    [problem] = problems(job(**policy))
    assert problem.path == path
    assert words in problem.message


def test_replace_needs_data_parallel_peers():
    [problem] = problems(job(data=1, action="replace"))
    assert problem.path == "spec.runPolicy.stragglerPolicy.action"
    assert "parallelism.data=1" in problem.message and "data >= 2" in problem.message


def test_replace_needs_a_checkpoint_volume_the_next_nodes_can_mount():
    [problem] = problems(job(claim=None, action="replace"))
    assert problem.path == "spec.checkpoint.claimName"
    assert "restart from step 0" in problem.message
    assert loading.parse_spec(job(action="replace")).run_policy.straggler_policy.action == "replace"
    assert loading.parse_spec(job(data=1, claim=None, action="report"))


def test_each_rank_exports_its_slowdown_with_rank_and_node_and_rank_zero_reports_the_straggler(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("MESHTRAIN_JOB_NAME", "slow")
    monkeypatch.setenv("MESHTRAIN_NODE_NAME", "gpu-node-7")
    base = free_base(2)
    layout = dp(2)
    spec = loading.parse_spec(JobBuilder().layout(data=2).metrics(port=base).raw())
    recorders = [make_recorder(spec, layout, rank, tmp_path, local_rank=rank) for rank in (0, 1)]
    try:
        detector = stragglers.Detector(layout, threshold=1.25, window=4)
        for step in range(1, 5):
            detector.observe(step, [0.1, 0.2])
            for recorder in recorders:
                recorder.straggler_verdict(detector.verdict(step))
        for rank in (0, 1):
            fams = families(base, rank)
            [ratio] = fams["meshtrain_rank_slowdown_ratio"].samples
            [flag] = fams["meshtrain_rank_straggler"].samples
            assert ratio.labels["rank"] == flag.labels["rank"] == str(rank)
            assert ratio.labels["node"] == flag.labels["node"] == "gpu-node-7"
            assert ratio.value == pytest.approx(2.0 if rank == 1 else 0.5)
            assert flag.value == (1.0 if rank == 1 else 0.0)
        document = recorders[0].progress.document()
        assert document["straggler"] == {"rank": 1, "slowdown": 2.0, "since_step": 4}
        assert recorders[1].progress is None
    finally:
        for recorder in recorders:
            recorder.close()


@pytest.mark.parametrize("size", [2, 3, 4, 7])
def test_leave_one_out_medians_match_the_median_of_the_other_replicas(size):
    rng = random.Random(size)
    rows = [[rng.choice([0.1, 0.2, rng.random()]) for _ in range(size)] for _ in range(5)]
    expected = [[statistics.median(row[:i] + row[i + 1 :]) for i in range(size)] for row in rows]
    got = stragglers.leave_one_out_medians(np.array(rows))
    assert got.ravel().tolist() == pytest.approx([m for row in expected for m in row])


def test_a_flagged_rank_near_the_threshold_stays_flagged_until_clearly_below_it():
    detector = stragglers.Detector(dp(4), threshold=1.3, window=4)
    for step, factor in enumerate([1.4] * 4 + [1.28] * 4 + [1.31] * 4 + [1.2] * 4, start=1):
        detector.observe(step, [0.1, 0.1, 0.1 * factor, 0.1])
        flagged = detector.verdict(step).is_flagged(2)
        if step < 4:
            assert not flagged
        elif step <= 12:  # 1.28 is under 1.3 but not under 1.3 - margin: no flip, no Event pair
            assert flagged and detector.flags()[0].since_step == 4, step
        elif step >= 15:
            assert not flagged, step


def test_progress_reports_every_flagged_rank_slowest_first():
    detector = stragglers.Detector(dp(4), threshold=1.25, window=4)
    for step in range(1, 5):
        detector.observe(step, [0.1, 0.2, 0.1, 0.3])
    report = progress.Progress()
    report.straggler_verdict(detector.verdict(4))
    document = report.document()
    assert [f["rank"] for f in document["stragglers"]] == [3, 1]
    assert document["stragglers"][0]["slowdown"] > document["stragglers"][1]["slowdown"] > 1.25
    assert document["straggler"] == document["stragglers"][0]
    report.straggler_verdict(stragglers.Detector(dp(4), threshold=1.25, window=4).verdict(5))
    assert report.document()["stragglers"] == [] and report.document()["straggler"] is None
