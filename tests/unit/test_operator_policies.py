"""Small operator policies: conditions, usage from pods, progress reports, CLI flags."""

from __future__ import annotations

import datetime

import pytest

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.api.spec import status as api_status
from meshtrain.cli import main
from meshtrain.operator import command, planning
from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import builders, capacity, conditions, identity, progress_status
from meshtrain.planner import profiles
from tests.builders import JobBuilder

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
T1 = T0 + datetime.timedelta(minutes=5)


@pytest.mark.parametrize(
    ("old_status", "new_status", "keeps_time"),
    [
        ("True", "True", True),
        ("False", "True", False),
        ("True", "False", False),
    ],
)
def test_condition_transition_time_changes_only_with_status(old_status, new_status, keeps_time):
    before = conditions.set([], "Placed", old_status, "A", "first", T0)
    after = conditions.set(before, "Placed", new_status, "B", "second", T1)
    assert len(after) == 1 and after[0]["reason"] == "B" and after[0]["message"] == "second"
    expected = conditions.timestamp(T0 if keeps_time else T1)
    assert after[0]["lastTransitionTime"] == expected
    assert before[0]["reason"] == "A"  # the input is not mutated


def test_condition_set_keeps_other_types_in_order():
    conds = conditions.set(
        conditions.set([], "Placed", "True", "A", "", T0), "Running", "True", "B", "", T0
    )
    conds = conditions.set(conds, "Placed", "False", "C", "", T1)
    assert [c["type"] for c in conds] == ["Placed", "Running"]


def _pod(name, node, gpus, phase="Pending", job=None, namespace="ns", bound=False):
    spec = loading.parse_spec(
        JobBuilder().resources(gpusPerNode=gpus).layout(data=gpus, gpus_per_node=gpus).raw()
    )
    manifest = builders.build_pod(identity.JobRef(job or name, namespace, "u"), spec, 0, 0, node)
    manifest["metadata"]["name"] = name
    if bound:
        manifest["spec"]["nodeName"] = node
    manifest["status"] = {"phase": phase}
    return manifest


def test_usage_comes_from_bound_pods_and_the_gated_pods_of_live_jobs():
    pods = [
        _pod("a", "n1", 4, job="a"),  # gated, planned onto n1, but no live job "a" owns it
        _pod("b", "n1", 2, phase="Running", job="b", bound=True),
        _pod("c", "n2", 8, phase="Succeeded", job="c", bound=True),  # finished: frees its GPUs
        _pod("mine", "n2", 8, job="me"),  # left out: the job being planned
        _pod("live-r0-0", "n3", 4, job="live"),  # gated, its live job "live" placed it on n3
    ]
    cache = informer.Cache()
    for version, pod in enumerate(pods):
        cache.pods.upsert({**pod, "metadata": {**pod["metadata"], "resourceVersion": str(version)}})
    for name, node in (("me", "n2"), ("live", "n3")):
        placed = {"restarts": 0, "placement": [{"podIndex": 0, "node": node}]}
        cache.jobs.upsert(
            {"metadata": {"name": name, "namespace": "ns", "uid": "u"}, "status": placed}
        )
    used = cache.usage(without=cache.job_pods("ns", "me"))
    taken = {node: used[node].requested.get("nvidia.com/gpu", 0) for node in used}
    assert {node: gpus for node, gpus in taken.items() if gpus} == {"n1": 2, "n3": 4}
    nodes = [
        placement.node_from_manifest(
            {
                "metadata": {"name": n, "labels": {"x": "y"}},
                "status": {"allocatable": {"nvidia.com/gpu": "8"}},
            },
            "nvidia.com/gpu",
        )
        for n in ("n1", "n2")
    ]
    assert nodes[0].allocatable_gpus == 8 and nodes[0].labels == {"x": "y"}


def test_only_the_current_attempts_live_pods_count_as_freed_by_replacing():
    job = identity.JobRef("j", "ns", "uid-1")
    spec = loading.parse_spec(JobBuilder().layout(data=2, gpus_per_node=1).raw())
    current = builders.build_pod(job, spec, 1, 0, "n1")
    deleting = builders.build_pod(job, spec, 1, 1, "n2")
    deleting["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    earlier = builders.build_pod(job, spec, 0, 0, "n3")  # an older gang's pod, still there
    freed = capacity.freed_by_replacing([current, deleting, earlier], attempt=1)
    assert [p["metadata"]["name"] for p in freed] == [current["metadata"]["name"]]
    leaving = capacity.still_leaving([current, deleting, earlier], attempt=1)
    assert [p["metadata"]["name"] for p in leaving] == ["j-r1-1", "j-r0-0"]


def test_progress_report_to_status():
    report = {
        "step": 42,
        "loss": 2.5,
        "tokens_per_second": 1000,
        "last_checkpoint_step": 40,
        "updated_at": "2026-01-01T12:00:00Z",
    }
    assert progress_status.status_changes(report) == {
        "progress": {
            "step": 42,
            "loss": 2.5,
            "tokensPerSecond": 1000.0,
            "updatedAt": "2026-01-01T12:00:00Z",
        },
        "lastCheckpointStep": 40,
    }


def test_validation_loss_and_skipped_updates_reach_the_status():
    report = {"step": 7, "loss": 2.5, "eval_loss": 2.75, "skipped_updates": 2, "updated_at": "t"}
    assert progress_status.status_changes(report)["progress"] == {
        "step": 7,
        "loss": 2.5,
        "evalLoss": 2.75,
        "skippedUpdates": 2,
        "updatedAt": "t",
    }
    status = api_status.TrainingJobStatus.model_validate(progress_status.status_changes(report))
    assert (status.progress.eval_loss, status.progress.skipped_updates) == (2.75, 2)


@pytest.mark.parametrize(
    "report",
    [
        {},
        {"step": "x"},
        {"step": -1},
        {"step": True},
        {"step": 0, "loss": None, "last_checkpoint_step": None, "updated_at": None},
    ],
)
def test_unusable_progress_reports_change_nothing(report):
    assert progress_status.status_changes(report) == {}


def test_operator_cli_flags():
    args = main.build_parser().parse_args(
        [
            "operator",
            "--namespace",
            "a",
            "--namespace",
            "b",
            "--kubeconfig",
            "k",
            "--standalone",
            "--resync-seconds",
            "1",
        ]
    )
    assert args.namespace == ["a", "b"] and args.kubeconfig == "k" and args.standalone
    assert args.resync_seconds == 1.0
    with pytest.raises(SystemExit):
        main.build_parser().parse_args(["operator", "--namespace", "a", "--all-namespaces"])


def test_operator_gpu_profile_flag(monkeypatch):
    monkeypatch.delenv("MESHTRAIN_GPU_PROFILE", raising=False)
    assert main.build_parser().parse_args(["operator"]).gpu_profile == "h100-sxm"
    assert command.gpu_profile("h100-sxm").memory_bytes == 81559 * 2**20  # nvidia-smi's total
    assert command.gpu_profile("cpu").name == "cpu"
    assert command.gpu_profile("none") is None
    with pytest.raises(profiles.ProfileError, match="known profiles"):
        command.gpu_profile("tpu-v9")
    assert main.main(["operator", "--gpu-profile", "tpu-v9"]) == 2  # refused before kopf starts


def test_operator_planning_deadline_flag(monkeypatch, capsys):
    monkeypatch.delenv("MESHTRAIN_PLANNING_DEADLINE_SECONDS", raising=False)
    parsed = main.build_parser().parse_args(["operator"])
    assert parsed.planning_deadline_seconds == planning.DEFAULT_DEADLINE_SECONDS
    monkeypatch.setenv("MESHTRAIN_PLANNING_DEADLINE_SECONDS", "2.5")
    assert main.build_parser().parse_args(["operator"]).planning_deadline_seconds == 2.5
    for refused in ("0", "601"):  # refused before kopf starts
        assert main.main(["operator", "--planning-deadline-seconds", refused]) == 2
        assert "--planning-deadline-seconds must be above 0" in capsys.readouterr().err


def test_a_profile_file_that_does_not_load_stops_the_operator_at_start(
    monkeypatch, tmp_path, capsys
):
    """Even with --gpu-profile none: labelled nodes are judged by every profile."""
    (tmp_path / "h100-sxm.yaml").write_text("name: h100-sxm\nsource: calibrated\n")
    monkeypatch.setenv(profiles.ENV_VAR, str(tmp_path))
    with pytest.raises(profiles.ProfileError, match="'peak_flops' must be a positive number"):
        command.gpu_profile("none")
    assert main.main(["operator", "--gpu-profile", "none"]) == 2
    assert "h100-sxm.yaml" in capsys.readouterr().err


class _Waker:
    def __init__(self):
        self.poked: list[tuple[str, str]] = []
        self.waiting = 0

    def poke(self, key):
        self.poked.append(key)

    def poke_waiting(self):
        self.waiting += 1


@pytest.mark.parametrize(
    ("type_", "phase", "wakes_waiting"),
    [
        ("ADDED", "Pending", False),
        ("MODIFIED", "Running", False),
        ("MODIFIED", "Failed", True),
        ("MODIFIED", "Succeeded", True),
        ("DELETED", "Running", True),
    ],
)
def test_pod_events_wake_their_job_and_freed_gpus_wake_waiting_jobs(type_, phase, wakes_waiting):
    waker = _Waker()
    informer._wake(
        waker,
        "pods",
        type_,
        {
            "metadata": {"namespace": "ns", "labels": {"meshtrain.io/job": "j"}},
            "status": {"phase": phase},
        },
    )
    assert waker.poked == [("ns", "j")] and waker.waiting == int(wakes_waiting)


def test_node_events_wake_waiting_jobs():
    waker = _Waker()
    informer._wake(waker, "nodes", "ADDED", {"metadata": {"name": "n"}})
    assert waker.waiting == 1 and waker.poked == []
