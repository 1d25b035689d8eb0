"""capacity.counted_node: a node is used by what kube-scheduler counts and by the operator's own
gated pods of live jobs, never by what a foreign pod says of itself (issue #32 item 3).

The same rule against the real kube-scheduler: tests/integration/operator/test_feasibility_vs_scheduler.py.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import builders, capacity, identity, naming
from tests.builders import JobBuilder

JOB = identity.JobRef("train", "team-a", "uid-live")
SPEC = loading.parse_spec(JobBuilder().layout(data=8, gpus_per_node=8).gpus(8).raw())


def _own(node: str = "n1") -> dict[str, Any]:
    """A gated pod the operator builds for JOB, planned onto ``node``."""
    pod = builders.build_pod(JOB, SPEC, 0, 0, node)
    pod["status"] = {"phase": "Pending"}
    return pod


def _foreign(**changes: Any) -> dict[str, Any]:
    pod: dict[str, Any] = {
        "metadata": {"name": "f", "namespace": "team-b"},
        "spec": {"containers": [{"resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "status": {"phase": "Pending"},
    }
    for path, value in changes.items():
        section, key = path.split("__")
        pod[section][key] = value
    return pod


PIN = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [
                {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n1"]}]}
            ]
        }
    }
}


def _forged(namespace: str) -> dict[str, Any]:
    """JOB's own pod, copied into ``namespace`` by someone else (its labels and owner reference kept)."""
    pod = _own()
    pod["metadata"]["namespace"] = namespace
    return pod


@pytest.mark.parametrize(
    ("pod", "live_owner", "counted", "why"),
    [
        (_foreign(spec__nodeName="n1"), None, "n1", "bound: the scheduler counts it"),
        (
            _foreign(spec__nodeName="n1", status__phase="Succeeded"),
            None,
            None,
            "terminal: the scheduler drops it",
        ),
        (
            _foreign(metadata__annotations={naming.ANNOTATION_NODE: "n1"}),
            None,
            None,
            "a foreign planned-node annotation reserves nothing",
        ),
        (_foreign(spec__affinity=PIN), None, None, "a one-node affinity reserves nothing"),
        (
            _foreign(status__nominatedNodeName="n1"),
            None,
            "n1",
            "kube-scheduler holds a nominated node for the nominee",
        ),
        (
            _foreign(status__nominatedNodeName="n1", spec__schedulerName="other"),
            None,
            None,
            "another scheduler's nominee: kube-scheduler ignores it",
        ),
        (_own(), "uid-live", "n1", "the operator's own gated pod of its live job"),
        (_own(), None, None, "the job is gone, deleted or finished"),
        (_own(), "uid-namesake", None, "a namesake job (another UID) does not own it"),
        (
            {**_own(), "status": {"phase": "Failed"}},
            "uid-live",
            None,
            "own but terminal",
        ),
    ],
)
def test_a_node_is_used_by_what_the_scheduler_counts_and_by_own_gated_pods(
    pod, live_owner, counted, why
):
    assert capacity.counted_node(pod, live_owner) == counted, why


def test_a_forged_copy_of_an_own_pod_counts_only_where_its_owner_lives():
    """The cache looks the owner up by the pod's own namespace and job label (informer._node_of):
    a copy in another namespace finds no live job there, so it reserves nothing."""
    forged = _forged("team-b")
    assert capacity.counted_node(forged, None) is None
    assert capacity.counted_node(copy.deepcopy(_own()), "uid-live") == "n1"


@pytest.mark.parametrize(
    ("job", "uid"),
    [
        ({"metadata": {"uid": "u"}}, "u"),
        ({"metadata": {"uid": "u"}, "status": {"phase": "Running"}}, "u"),
        ({"metadata": {"uid": "u"}, "status": {"phase": "Succeeded"}}, None),
        ({"metadata": {"uid": "u"}, "status": {"phase": "Failed"}}, None),
        ({"metadata": {"uid": "u", "deletionTimestamp": "2026-01-01T00:00:00Z"}}, None),
    ],
)
def test_a_job_is_live_until_it_finishes_or_is_deleted(job, uid):
    assert capacity.live_uid(job) == uid
