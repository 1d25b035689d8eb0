"""The kubelet's reasons, read from real pod status shapes, named in the job's conditions and Events.

Each case is a pod the operator built (``builders.build_pod``) with the status a kubelet and
containerd 2.x write for it: an image that is not there, a Secret the environment names that is
missing, the OOM killer, an eviction, a command the image lacks.  The lifecycle table decides
on the pods as ``pod_state.read`` reads them.
"""

from __future__ import annotations

import datetime
from typing import Any

import pytest

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    builders,
    conditions,
    container_reasons,
    identity,
    job_actions,
    job_state,
    lifecycle,
    pod_failure,
    pod_state,
)
from tests.builders import JobBuilder
from tests.unit.test_operator_lifecycle import status_of

T0 = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)
REF = identity.JobRef(name="j", namespace="ns", uid="u1")
IMAGE = "ghcr.io/meshtrain/trainer:no-such-tag"
NOT_FOUND = (
    f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}": '
    f"{IMAGE}: not found"
)
DENIED = (
    'failed to pull and unpack image "registry.example.com/team/trainer:v1": failed to resolve '
    'reference "registry.example.com/team/trainer:v1": pull access denied, repository does not '
    "exist or may require authorization: authorization failed: no basic auth credentials"
)
TLS_TIMEOUT = (
    f'failed to pull and unpack image "{IMAGE}": failed to copy: httpReadSeeker: failed open: '
    'failed to do request: Get "https://ghcr.io/v2/meshtrain/trainer/blobs/sha256:ab": '
    "net/http: TLS handshake timeout"
)
NEVER = f'Container image "{IMAGE}" is not present with pull policy of Never'
INVALID = (
    'Failed to apply default image tag "Bad Image": couldn\'t parse image name "Bad Image": '
    "invalid reference format"
)
NO_SECRET = 'secret "no-such-secret" not found'
NO_TORCHRUN = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
    'runc create failed: unable to start container process: exec: "torchrun": executable file '
    "not found in $PATH: unknown"
)
EVICTED = (
    "The node was low on resource: memory. Threshold quantity: 100Mi, available: 80Mi. "
    "Container trainer was using 3Gi, request is 1Gi, has larger consumption of memory. "
)
# The kubelet's eviction messages for a pod over its own limits (pkg/kubelet/eviction/helpers.go:
# containerEphemeralStorageMessageFmt, podEphemeralStorageMessageFmt, emptyDirMessageFmt): its
# localStorageEviction passes no DisruptionTarget condition (eviction_manager.go evictPod(..., nil)).
OWN_LIMIT_EVICTIONS = (
    'Container trainer exceeded its local ephemeral storage limit "1Gi". ',
    "Pod ephemeral local storage usage exceeds the total limit of containers 1Gi. ",
    'Usage of EmptyDir volume "dshm" exceeds the limit "8Gi". ',
)
# A registry the cluster cannot reach for a moment, or a token being renewed: containerd's words
# (remotes/docker: "unexpected status from %s request to %s: %s"; Go's resolver: "no such host").
TRANSIENT_PULLS = (
    f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}": failed to '
    'do request: Head "https://ghcr.io/v2/meshtrain/trainer/manifests/no-such-tag": dial tcp: '
    "lookup ghcr.io on 10.96.0.10:53: no such host",
    f'failed to pull and unpack image "{IMAGE}": failed to resolve reference "{IMAGE}": failed to '
    "authorize: failed to fetch oauth token: unexpected status from GET request to "
    "https://ghcr.io/token?scope=repository%3Ameshtrain%2Ftrainer%3Apull: 401 Unauthorized",
    'failed to pull and unpack image "123456789012.dkr.ecr.us-east-1.amazonaws.com/team/trainer:v1":'
    ' failed to resolve reference "123456789012.dkr.ecr.us-east-1.amazonaws.com/team/trainer:v1": '
    "unexpected status from HEAD request to https://123456789012.dkr.ecr.us-east-1.amazonaws.com"
    "/v2/team/trainer/manifests/v1: 403 Forbidden",
    "Error response from daemon: denied: Your authorization token has expired. Reauthenticate "
    "and try again.",
)
# runc refusing a bind mount whose source is not there yet (a volume still being set up): the
# words "no such file or directory" are the mount's, not the command's.
MOUNT_RACE = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
    "runc create failed: unable to start container process: error during container init: error "
    'mounting "/var/lib/kubelet/pods/0c1d/volumes/kubernetes.io~configmap/cfg" to rootfs at '
    '"/etc/meshtrain": mount /var/lib/kubelet/pods/0c1d/volumes/kubernetes.io~configmap/cfg:'
    "/etc/meshtrain (via /proc/self/fd/6), flags: 0x5001: no such file or directory: unknown"
)
NO_SCRIPT = (
    "failed to create containerd task: failed to create shim task: OCI runtime create failed: "
    'runc create failed: unable to start container process: exec: "/opt/meshtrain/run.sh": stat '
    "/opt/meshtrain/run.sh: no such file or directory: unknown"
)


def at(seconds: float) -> datetime.datetime:
    return T0 + datetime.timedelta(seconds=seconds)


def spec(**run_policy: Any) -> dict[str, Any]:
    builder = JobBuilder().layout(data=2, gpus_per_node=1).resources(memory="64Mi")
    return builder.run_policy(startupTimeoutSeconds=90, **run_policy).raw()


def job(raw: dict[str, Any] | None = None, **status: Any) -> job_state.JobState:
    """A placed dp2 job (two pods of one GPU, 64Mi each) whose pods all exist."""
    placed = conditions.set(
        [], conditions.PLACED, conditions.TRUE, conditions.GANG_PLACED, "2 pod(s)", T0
    )
    body = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1},
        "spec": raw or spec(),
        "status": {
            "phase": "Placing",
            "conditions": placed,
            "placement": [{"podIndex": 0, "node": "n0"}, {"podIndex": 1, "node": "n1"}],
            "startTime": conditions.timestamp(T0),
            **status,
        },
    }
    return job_state.read(body)


def kubelet_pod(
    index: int, *, phase: str = "Pending", attempt: int = 0, **status: Any
) -> dict[str, Any]:
    """Pod ``index`` as the operator built it, released and bound, with the kubelet's ``status``."""
    raw = spec()
    manifest = builders.build_pod(
        REF, api_spec.TrainingJobSpec.model_validate(raw), attempt, index, f"n{index}"
    )
    manifest["spec"].pop("schedulingGates")
    manifest["spec"]["nodeName"] = f"n{index}"
    manifest["metadata"]["creationTimestamp"] = conditions.timestamp(T0)
    manifest["status"] = {
        "phase": phase,
        "startTime": conditions.timestamp(at(2)),
        "podIP": f"10.0.0.{index + 1}",
        **status,
    }
    return manifest


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    said = {"reason": reason, **({"message": message} if message else {})}
    return {"containerStatuses": [{"name": "trainer", "ready": False, "state": {"waiting": said}}]}


def terminated(reason: str, code: int, message: str = "") -> dict[str, Any]:
    said = {"exitCode": code, "reason": reason, "startedAt": conditions.timestamp(at(3))}
    if message:
        said["message"] = message
    return {
        "containerStatuses": [{"name": "trainer", "ready": False, "state": {"terminated": said}}]
    }


def running() -> dict[str, Any]:
    state = {"running": {"startedAt": conditions.timestamp(at(3))}}
    return {"containerStatuses": [{"name": "trainer", "ready": True, "state": state}]}


def read(*manifests: dict[str, Any]) -> list[pod_state.PodState]:
    found = [pod_state.read(m) for m in manifests]
    assert all(p is not None for p in found)
    return [p for p in found if p is not None]


def events(decision: job_actions.Decision) -> list[job_actions.Emit]:
    return [a for a in decision.actions if isinstance(a, job_actions.Emit)]


def condition(decision: job_actions.Decision, type_: str) -> dict[str, Any]:
    found = conditions.find(status_of(decision).get("conditions") or [], type_)
    assert found is not None, status_of(decision)
    return found


@pytest.mark.parametrize(
    ("reason", "message"),
    [
        ("ErrImagePull", NOT_FOUND),
        ("ImagePullBackOff", f'Back-off pulling image "{IMAGE}": ErrImagePull: {NOT_FOUND}'),
        ("ErrImagePull", DENIED),
        ("InvalidImageName", INVALID),
        ("ErrImageNeverPull", NEVER),
    ],
)
def test_an_image_that_cannot_be_pulled_fails_the_job_at_once_without_a_restart(reason, message):
    pods = read(kubelet_pod(0, **running()), kubelet_pod(1, **waiting(reason, message)))
    decision = lifecycle.decide(job(), pods, at(8))
    status = status_of(decision)
    assert status["phase"] == "Failed" and "restarts" not in status
    failed = condition(decision, conditions.FAILED)
    assert failed["reason"] == reason
    assert message in failed["message"] and "pod j-r0-1, container trainer" in failed["message"]
    assert [(e.type, e.reason) for e in events(decision)] == [("Warning", reason)]
    assert any(isinstance(a, job_actions.DeletePods) for a in decision.actions)


def test_a_pull_the_registry_may_yet_answer_is_named_at_once_and_left_to_the_kubelet():
    pods = read(kubelet_pod(0, **running()), kubelet_pod(1, **waiting("ErrImagePull", TLS_TIMEOUT)))
    decision = lifecycle.decide(job(), pods, at(8))
    assert "phase" not in status_of(decision)
    shown = condition(decision, conditions.RUNNING)
    assert (shown["status"], shown["reason"]) == (conditions.FALSE, "ErrImagePull")
    assert TLS_TIMEOUT in shown["message"]
    assert [(e.reason, e.message) for e in events(decision)] == [("ErrImagePull", shown["message"])]
    # Said once: the next pass, with the condition written, records no second Event.
    again = lifecycle.decide(job(conditions=status_of(decision)["conditions"]), pods, at(9))
    assert events(again) == [] and status_of(again) == {}


def test_the_kubelet_no_longer_reporting_a_pull_error_shows_the_gang_starting():
    said = conditions.set([], conditions.RUNNING, conditions.FALSE, "ErrImagePull", "m", T0)
    creating = waiting("ContainerCreating")
    pods = read(kubelet_pod(0, **creating), kubelet_pod(1, **creating))
    decision = lifecycle.decide(job(conditions=said), pods, at(20))
    assert condition(decision, conditions.RUNNING)["reason"] == conditions.CONTAINERS_STARTING


def test_a_missing_secret_is_named_at_once_and_fails_the_job_after_its_grace():
    raw = spec()
    pods = read(
        kubelet_pod(0, **running()),
        kubelet_pod(1, **waiting("CreateContainerConfigError", NO_SECRET)),
    )
    early = lifecycle.decide(job(raw), pods, at(10))
    shown = condition(early, conditions.RUNNING)
    assert (shown["reason"], shown["status"]) == ("CreateContainerConfigError", conditions.FALSE)
    assert NO_SECRET in shown["message"] and "phase" not in status_of(early)
    grace = container_reasons.CONFIG_GRACE_SECONDS
    late = lifecycle.decide(job(raw), pods, at(2 + grace))  # the kubelet took the pod at 2 s
    assert status_of(late)["phase"] == "Failed" and "restarts" not in status_of(late)
    failed = condition(late, conditions.FAILED)
    assert failed["reason"] == "CreateContainerConfigError" and NO_SECRET in failed["message"]


def test_oom_killed_names_the_container_its_limit_and_the_fix_and_uses_the_backoff_limit():
    pods = read(
        kubelet_pod(0, phase="Running", **running()),
        kubelet_pod(1, phase="Failed", **terminated("OOMKilled", 137)),
    )
    decision = lifecycle.decide(job(), pods, at(30))
    status = status_of(decision)
    assert status["phase"] == "Restarting" and status["restarts"] == 1
    assert "disruptionRestarts" not in status  # the job's own failure, not the node's
    shown = condition(decision, conditions.RUNNING)
    assert shown["reason"] == "OOMKilled"
    for named in ("container trainer", "64Mi", "spec.resources.memory", "restart 1 of"):
        assert named in shown["message"], shown["message"]
    assert [e.reason for e in events(decision)] == ["OOMKilled"]


def test_oom_killed_once_the_backoff_limit_is_used_fails_the_job_naming_it():
    raw = spec(backoffLimit=0)
    pods = read(
        kubelet_pod(0, phase="Running", **running()),
        kubelet_pod(1, phase="Failed", **terminated("OOMKilled", 137)),
    )
    decision = lifecycle.decide(job(raw), pods, at(30))
    failed = condition(decision, conditions.FAILED)
    assert failed["reason"] == conditions.BACKOFF_LIMIT_EXCEEDED
    assert "OOMKilled" in failed["message"] and "64Mi" in failed["message"]


def disruption_target(reason: str, message: str) -> dict[str, Any]:
    """The condition the kubelet, kube-scheduler or a controller adds before ending a pod."""
    return {
        "type": "DisruptionTarget",
        "status": "True",
        "reason": reason,
        "message": message,
        "lastTransitionTime": conditions.timestamp(at(29)),
    }


def test_a_node_pressure_eviction_is_a_disruption_named_with_the_kubelets_message():
    """The kubelet's node-pressure eviction: phase Failed, reason Evicted, and a DisruptionTarget
    condition with reason TerminationByKubelet (eviction_manager.go synchronize)."""
    pressure = [disruption_target("TerminationByKubelet", EVICTED)]
    evicted = kubelet_pod(1, phase="Failed", reason="Evicted", message=EVICTED, conditions=pressure)
    pods = read(kubelet_pod(0, phase="Running", **running()), evicted)
    decision = lifecycle.decide(job(), pods, at(30))
    status = status_of(decision)
    assert status["phase"] == "Restarting" and status["disruptionRestarts"] == 1
    shown = condition(decision, conditions.RUNNING)
    assert shown["reason"] == "Evicted" and EVICTED.strip() in shown["message"]


def test_a_pod_past_its_own_deadline_is_named_and_retried():
    message = "Pod was active on the node longer than the specified deadline"
    late = kubelet_pod(1, phase="Failed", reason="DeadlineExceeded", message=message)
    found = pod_failure.classify(read(late)[0])
    assert found is not None and not found.permanent and not found.disruption
    assert found.reason == "DeadlineExceeded" and message in found.message


def test_a_command_the_image_lacks_fails_the_job_at_once():
    pods = read(
        kubelet_pod(0, phase="Running", **running()),
        kubelet_pod(1, phase="Failed", **terminated("StartError", 128, NO_TORCHRUN)),
    )
    decision = lifecycle.decide(job(), pods, at(30))
    failed = condition(decision, conditions.FAILED)
    assert failed["reason"] == "StartError" and "executable file not found" in failed["message"]


def pod_conditions(ready_to_start: str) -> list[dict[str, Any]]:
    """The kubelet's pod conditions while a container waits in ContainerCreating."""
    since = conditions.timestamp(at(2))
    return [
        {
            "type": "PodReadyToStartContainers",
            "status": ready_to_start,
            "lastTransitionTime": since,
        },
        {"type": "Initialized", "status": "True", "lastTransitionTime": since},
        {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
        {"type": "ContainersReady", "status": "False", "reason": "ContainersNotReady"},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": since},
    ]


def test_an_image_still_pulling_does_not_count_against_the_startup_timeout():
    creating = waiting("ContainerCreating")
    pulling = read(
        kubelet_pod(0, **running()),
        kubelet_pod(1, conditions=pod_conditions("True"), **creating),
    )
    past = at(90 + 60)  # startupTimeoutSeconds=90 after the first pod was created
    decision = lifecycle.decide(job(), pulling, past)
    assert "phase" not in status_of(decision)
    assert decision.requeue_after is not None and decision.requeue_after > 0
    stuck = read(kubelet_pod(0, **running()), kubelet_pod(1))  # bound, no container status yet
    timed_out = lifecycle.decide(job(), stuck, past)
    assert status_of(timed_out)["phase"] == "Restarting"
    beyond = at(90 + container_reasons.PULL_ALLOWANCE_SECONDS)
    assert status_of(lifecycle.decide(job(), pulling, beyond))["phase"] == "Restarting"


@pytest.mark.parametrize("ready", ["False", None])
def test_a_pod_whose_volumes_or_sandbox_are_not_ready_gets_no_pull_allowance_and_is_named(ready):
    """ContainerCreating before PodReadyToStartContainers=True: a volume that does not mount
    (Multi-Attach, a missing Secret volume) or a sandbox the CNI cannot create, not a pull; a
    kubelet older than 1.29 writes no such condition (None) and gets no allowance either."""
    found = pod_conditions(ready or "False")
    if ready is None:
        found = found[1:]  # no PodReadyToStartContainers at all
    stuck = kubelet_pod(1, conditions=found, **waiting("ContainerCreating"))
    pods = read(kubelet_pod(0, **running()), stuck)
    decision = lifecycle.decide(job(), pods, at(91))
    assert status_of(decision)["phase"] == "Restarting"
    message = condition(decision, conditions.RUNNING)["message"]
    assert "startupTimeoutSeconds=90" in message and "PodReadyToStartContainers" in message
    assert "FailedMount" in message and "pod j-r0-1" in message


def test_what_the_pod_says_is_bounded():
    flood = waiting("ErrImagePull", "x" * 100_000)
    flood["containerStatuses"] *= 1000
    found = read(kubelet_pod(1, **flood))[0].problem
    assert found is not None and len(found.message) == container_reasons.MAX_MESSAGE
    odd = waiting("ErrImagePull")
    odd["containerStatuses"][0]["state"]["waiting"]["message"] = {"not": "a string"}
    assert read(kubelet_pod(1, **odd))[0].problem == container_reasons.Problem(
        "ErrImagePull", "", "trainer", "64Mi"
    )


def test_healthy_pods_report_no_problem():
    for status in (running(), waiting("ContainerCreating"), {}):
        assert read(kubelet_pod(0, **status))[0].problem is None
    done = kubelet_pod(0, phase="Succeeded", **terminated("Completed", 0))
    assert read(done)[0].problem is None and pod_failure.classify(read(done)[0]) is None


def test_a_startup_timeout_names_what_the_kubelet_says_keeps_the_gang_waiting():
    pods = read(kubelet_pod(0, **running()), kubelet_pod(1, **waiting("ErrImagePull", TLS_TIMEOUT)))
    decision = lifecycle.decide(job(), pods, at(91))
    assert status_of(decision)["phase"] == "Restarting"
    shown = condition(decision, conditions.RUNNING)
    assert shown["reason"] == "ErrImagePull"
    assert "startupTimeoutSeconds=90" in shown["message"] and TLS_TIMEOUT in shown["message"]


@pytest.mark.parametrize("message", OWN_LIMIT_EVICTIONS)
def test_an_eviction_for_the_pods_own_limits_is_the_jobs_failure_and_uses_the_backoff_limit(
    message,
):
    evicted = kubelet_pod(1, phase="Failed", reason="Evicted", message=message)
    pods = read(kubelet_pod(0, phase="Running", **running()), evicted)
    found = pod_failure.classify(pods[1])
    assert found is not None and not found.disruption and not found.permanent
    decision = lifecycle.decide(job(), pods, at(30))
    status = status_of(decision)
    assert status["phase"] == "Restarting" and "disruptionRestarts" not in status
    assert "excludedNodes" not in status and "disruptions" not in status
    shown = condition(decision, conditions.RUNNING)
    assert shown["reason"] == "Evicted" and message.strip() in shown["message"]
    assert "restart 1 of" in shown["message"]
    spent = lifecycle.decide(job(spec(backoffLimit=0)), pods, at(30))
    failed = condition(spent, conditions.FAILED)
    assert failed["reason"] == conditions.BACKOFF_LIMIT_EXCEEDED
    assert message.strip() in failed["message"]


def test_a_pending_termination_condition_is_not_a_disruption_target():
    """Newer kubelets mark a limit eviction PendingTermination/EvictionByKubelet, not DisruptionTarget."""
    pending = {
        "type": "PendingTermination",
        "status": "True",
        "reason": "EvictionByKubelet",
        "message": OWN_LIMIT_EVICTIONS[0],
    }
    evicted = kubelet_pod(
        1, phase="Failed", reason="Evicted", message=OWN_LIMIT_EVICTIONS[0], conditions=[pending]
    )
    found = pod_failure.classify(read(evicted)[0])
    assert found is not None and not found.disruption and found.reason == "Evicted"


@pytest.mark.parametrize("message", TRANSIENT_PULLS)
@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff"])
def test_a_pull_failing_for_a_passing_fault_of_the_cluster_is_named_and_retried(reason, message):
    said = message if reason == "ErrImagePull" else f"Back-off pulling image: {message}"
    pods = read(kubelet_pod(0, **running()), kubelet_pod(1, **waiting(reason, said)))
    decision = lifecycle.decide(job(), pods, at(8))
    assert "phase" not in status_of(decision)
    shown = condition(decision, conditions.RUNNING)
    assert (shown["status"], shown["reason"]) == (conditions.FALSE, reason)
    assert said in shown["message"]
    assert [e.reason for e in events(decision)] == [reason]
    # Left to the kubelet's retries; the startup timeout still bounds it, naming the pull.
    late = lifecycle.decide(job(), pods, at(91))
    assert status_of(late)["phase"] == "Restarting"
    assert said in condition(late, conditions.RUNNING)["message"]


def test_a_start_error_from_a_mount_is_retried_and_a_missing_command_path_is_permanent():
    mount = read(
        kubelet_pod(0, phase="Running", **running()),
        kubelet_pod(1, phase="Failed", **terminated("StartError", 128, MOUNT_RACE)),
    )
    retried = lifecycle.decide(job(), mount, at(30))
    assert status_of(retried)["phase"] == "Restarting"
    assert condition(retried, conditions.RUNNING)["reason"] == "StartError"
    script = read(
        kubelet_pod(0, phase="Running", **running()),
        kubelet_pod(1, phase="Failed", **terminated("StartError", 128, NO_SCRIPT)),
    )
    failed = lifecycle.decide(job(), script, at(30))
    assert status_of(failed)["phase"] == "Failed" and "restarts" not in status_of(failed)
    assert condition(failed, conditions.FAILED)["reason"] == "StartError"
