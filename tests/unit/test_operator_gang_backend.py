"""The gang backends' pure parts: the flags' checks, what each backend resolves to, the PodGroup
each builds, and how a pod joins it (the real schedulers' verdicts: tests/integration/gang_backends)."""

from __future__ import annotations

import json
import pathlib

import pytest

from meshtrain.api import limits, loading
from meshtrain.cli import main
from meshtrain.operator.policy import builders, gang_backend, identity
from tests.builders import JobBuilder

ROOT = pathlib.Path(__file__).resolve().parents[2]
REF = identity.JobRef(name="llm", namespace="research", uid="1234")
SPEC = loading.parse_spec(JobBuilder().layout(data=16, tensor=2, gpus_per_node=4).raw())
COSCHEDULING = gang_backend.GangBackend(
    kind="coscheduling", scheduler_name="gangs", schedule_timeout_seconds=90
)


@pytest.mark.parametrize(
    ("kind", "served", "resolved"),
    [
        ("auto", True, "native"),
        ("auto", False, "none"),
        ("native", False, "native"),  # the create then fails, naming the feature gates
        ("coscheduling", True, "coscheduling"),
        ("none", True, "none"),
    ],
)
def test_each_backend_resolves_on_a_cluster_that_serves_the_native_api_or_not(
    kind: gang_backend.Kind, served: bool, resolved: str
) -> None:
    assert gang_backend.resolve(kind, served) == resolved


def test_volcano_an_unknown_kind_a_bad_scheduler_name_and_timeout_are_refused_naming_the_flag() -> (
    None
):
    assert gang_backend.invalid(gang_backend.AUTO) is None
    assert gang_backend.invalid(COSCHEDULING) is None
    volcano = gang_backend.invalid(gang_backend.GangBackend(kind="volcano"))
    assert volcano is not None and "volcano" in volcano and "use coscheduling" in volcano
    unknown = gang_backend.invalid(gang_backend.GangBackend(kind="kai"))  # type: ignore[arg-type]
    assert unknown is not None and "MESHTRAIN_GANG_BACKEND" in unknown
    for name in ("Second_Scheduler", "s" * 254, ""):
        said = gang_backend.invalid(gang_backend.GangBackend(scheduler_name=name))
        assert said is not None and "--gang-scheduler-name" in said
    for seconds in (0, limits.MAX_GANG_SCHEDULE_TIMEOUT_SECONDS + 1):
        said = gang_backend.invalid(gang_backend.GangBackend(schedule_timeout_seconds=seconds))
        assert said is not None and "--gang-schedule-timeout-seconds" in said


def test_the_coscheduling_pod_group_asks_for_every_pod_and_is_the_jobs_like_the_native_one() -> (
    None
):
    native = builders.build_pod_group(REF, SPEC, 3)
    group = gang_backend.build_pod_group("coscheduling", COSCHEDULING, REF, SPEC, 3)
    assert group is not None
    assert group["apiVersion"] == "scheduling.x-k8s.io/v1alpha1" and group["kind"] == "PodGroup"
    assert group["spec"] == {"minMember": SPEC.pods, "scheduleTimeoutSeconds": 90}
    assert SPEC.pods == 8
    assert group["metadata"] == native["metadata"]  # name per attempt and spec, owned by the job
    assert group["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert group["metadata"]["ownerReferences"][0]["controller"] is True
    assert gang_backend.build_pod_group("native", COSCHEDULING, REF, SPEC, 3) == native
    assert gang_backend.build_pod_group("none", COSCHEDULING, REF, SPEC, 3) is None
    assert gang_backend.native_group(native) == native["metadata"]["name"]
    assert gang_backend.native_group(group) is None and gang_backend.native_group(None) is None


def test_a_gang_pod_joins_its_group_through_the_second_scheduler_and_a_spare_binds_alone() -> None:
    pod = builders.build_pod(REF, SPEC, 0, 1, "n-a")
    pod["metadata"]["labels"][gang_backend.COSCHEDULING_LABEL] = "someone-elses"  # spec.pod.labels
    member = gang_backend.join(pod, "coscheduling", COSCHEDULING, "llm-r0-abc")
    assert member["metadata"]["labels"][gang_backend.COSCHEDULING_LABEL] == "llm-r0-abc"
    assert member["spec"]["schedulerName"] == "gangs"
    assert member["spec"]["schedulingGates"] == pod["spec"]["schedulingGates"]  # still gated
    spare = gang_backend.join(
        builders.build_spare_pod(REF, SPEC, 0, 0, "n-b"), "coscheduling", COSCHEDULING, None
    )
    assert spare["spec"]["schedulerName"] == "gangs"
    assert gang_backend.COSCHEDULING_LABEL not in spare["metadata"]["labels"]
    loose = gang_backend.join(pod, "coscheduling", COSCHEDULING, None)
    assert gang_backend.COSCHEDULING_LABEL not in loose["metadata"]["labels"]
    for resolved in ("native", "none"):
        assert gang_backend.join(pod, resolved, COSCHEDULING, "llm-r0-abc") == pod
    assert "schedulerName" not in pod["spec"]  # the input is left as it was


def test_the_operator_takes_its_gang_backend_from_flags_or_env_and_refuses_volcano(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in ("BACKEND", "SCHEDULER_NAME", "SCHEDULE_TIMEOUT_SECONDS"):
        monkeypatch.delenv(f"MESHTRAIN_GANG_{name}", raising=False)
    args = main.build_parser().parse_args(["operator"])
    assert (args.gang_backend, args.gang_scheduler_name) == ("auto", "scheduler-plugins-scheduler")
    monkeypatch.setenv("MESHTRAIN_GANG_BACKEND", "coscheduling")
    monkeypatch.setenv("MESHTRAIN_GANG_SCHEDULER_NAME", "gangs")
    monkeypatch.setenv("MESHTRAIN_GANG_SCHEDULE_TIMEOUT_SECONDS", "30")
    args = main.build_parser().parse_args(["operator"])
    assert (args.gang_backend, args.gang_scheduler_name) == ("coscheduling", "gangs")
    assert args.gang_schedule_timeout_seconds == 30
    assert main.main(["operator", "--gang-backend", "volcano"]) == 2  # before kopf starts
    assert "Volcano's scheduler has not been built or tested" in capsys.readouterr().err
    monkeypatch.setenv("MESHTRAIN_GANG_BACKEND", "kai")
    assert main.main(["operator"]) == 2
    assert "is none of auto, native, coscheduling, volcano, none" in capsys.readouterr().err


def test_the_charts_schema_bounds_the_timeout_as_the_operator_does() -> None:
    schema = json.loads((ROOT / "charts" / "meshtrain" / "values.schema.json").read_text())
    gang = schema["properties"]["gang"]["properties"]
    timeout = gang["scheduleTimeoutSeconds"]
    assert (timeout["minimum"], timeout["maximum"]) == (1, limits.MAX_GANG_SCHEDULE_TIMEOUT_SECONDS)
    assert gang["backend"]["enum"] == list(gang_backend.KINDS)
    assert gang["schedulerName"]["maxLength"] == 253
