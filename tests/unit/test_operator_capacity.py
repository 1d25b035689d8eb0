"""capacity.counted_node: a node is used by what kube-scheduler counts and by the operator's own
gated pods of live jobs, on the node their job's status.placement holds, never by what a pod says
of itself (issue #32 item 3; a pod a tenant made owned by its own job: review finding 1).

The same rule against the real kube-scheduler: tests/integration/operator/test_feasibility_vs_scheduler.py.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import builders, capacity, identity, naming
from tests.builders import JobBuilder

JOB = identity.JobRef("train", "team-a", "uid-live")
SPEC = loading.parse_spec(JobBuilder().layout(data=8, gpus_per_node=8).gpus(8).raw())
LIVE = capacity.Owner(uid="uid-live", attempt=0, placement={0: "n1"})
"""JOB as its status says: attempt 0, pod 0 planned onto n1."""
NAMESAKE = capacity.Owner(uid="uid-namesake", attempt=0, placement={0: "n1"})


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
        (_own(), LIVE, "n1", "the operator's own gated pod of its live job"),
        (_own(), None, None, "the job is gone, deleted or finished"),
        (_own(), NAMESAKE, None, "a namesake job (another UID) does not own it"),
        (
            {**_own(), "status": {"phase": "Failed"}},
            LIVE,
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
    assert capacity.counted_node(copy.deepcopy(_own()), LIVE) == "n1"


def _with(pod: dict[str, Any], change: Any) -> dict[str, Any]:
    change(pod)
    return pod


def _relabel(key: str, value: str) -> Any:
    return lambda pod: pod["metadata"]["labels"].__setitem__(key, value)


def _controller(**changes: Any) -> Any:
    return lambda pod: pod["metadata"]["ownerReferences"][0].update(changes)


@pytest.mark.parametrize(
    ("pod", "counted", "why"),
    [
        (_own("n2"), "n1", "pinned elsewhere: the placement, not the pod, says where it holds"),
        (
            _with(_own(), lambda p: p["metadata"].__setitem__("name", "train-extra")),
            None,
            "another name than the entry's pod: a second pod for one placement entry",
        ),
        (_with(_own(), _relabel(naming.LABEL_ATTEMPT, "1")), None, "an attempt not the status's"),
        (_with(_own(), _relabel(naming.LABEL_NODE_RANK, "7")), None, "an index not placed"),
        (
            _with(_own(), lambda p: p["spec"].__setitem__("schedulingGates", [])),
            "n1",
            "released, not yet bound: pinned to the placed node, about to bind there",
        ),
        (_with(_own(), _controller(controller=False)), None, "owned, not controlled, by the job"),
        (_with(_own(), _controller(kind="Job")), None, "controlled by another kind, same UID"),
    ],
)
def test_a_pod_of_a_live_job_reserves_only_the_node_its_placement_holds_for_that_pod(
    pod, counted, why
):
    """Labels, owner references and annotations are anyone's to write: a pod owned by a live job
    reserves the node that job's status.placement holds, and only as the one pod the operator
    creates for that entry (review finding 1)."""
    assert capacity.counted_node(pod, LIVE) == counted, why


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
    owner = capacity.live_owner(job)
    assert (owner.uid if owner else None) == uid


def test_a_live_jobs_status_says_which_node_each_gated_pod_holds():
    job = {
        "metadata": {"uid": "u"},
        "status": {
            "restarts": 2,
            "placement": [
                {"podIndex": 0, "node": "n1"},
                {"podIndex": 1, "node": "n2"},
                {"podIndex": "1", "node": "n9"},  # not what the operator writes: ignored
                "garbage",
            ],
        },
    }
    assert capacity.live_owner(job) == capacity.Owner("u", 2, {0: "n1", 1: "n2"})
    assert capacity.live_owner({"metadata": {"uid": "u"}}) == capacity.Owner("u", 0, {})


def test_an_unbound_replacement_and_a_spare_hold_the_nodes_their_job_status_names():
    """A replacement (status.placement[i].pod) and a spare pod (status.spares) are released at
    once and hold their node until kube-scheduler binds them: another job's plan must not count
    those GPUs free (review finding 4)."""
    replacement = builders.build_pod(JOB, SPEC, 0, 0, "n3", name="train-r0-0-p1")
    replacement["status"] = {"phase": "Pending"}
    spare = builders.build_spare_pod(JOB, SPEC, 0, 0, "n4")
    spare["status"] = {"phase": "Pending"}
    job = {
        "metadata": {"uid": "uid-live"},
        "status": {
            "placement": [{"podIndex": 0, "node": "n3", "pod": "train-r0-0-p1", "replaced": 1}],
            "spares": [{"pod": "train-r0-s0", "node": "n4"}],
        },
    }
    owner = capacity.live_owner(job)
    assert owner is not None
    assert capacity.counted_node(replacement, owner) == "n3"
    assert capacity.counted_node(spare, owner) == "n4"
    assert capacity.counted_node(_own("n3"), owner) is None  # superseded: the replacement holds it
    # Nothing the status does not name: neither a spare it does not list nor another attempt's.
    assert capacity.counted_node(spare, capacity.Owner("uid-live", 0, {0: "n3"})) is None
    assert capacity.counted_node(spare, dataclasses.replace(owner, attempt=1)) is None
    assert capacity.counted_node(replacement, LIVE) is None  # recorded nowhere: a forgery
