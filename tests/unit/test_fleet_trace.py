"""The fleet benchmark's pure parts: the KWOK fleet's labels and Stages, and the seeded trace whose
jobs are valid TrainingJobs (the real spec model judges them) whose pods fill 8-GPU nodes."""

from __future__ import annotations

import dataclasses
import math
import pathlib
import statistics

import pytest

from benchmarks.fleet import kwok, observe, trace
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import reservation

REPO = pathlib.Path(__file__).resolve().parents[2]
SHAPE = kwok.Shape(nodes=1024)


def test_kwok_version_is_the_one_the_bootstrap_builds() -> None:
    text = (REPO / "scripts" / "bootstrap.sh").read_text()
    assert f'KWOK_VERSION="${{MESHTRAIN_KWOK_VERSION:-{kwok.DEFAULT_KWOK_VERSION}}}"' in text
    assert "build_kwok" in text


def test_nodes_nest_in_cliques_racks_and_blocks() -> None:
    labels = [SHAPE.labels(i) for i in range(SHAPE.nodes)]
    racks = {}
    for found in labels:  # every rack lies in one block, every clique in one rack
        assert (
            racks.setdefault(found[kwok.RACK_LABEL], found[kwok.BLOCK_LABEL])
            == found[kwok.BLOCK_LABEL]
        )
    cliques = {}
    for found in labels:
        assert (
            cliques.setdefault(found[kwok.CLIQUE_LABEL], found[kwok.RACK_LABEL])
            == found[kwok.RACK_LABEL]
        )
    assert dict(kwok.domains(SHAPE)) == {
        kwok.BLOCK_LABEL: len(set(racks.values())),
        kwok.RACK_LABEL: len(racks),
        kwok.CLIQUE_LABEL: len(cliques),
    }
    assert len(set(racks.values())) == 2  # 1,024 nodes: two blocks of 4,096 GPUs


def test_a_clique_that_would_cross_a_rack_is_refused() -> None:
    with pytest.raises(ValueError, match="nodes_per_clique"):
        kwok.Shape(nodes=64, nodes_per_rack=32, nodes_per_clique=5)


def test_jobs_name_the_fleet_labels_as_their_topology() -> None:
    """The GPU-cloud labels (Kueue TAS's) are no family the placement detects: each job names them."""
    node = kwok.node(SHAPE, 0)
    assert node["metadata"]["annotations"] == {kwok.MANAGED[0]: kwok.MANAGED[1]}
    job = next(trace.jobs(trace.Trace(SHAPE)))
    topology = api_spec.TrainingJobSpec.model_validate(job.spec()).topology
    assert [level.label for level in topology.levels] == [kwok.BLOCK_LABEL, kwok.RACK_LABEL]
    assert topology.nvlink_domain_label == kwok.CLIQUE_LABEL
    assert set(node["metadata"]["labels"]) >= {kwok.BLOCK_LABEL, kwok.RACK_LABEL, kwok.CLIQUE_LABEL}


def test_one_stage_ends_each_kind_of_pod() -> None:
    """Each lifecycle's pod is matched by exactly one ending Stage (KWOK picks among matches)."""
    pods = [s for s in kwok.stages() if s["spec"]["resourceRef"]["kind"] == "Pod"]
    ending = [s for s in pods if s["metadata"]["name"] not in ("pod-run", "pod-delete")]
    cases = {
        ("Succeeded", "0"): "pod-succeed",
        ("Succeeded", "1"): "pod-succeed",
        ("Failed", "0"): "pod-fail",
        ("Failed", "2"): "pod-succeed-after-restart",
    }
    for (outcome, attempt), stage in cases.items():
        matched = [s["metadata"]["name"] for s in ending if _matches(s, outcome, attempt)]
        assert matched == [stage], (outcome, attempt)


def _matches(stage: dict, outcome: str, attempt: str) -> bool:
    values = {
        f'.metadata.annotations["{kwok.OUTCOME}"]': outcome,
        f'.metadata.labels["{kwok.ATTEMPT_LABEL}"]': attempt,
        ".status.phase": "Running",
    }
    for rule in stage["spec"]["selector"]["matchExpressions"]:
        if rule["key"] not in values:
            continue
        inside = values[rule["key"]] in rule["values"]
        if inside != (rule["operator"] == "In"):
            return False
    return True


def test_the_same_seed_gives_the_same_trace() -> None:
    first, again = trace.Trace(SHAPE), trace.Trace(SHAPE)
    assert list(trace.jobs(first)) == list(trace.jobs(again))
    assert list(trace.jobs(first)) != list(trace.jobs(trace.Trace(SHAPE, seed=7)))


def test_jobs_are_valid_training_jobs_whose_pods_fill_nodes() -> None:
    jobs = list(trace.jobs(trace.Trace(SHAPE)))
    assert {j.gpus for j in jobs} <= set(trace.SIZES)
    assert max(j.gpus for j in jobs) == 4096
    for job in {j.gpus: j for j in jobs}.values():  # one of each size
        spec = api_spec.TrainingJobSpec.model_validate(job.spec())
        assert spec.resources.gpus_per_node == kwok.GPUS_PER_NODE
        assert spec.parallelism.world_size == job.gpus
        assert spec.parallelism.tensor == kwok.GPUS_PER_NODE  # tensor groups stay in a node
        assert spec.pod.annotations[kwok.RUN_FOR] == f"{job.run_seconds:.3f}s"


def test_most_jobs_are_small_but_most_gpu_time_is_large() -> None:
    jobs = list(trace.jobs(trace.Trace(SHAPE)))
    small = sum(j.gpus == 8 for j in jobs) / len(jobs)
    gpu_time = [j.gpus * j.run_seconds for j in jobs]
    large = sum(t for j, t in zip(jobs, gpu_time, strict=True) if j.gpus >= 256) / sum(gpu_time)
    assert small > 0.4 and large > 0.5, (small, large)


def test_failures_follow_the_series_model() -> None:
    """Share of jobs that fail, by size, near 1 - E[exp(-nodes * r_f * duration)]."""
    long_run = trace.Trace(SHAPE, wall_seconds=6 * 3600)
    jobs = [j for j in trace.jobs(long_run) if j.gpus == 512]
    failed = sum(j.fail_after is not None for j in jobs) / len(jobs)
    rate = 64 * trace.FAILURES_PER_NODE_DAY / 24  # per cluster hour
    expected = statistics.mean(
        1 - math.exp(-rate * j.run_seconds * long_run.compression / 3600) for j in jobs
    )
    assert abs(failed - expected) < 0.05, (failed, expected)
    assert all(j.fail_after < j.run_seconds for j in jobs if j.fail_after is not None)


def test_time_limits_leave_the_jobs_alone_and_bound_each_run_loosely() -> None:
    """With ``time_limits`` the same jobs declare ``activeDeadlineSeconds``: whole cluster hours
    from 1.5x to 4x their run (a failed attempt's included), never less than the run."""
    plain = list(trace.jobs(trace.Trace(SHAPE)))
    limited = list(trace.jobs(trace.Trace(SHAPE, time_limits=True)))
    assert [dataclasses.replace(j, limit_seconds=None) for j in limited] == plain
    hour = 3600 / trace.Trace(SHAPE).compression
    low, high = trace.LIMIT_FACTORS
    for job in limited:
        assert job.limit_seconds is not None
        ran = job.run_seconds + (job.fail_after or 0.0)
        assert low * ran <= job.limit_seconds + 1 and job.limit_seconds <= high * ran + hour + 1
        assert job.limit_seconds % round(hour) == 0  # whole cluster hours
        spec = api_spec.TrainingJobSpec.model_validate(job.spec())
        assert spec.run_policy.active_deadline_seconds == job.limit_seconds
    factors = [j.limit_seconds / (j.run_seconds + (j.fail_after or 0.0)) for j in limited]
    assert statistics.median(factors) > 2.0  # loose bounds, as users' are
    assert all(j.limit_seconds is None for j in plain)


def test_the_churn_benchmark_reads_the_bound_the_holders_event_states() -> None:
    """The bound is read from the operator's own event text (``reservation.described``): a change
    of its wording that the benchmark no longer reads fails here, not silently in a 30-minute run."""
    clear = 1_800_000_000.0
    kept = reservation.Reservation("uid", frozenset({"n1", "n2"}), (0, 0), 0.0, clear=clear + 0.2)
    assert observe.stated_bound(reservation.described(kept)) == clear + 1  # never said early
    unknown = dataclasses.replace(kept, clear=None)
    assert observe.stated_bound(reservation.described(unknown)) is None


def test_each_holding_period_is_judged_by_the_earliest_time_its_events_said() -> None:
    """Three holders' Events in order, times in seconds: a holds, b takes over, a holds again.
    Each period is judged alone, by the earliest time said in it: a started within the allowance
    of its second period's time; b's time passed while it still held and it never ran; c's time
    was after its hold passed on.  A later time said is counted."""
    allowance = observe.START_ALLOWANCE_SECONDS
    stated = [
        observe.Stated(10, "a", 500),
        observe.Stated(40, "a", 700),  # later than before
        observe.Stated(100, "b", 200),
        observe.Stated(400, "a", 600),
        observe.Stated(700, "c", None),
        observe.Stated(710, "c", 2000),
        observe.Stated(900, "d", 950),
    ]
    ran = {"a": 600 + allowance, "b": None, "c": None, "d": None}
    found = observe.holds(stated, ran, origin=0, end=1000)
    first, again = found["a"]
    assert (first["from"], first["until"], first["earliest"], first["later"]) == (10, 100, 500, 1)
    assert first["verdict"] == "passed on"  # it held until 100, its time was 500
    assert (again["verdict"], again["late"]) == ("kept", allowance)
    assert (found["b"][0]["verdict"], found["b"][0]["late"]) == ("broken", 400 - 200)
    assert found["c"][0]["verdict"] == "passed on" and found["c"][0]["earliest"] == 2000
    assert found["d"][0]["verdict"] == "run ended"  # before 950 + the allowance
    assert observe.holds([observe.Stated(0, "e", None)], {}, 0, 10)["e"][0]["verdict"] == "no time"
