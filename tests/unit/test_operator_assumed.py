"""The assume cache (``cluster.assumed``) inside the informer cache, and the per-job re-plan tally
(``replan_counts``): no API involved."""

from __future__ import annotations

from typing import Any

from meshtrain.operator import replan_counts
from meshtrain.operator.cluster import assumed, informer, metrics
from meshtrain.operator.policy import naming
from tests.unit import test_operator_informer

GPU = "nvidia.com/gpu"


def _pod(name: str, node: str, bound: bool = False) -> dict[str, Any]:
    """A gated gang pod planned onto ``node`` (bound there when ``bound``), asking 8 GPUs."""
    pod = test_operator_informer._pod(name, 1, annotations={naming.ANNOTATION_NODE: node})
    [container] = pod["spec"]["containers"]
    container["resources"] = {"requests": {GPU: "8"}, "limits": {GPU: "8"}}
    if bound:
        pod["spec"]["nodeName"] = node
    return pod


def _gpus(cache: informer.Cache, node: str) -> int:
    found = cache.usage().get(node)
    return 0 if found is None else found.requested.get(GPU, 0)


def test_an_assumed_pod_takes_its_node_until_the_pod_itself_is_counted():
    cache = informer.Cache()
    assert cache.assume("job-a", [_pod("a-0", "n1"), _pod("a-1", "n2")]) == 2
    assert _gpus(cache, "n1") == 8 and _gpus(cache, "n2") == 8
    assert cache.usage()["n1"].pods == 1
    cache.learn("create", _pod("a-0", "n1", bound=True))  # the create's answer: counted as itself
    assert _gpus(cache, "n1") == 8 and cache.usage()["n1"].pods == 1  # never twice
    assert list(cache.assumed.pods) == [("ns", "a-1")]


def test_the_reservation_counts_assumed_pods_free_as_meshtrains_own_and_tenants_pods_taken():
    """The holder's plan sees meshtrain's pods free, those still being created included (they were
    counted as another tenant's before), and a tenant's pod on the same node taken."""
    cache = informer.Cache()
    tenant = _pod("tenant-0", "n1", bound=True)
    cache.learn("create", tenant)
    cache.assume("job-a", [_pod("a-0", "n1"), _pod("a-1", "n2")])
    assert _gpus(cache, "n1") == 16
    drained = cache.usage(ours_free=True)
    assert drained["n1"].requested.get(GPU, 0) == 8 and drained["n1"].pods == 1
    assert drained["n2"].requested.get(GPU, 0) == 0 and drained["n2"].pods == 0
    created = _pod("a-0", "n1", bound=True)  # as the operator creates it: its label and controller
    created["metadata"]["labels"][naming.LABEL_MANAGED_BY] = naming.MANAGED_BY
    created["metadata"]["ownerReferences"] = test_operator_informer._controller("a", "job-a")
    cache.learn("create", created)  # the assumption ends, the labelled pod itself is ours
    assert cache.usage(ours_free=True)["n1"].requested.get(GPU, 0) == 8
    cache.assumed.release("job-a")
    assert cache.usage(ours_free=True)["n2"].requested.get(GPU, 0) == 0
    assert _gpus(cache, "n2") == 0 and _gpus(cache, "n1") == 16


def test_a_failed_creation_or_a_job_that_left_releases_its_assumptions():
    cache = informer.Cache()
    cache.assume("job-a", [_pod("a-0", "n1")])
    cache.assume("job-b", [_pod("b-0", "n2")])
    assert cache.assumed.release("job-a") == 1
    assert _gpus(cache, "n1") == 0 and _gpus(cache, "n2") == 8
    assert cache.assumed.release("job-a") == 0


def test_an_assumption_ends_after_its_bound_and_a_pod_the_cache_holds_is_not_assumed(
    monkeypatch,
):
    now = [100.0]
    monkeypatch.setattr(informer.time, "monotonic", lambda: now[0])
    cache = informer.Cache()
    cache.learn("create", _pod("held-0", "n3", bound=True))
    assert cache.assume("job-a", [_pod("a-0", "n1"), _pod("held-0", "n3")]) == 1
    assert _gpus(cache, "n3") == 8
    now[0] += assumed.ASSUME_SECONDS - 1
    assert _gpus(cache, "n1") == 8
    expired = metrics.ASSUMPTIONS_EXPIRED._value.get()
    now[0] += 1
    assert _gpus(cache, "n1") == 0
    assert cache.assumed.pods == {} and cache.assumed.expired == 1
    assert metrics.ASSUMPTIONS_EXPIRED._value.get() == expired + 1


def test_a_job_planned_once_per_admitting_change_stays_at_one_and_an_extra_plan_shows():
    counts = replan_counts.Counts()
    key = ("ns", "waits")
    for _ in range(3):
        counts.admitted(key)
        counts.planned(key)
    assert counts.jobs[key].ratio() == 1.0 and counts.most == 1.0
    counts.planned(key)  # a plan no admitting change asked for
    assert counts.most == 4 / 3
    before = metrics.REPLANS_PER_ADMISSION._sum.get()
    counts.settled(key)
    assert key not in counts.jobs
    assert metrics.REPLANS_PER_ADMISSION._sum.get() == before + 4 / 3
    counts.planned(("ns", "never-woken"))
    counts.planned(("ns", "never-woken"))
    assert counts.most == 2.0
    assert metrics.REPLANS_PER_ADMISSION_MAX._value.get() >= 2.0


def test_a_change_of_time_counts_as_an_admission_unless_a_wake_up_already_did():
    counts = replan_counts.Counts()
    key = ("ns", "held")
    counts.owed_to_time(key)  # its hold ended: the one change its next plan answers
    counts.planned(key)
    assert counts.jobs[key].admissions == 1 and counts.jobs[key].ratio() == 1.0
    counts.admitted(key)  # a capacity change woke it, and its avoided node came back too
    counts.owed_to_time(key)
    counts.planned(key)  # one plan answers both: one admission, not two
    assert counts.jobs[key].admissions == 2
    counts.planned(key)  # so a plan with no change since still shows
    assert counts.jobs[key].ratio() == 1.5


def test_a_renewed_assumption_outlives_its_first_deadline_and_still_ends():
    cache = informer.Cache()
    cache.assume("job-a", [_pod("a-0", "n1")])
    first = cache.assumed.pods[("ns", "a-0")].until
    cache.assumed.renew("job-a", first - 1.0)  # creation still going on just before it ran out
    cache.assumed.expire(first + 1.0)
    assert _gpus(cache, "n1") == 8  # the first deadline passed: still held
    cache.assumed.expire(first - 1.0 + assumed.ASSUME_SECONDS)
    assert _gpus(cache, "n1") == 0 and not cache.assumed.pods  # the renewed one ran out
    assert cache.assumed.expired == 1
