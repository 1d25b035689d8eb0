"""Waiting for capacity: which jobs a capacity change wakes, once per change, and the node-set
reservation that bounds the wait of the longest-waiting gang (``policy.capacity_queue``,
``policy.reservation``, ``waiting.Queue``, ``handlers.Wakeups``, ``placement_lock``)."""

from __future__ import annotations

import asyncio
import datetime
import math
import random
import time
from typing import Any

import pytest

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.operator import gang_fit, handlers, placement_lock, planning, reserving, waiting
from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import (
    capacity_queue,
    conditions,
    excluded_nodes,
    feasibility,
    identity,
    job_state,
    naming,
    queue_order,
    rescheduling,
    reservation,
)
from meshtrain.planner import placement_request
from tests.builders import JobBuilder

GPU = "nvidia.com/gpu"


def _need(pods: int, shape: str = "8-gpu", gpus: int = 8) -> capacity_queue.Need:
    return capacity_queue.Need(shape=shape, gpus_per_pod=gpus, pods=pods)


@pytest.mark.parametrize(
    ("free", "woken"),
    [
        (0, ["unknown"]),
        (2, ["unknown", "two"]),
        (4, ["unknown", "two", "four"]),
        (9, ["unknown", "two", "four", "eight"]),
    ],
)
def test_a_capacity_change_wakes_only_the_jobs_whose_pods_fit_the_free_slots(
    free: int, woken: list[str]
) -> None:
    asked: list[object] = []

    def free_slots(shape: object) -> int:
        asked.append(shape)
        return free

    waiting_jobs = {"unknown": None, "two": _need(2), "four": _need(4), "eight": _need(8)}
    assert capacity_queue.admissible(waiting_jobs, free_slots) == woken
    assert asked == ["8-gpu"]  # counted once for all the jobs of one shape


def test_the_longest_waiting_job_holds_the_reservation_once_it_has_waited_long_enough() -> None:
    young = capacity_queue.Waiting("young", _need(1), since=100.0)
    old = capacity_queue.Waiting("old", _need(64), since=10.0)
    assert (
        capacity_queue.holder([young, old], now=10.0 + capacity_queue.RESERVE_AFTER_SECONDS - 1)
        is None
    )
    assert (
        capacity_queue.holder([young, old], now=10.0 + capacity_queue.RESERVE_AFTER_SECONDS) == old
    )
    assert capacity_queue.holder([], now=1e9) is None


def test_of_the_jobs_that_waited_long_enough_the_highest_priority_holds_then_the_oldest() -> None:
    after = capacity_queue.RESERVE_AFTER_SECONDS
    old = capacity_queue.Waiting("old", _need(4), since=0.0)
    urgent = capacity_queue.Waiting("urgent", _need(4), since=50.0, priority=1000)
    fresh = capacity_queue.Waiting("fresh", _need(4), since=400.0, priority=5000)
    assert capacity_queue.holder([old, urgent, fresh], now=after + 10) == old  # urgent: too young
    assert capacity_queue.holder([old, urgent, fresh], now=after + 50) == urgent
    assert capacity_queue.holder([old, urgent, fresh], now=after + 400) == fresh
    assert capacity_queue.holder([old, urgent], now=20.0, after=10.0) == old  # the setting


def test_the_reserved_nodes_are_kept_from_everyone_but_their_holder_and_planned_again_sparingly() -> (
    None
):
    kept = reservation.Reservation("holder", frozenset({"n1", "n2"}), basis=(3, 7), at=100.0)
    assert reservation.excluded(kept, "other") == {"n1", "n2"}
    assert reservation.excluded(kept, "holder") == frozenset()
    assert reservation.excluded(None, "other") == frozenset()
    assert reservation.outside({"n0": 1, "n1": 1, "n3": 2}, kept.nodes) == {"n0": 1, "n3": 2}
    assert reservation.due(None, "holder", (3, 7), now=100.0)  # none yet
    assert reservation.due(kept, "next", (3, 7), now=100.0)  # another holder: at once
    assert not reservation.due(kept, "holder", (3, 7), now=1e9)  # nothing changed: never
    every = reservation.REPLAN_AFTER_SECONDS
    assert not reservation.due(kept, "holder", (4, 7), now=100.0 + every - 1)  # too soon
    assert reservation.due(kept, "holder", (3, 8), now=100.0 + every)


def test_the_wait_starts_at_the_placed_false_transition_so_a_restart_keeps_it() -> None:
    now = datetime.datetime(2026, 11, 30, 4, 0, tzinfo=datetime.UTC)
    began = now - datetime.timedelta(minutes=7)
    status = {
        "conditions": [
            {
                "type": conditions.PLACED,
                "status": conditions.FALSE,
                "reason": "InsufficientGPUs",
                "lastTransitionTime": conditions.timestamp(began),
            }
        ]
    }
    assert queue_order.since_of(status, now) == began.timestamp()
    status["conditions"][0]["status"] = conditions.TRUE  # placed: not waiting
    assert queue_order.since_of(status, now) == now.timestamp()
    assert queue_order.since_of({}, now) == now.timestamp()
    status["conditions"][0].update(status=conditions.FALSE, lastTransitionTime="not a time")
    assert queue_order.since_of(status, now) == now.timestamp()
    # suspended a week ago (Placed went False then and stays False), resumed 2 minutes ago: the
    # wait starts at the resume, so a long suspension does not make the longest waiter
    week, resumed = now - datetime.timedelta(days=7), now - datetime.timedelta(minutes=2)
    status["conditions"][0]["lastTransitionTime"] = conditions.timestamp(week)
    status["conditions"].append(
        {
            "type": conditions.SUSPENDED,
            "status": conditions.FALSE,
            "reason": "Resumed",
            "lastTransitionTime": conditions.timestamp(resumed),
        }
    )
    assert queue_order.since_of(status, now) == resumed.timestamp()


def test_only_meshtrain_pods_count_free_for_the_holders_plan() -> None:
    ours = {"metadata": {"labels": {"app.kubernetes.io/managed-by": "meshtrain-operator"}}}
    theirs = {"metadata": {"labels": {"app": "other"}}}
    assert [reservation.is_ours(p) for p in (ours, theirs, {})] == [True, False, False]


def _node(name: str, gpus: int = 8) -> dict[str, Any]:
    amounts = {GPU: str(gpus), "cpu": "96", "memory": "1Ti", "pods": "110"}
    return {
        "kind": "Node",
        "metadata": {"name": name, "resourceVersion": "1", "labels": {}},
        "spec": {},
        "status": {"allocatable": amounts, "conditions": [{"type": "Ready", "status": "True"}]},
    }


def _bound(name: str, node: str, gpus: int = 8) -> dict[str, Any]:
    limits = {GPU: str(gpus)}
    return {
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "other", "resourceVersion": "1", "labels": {}},
        "spec": {
            "nodeName": node,
            "containers": [
                {"name": "c", "image": "i", "resources": {"limits": limits, "requests": limits}}
            ],
        },
        "status": {"phase": "Running"},
    }


def _job(
    name: str, pods: int
) -> tuple[identity.JobRef, api_spec.TrainingJobSpec, feasibility.Demand]:
    spec = api_spec.TrainingJobSpec.model_validate(
        JobBuilder().layout(data=pods, tensor=8, gpus_per_node=8).raw()
    )
    demand = feasibility.Demand(requests={GPU: 8}, tolerations=(), node_selector={})
    return identity.JobRef(name, "ns", f"uid-{name}"), spec, demand


def test_the_queue_counts_free_slots_on_the_cache_and_wakes_what_fits() -> None:
    cache = informer.Cache()
    for i in range(4):
        cache.nodes.upsert(_node(f"n{i}"))
    cache.pods.upsert(_bound("busy", "n0"))
    queue = waiting.Queue(cache)
    small, large = _job("small", 2), _job("large", 4)
    queue.enter(*small)
    queue.enter(*large)
    assert queue.free_slots(waiting.shape_of(small[2])) == 3  # feasibility.slots, node by node
    assert queue.wake([("ns", "small"), ("ns", "large"), ("ns", "new")]) == [
        ("ns", "small"),
        ("ns", "new"),  # not entered yet (never planned here): woken
    ]
    queue.leave(large[0])
    assert queue.entries.keys() == {"uid-small"}


def _three_free_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> tuple[informer.Cache, waiting.Queue, list[float]]:
    """Four 8-GPU nodes, one busy; a queue on them and the clock it reads."""
    cache = informer.Cache()
    for i in range(4):
        cache.nodes.upsert(_node(f"n{i}"))
    cache.pods.upsert(_bound("busy", "n0"))
    queue = waiting.Queue(cache)
    clock = [0.0]
    monkeypatch.setattr(waiting.time, "time", lambda: clock[0])
    return cache, queue, clock


def _reserve(queue: waiting.Queue, uid: str, *nodes: str) -> None:
    """What ``reserving.refresh`` records once the holder's plan picked ``nodes``."""
    queue.reservation = reservation.Reservation(uid, frozenset(nodes), queue.basis(), 0.0)


def test_the_reserved_nodes_wake_only_their_holder_and_others_place_beside_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, queue, clock = _three_free_nodes(monkeypatch)
    large, small = _job("large", 4), _job("small", 1)
    queue.enter(*large)
    clock[0] = 10.0
    queue.enter(*small)
    assert queue.holder() is None  # nobody has waited long enough
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 1
    assert queue.holder() == queue.entries["uid-large"]
    assert queue.reservation_due("uid-large") and not queue.reservation_due("uid-small")
    assert queue.excluded("uid-small") == frozenset()  # its node set is not planned yet
    _reserve(queue, "uid-large", "n0", "n1", "n2", "n3")
    assert not queue.reservation_due("uid-large")
    assert queue.excluded("uid-small") == {"n0", "n1", "n2", "n3"}
    assert queue.excluded("uid-large") == frozenset()
    assert queue.wake([("ns", "small"), ("ns", "large")]) == []  # 3 free < 4; none outside
    cache.pods.remove(_bound("busy", "n0"))
    assert queue.wake([("ns", "small"), ("ns", "large")]) == [("ns", "large")]  # its nodes free
    cache.nodes.upsert(_node("n4"))
    assert queue.wake([("ns", "small"), ("ns", "large")]) == [("ns", "small"), ("ns", "large")]
    queue.leave(large[0])
    assert queue.reservation is None and queue.excluded("uid-small") == frozenset()


def test_a_job_that_waited_before_a_restart_holds_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The wait is counted from the job's condition, not from its first plan in this process."""
    _, queue, clock = _three_free_nodes(monkeypatch)
    clock[0] = 10_000.0
    large = _job("large", 4)
    queue.enter(*large, since=clock[0] - capacity_queue.RESERVE_AFTER_SECONDS - 1)
    assert queue.holder() == queue.entries["uid-large"]
    queue.enter(*large, since=clock[0])  # entered again: keeps its place
    assert queue.holder() == queue.entries["uid-large"]


def test_urgent_waiters_take_the_placement_lock_before_earlier_ordinary_ones() -> None:
    async def scenario() -> list[str]:
        lock, order = placement_lock.PlacementLock(), []
        await lock.acquire()

        async def ordinary(name: str) -> None:
            async with lock:
                order.append(name)

        async def urgent(name: str) -> None:
            async with lock.urgent():
                order.append(name)

        tasks = [asyncio.create_task(ordinary("plan-1")), asyncio.create_task(ordinary("plan-2"))]
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(ordinary("cancelled"))
        tasks.append(asyncio.create_task(urgent("lift")))
        await asyncio.sleep(0)
        cancelled.cancel()
        lock.release()
        await asyncio.gather(*tasks)
        assert not lock.locked()
        return order

    assert asyncio.run(scenario()) == ["lift", "plan-1", "plan-2"]


def test_capacity_changes_close_together_wake_each_admitted_job_once() -> None:
    async def scenario() -> tuple[list[list[tuple[str, str]]], dict[str, bool]]:
        asked: list[list[tuple[str, str]]] = []

        def admit(keys: list[tuple[str, str]]) -> list[tuple[str, str]]:
            asked.append(keys)
            return [k for k in keys if k[1] != "too-big"]

        wakeups = handlers.Wakeups(admit)
        events = {name: wakeups.event(("ns", name)) for name in ("fits", "too-big", "running")}
        wakeups.set_waiting(("ns", "fits"), True)
        wakeups.set_waiting(("ns", "too-big"), True)
        for _ in range(10):  # ten pods of one gang end together
            wakeups.poke_waiting()
        await asyncio.sleep(handlers.WAKE_COALESCE_SECONDS * 2)
        return asked, {name: event.is_set() for name, event in events.items()}

    asked, woken = asyncio.run(scenario())
    assert asked == [[("ns", "fits"), ("ns", "too-big")]]  # one question for the ten changes
    assert woken == {"fits": True, "too-big": False, "running": False}


def test_jobs_kueue_admitted_never_hold_the_reservation_yet_keep_off_its_nodes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kueue's queue orders its own jobs: the holder is among the operator's others, and its
    nodes are kept from every job, Kueue's too."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    queued, large, small = _job("queued", 4), _job("large", 4), _job("small", 1)
    queue.kueue.add(queued[0].uid)
    queue.enter(*queued)  # waited longest, but Kueue's
    clock[0] = 5.0
    queue.enter(*large)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 10
    assert queue.holder() == queue.entries["uid-large"]
    _reserve(queue, "uid-large", "n1", "n2", "n3")
    assert queue.excluded(queued[0].uid) == {"n1", "n2", "n3"}
    assert queue.wake([("ns", "queued")]) == []
    queue.leave(queued[0])
    assert queued[0].uid not in queue.kueue
    assert cache.nodes and small


def _pool_node(name: str, pool: str) -> dict[str, Any]:
    node = _node(name)
    node["metadata"].update(labels={"pool": pool}, resourceVersion="2")
    return node


def _pool_job(
    name: str, pods: int, pool: str
) -> tuple[identity.JobRef, api_spec.TrainingJobSpec, feasibility.Demand]:
    ref, spec, _ = _job(name, pods)
    demand = feasibility.Demand(requests={GPU: 8}, tolerations=(), node_selector={"pool": pool})
    return ref, spec, demand


def test_the_reservation_keeps_only_the_holders_nodes_from_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A holder on pool a (3 free of 4 nodes) waits; a job of pool b takes nothing it could use."""
    cache, queue, clock = _three_free_nodes(monkeypatch)  # n0..n3, n0 busy
    for i in range(4):
        cache.nodes.upsert(_pool_node(f"n{i}", "a"))
        cache.nodes.upsert(_pool_node(f"b{i}", "b"))
    large, other_pool, same_pool = (
        _pool_job("large", 4, "a"),
        _pool_job("b", 1, "b"),
        _pool_job("a", 1, "a"),
    )
    queue.enter(*large)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 1
    queue.enter(*other_pool)
    queue.enter(*same_pool)
    assert queue.holder() == queue.entries["uid-large"]
    _reserve(queue, "uid-large", "n0", "n1", "n2", "n3")
    assert queue.wake([("ns", "b"), ("ns", "a")]) == [("ns", "b")]


def test_a_job_that_could_not_fit_an_empty_fleet_never_holds_the_reservation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, queue, clock = _three_free_nodes(monkeypatch)  # four nodes in all
    never, small = _job("never", 5), _job("small", 1)
    queue.enter(*never)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 1
    assert queue.holder() is None
    assert queue.excluded(small[0].uid) == frozenset()


def test_a_holder_whose_count_was_free_yet_did_not_fit_passes_the_reservation_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Its topology, not the slot count, refuses it: after PASS_ON_AFTER such plans it holds no more."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    large, next_oldest = _job("large", 3), _job("next", 4)
    for at, job in ((0.0, large), (1.0, next_oldest)):  # the larger waits second
        clock[0] = at
        queue.enter(*job)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 2
    _reserve(queue, "uid-large", "n1", "n2", "n3")  # free: its plan would find them
    for _ in range(capacity_queue.PASS_ON_AFTER):
        queue.enter(*large, held_until=1e12)  # held to one domain: says nothing of its nodes
    assert queue.entries["uid-large"].misses == 0
    for _ in range(capacity_queue.PASS_ON_AFTER):
        assert queue.holder() == queue.entries["uid-large"]
        queue.enter(*large)  # planned with 3 free slots for its 3 pods: placed nothing
    assert queue.holder() == queue.entries["uid-next"]
    assert cache.nodes


def test_a_resync_plans_a_waiting_job_only_after_a_capacity_change_that_could_admit_it_or_a_new_generation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, queue, _ = _three_free_nodes(monkeypatch)
    large = _job("large", 4)
    ref = large[0]
    assert queue.unchanged(ref, 1) is False  # never planned: plan
    queue.planning(ref, 1)
    queue.enter(*large)  # 3 free < 4: it waits
    assert queue.unchanged(ref, 1) is True  # a resync: nothing new, no plan
    assert queue.unchanged(ref, 2) is False  # its spec changed
    queue.capacity_changed()  # a change that leaves 3 free slots: it could not admit the job
    assert queue.unchanged(ref, 1) is True
    cache.pods.remove(_bound("busy", "n0"))  # the fourth node frees: 4 slots
    queue.capacity_changed()
    assert queue.unchanged(ref, 1) is False
    assert queue.missed(("ns", "large")) is True  # a change since its plan started
    queue.planning(ref, 1)
    assert queue.missed(("ns", "large")) is False


def test_a_capacity_change_during_a_plan_wakes_the_job_once_it_is_marked_waiting() -> None:
    async def scenario() -> bool:
        wakeups = handlers.Wakeups(lambda keys: keys, missed=lambda key: key == ("ns", "raced"))
        event = wakeups.event(("ns", "raced"))
        wakeups.set_waiting(("ns", "raced"), True)  # after the pass: the change came during it
        await asyncio.sleep(handlers.WAKE_COALESCE_SECONDS * 2)
        return event.is_set()

    assert asyncio.run(scenario()) is True


def test_dra_jobs_and_shapes_beyond_the_cap_are_unknown_always_woken_and_pruned_on_leave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, queue, _ = _three_free_nodes(monkeypatch)
    ref = identity.JobRef("dra", "ns", "uid-dra")
    spec = api_spec.TrainingJobSpec.model_validate(
        JobBuilder().layout(data=8, tensor=8, gpus_per_node=8).dra().raw()
    )
    demand = feasibility.Demand(requests={}, tolerations=(), node_selector={})
    assert queue.enter(ref, spec, demand).need.shape is None
    assert queue.wake([("ns", "dra")]) == [("ns", "dra")]  # 0 allocatable GPUs, woken anyway
    big = _job("big", 8)
    assert queue.enter(*big, unknown=True).need.shape is None  # re-places beside its own pods
    assert queue.wake([("ns", "big")]) == [("ns", "big")]
    for i in range(waiting.MAX_SHAPES + 1):
        r, s, _ = _job(f"j{i}", 8)
        d = feasibility.Demand(requests={GPU: 8}, tolerations=(), node_selector={"i": str(i)})
        entry = queue.enter(r, s, d)
        assert (entry.need.shape is None) is (i == waiting.MAX_SHAPES)
    for i in range(waiting.MAX_SHAPES + 1):
        queue.leave(identity.JobRef(f"j{i}", "ns", f"uid-j{i}"))
    assert queue.entries.keys() == {"uid-dra", "uid-big"}
    r, s, _ = _job("again", 8)
    again = feasibility.Demand(requests={GPU: 8}, tolerations=(), node_selector={"i": "again"})
    assert queue.enter(r, s, again).need.shape is not None  # the left shapes were pruned
    assert cache.nodes


def _waiting_job(name: str, waited: float, labels: dict[str, str] | None = None) -> dict[str, Any]:
    """A TrainingJob as the API server shows one that has waited ``waited`` seconds for GPUs."""
    began = datetime.datetime.now(datetime.UTC) - datetime.timedelta(seconds=waited)
    placed = {
        "type": conditions.PLACED,
        "status": conditions.FALSE,
        "reason": "InsufficientGPUs",
        "message": "needs 4 pods",
        "lastTransitionTime": conditions.timestamp(began),
    }
    metadata = {"name": name, "namespace": "ns", "uid": f"uid-{name}", "resourceVersion": "1"}
    return {"metadata": {**metadata, "labels": labels or {}}, "status": {"conditions": [placed]}}


def test_after_a_restart_other_jobs_wait_until_the_node_set_of_a_job_that_may_hold_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The objects say who waited long enough: a new process does not let others take its nodes
    before it planned them, nor waits for them longer than ``SETTLE_SECONDS``."""
    cache, queue, _ = _three_free_nodes(monkeypatch)
    after = capacity_queue.RESERVE_AFTER_SECONDS
    cache.jobs.upsert(_waiting_job("big", after + 60))
    cache.jobs.upsert(_waiting_job("young", after - 60))  # not long enough
    queued = {"kueue.x-k8s.io/queue-name": "main"}
    cache.jobs.upsert(_waiting_job("queued", after + 60, queued))  # Kueue orders it
    seconds = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: seconds[0])
    assert queue.unsettled("uid-small") and queue.unsettled("uid-young")
    assert not queue.unsettled("uid-big")  # it never waits for itself
    queue.settled("uid-big")
    assert not queue.unsettled("uid-small")
    fresh = waiting.Queue(cache)
    assert fresh.unsettled("uid-small")
    seconds[0] += reservation.SETTLE_SECONDS
    assert not fresh.unsettled("uid-small")  # bounded: it never planned, the others go on


class _Pokes:
    """A waker that records which jobs it was asked to wake."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str]] = []

    def poke(self, key: tuple[str, str]) -> None:
        self.jobs.append(key)

    def poke_waiting(self) -> None:
        raise AssertionError("a settled restart is no capacity change")

    def poke_devices(self, nodes: frozenset[str] | None) -> None:
        raise AssertionError("a settled restart is no device change")


def test_jobs_held_back_after_a_restart_are_woken_once_when_the_last_holder_settles(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No pass every second while they wait: one wake-up each as the window closes early, and
    the window's end as their latest pass."""
    cache, queue, _ = _three_free_nodes(monkeypatch)
    after = capacity_queue.RESERVE_AFTER_SECONDS
    cache.jobs.upsert(_waiting_job("big", after + 60))
    cache.jobs.upsert(_waiting_job("bigger", after + 90))
    pokes = _Pokes()
    cache.waker = pokes
    seconds = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: seconds[0])
    small = identity.JobRef("small", "ns", "uid-small")
    assert queue.unsettled(small.uid)
    assert queue.hold_back(small) == reservation.SETTLE_SECONDS
    seconds[0] += 5
    assert queue.hold_back(small) == reservation.SETTLE_SECONDS - 5  # held back once, not twice
    queue.settled("uid-big")
    assert pokes.jobs == [] and queue.unsettled(small.uid)  # "bigger" may still hold
    queue.settled("uid-bigger")
    assert pokes.jobs == [("ns", "small")] and not queue.unsettled(small.uid)
    queue.settled("uid-bigger")
    assert pokes.jobs == [("ns", "small")]  # woken once
    gone = identity.JobRef("gone", "ns", "uid-gone")
    fresh = waiting.Queue(cache)
    assert fresh.unsettled(gone.uid)
    fresh.hold_back(gone)
    fresh.leave(gone)  # deleted while held back: nothing to wake
    fresh.settled("uid-big"), fresh.settled("uid-bigger")
    assert pokes.jobs == [("ns", "small")]


def test_grows_and_plans_of_other_jobs_see_no_reserved_node(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``reserving.outside``: what a plan or an elastic grow of another job may take."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    large = _job("large", 4)
    queue.enter(*large)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 1
    _reserve(queue, "uid-large", "n1", "n2")
    raw = list(cache.nodes.values())
    nodes = [placement.node_from_manifest(n, GPU) for n in raw]
    other = _job("other", 1)
    kept_raw, kept = reserving.outside(queue, _state(*other), raw, nodes)
    assert sorted(n["metadata"]["name"] for n in kept_raw) == ["n0", "n3"]
    assert sorted(n.name for n in kept) == ["n0", "n3"]
    mine = reserving.outside(queue, _state(*large), raw, nodes)
    assert mine == (raw, nodes)  # the holder sees every node


def _state(
    ref: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    demand: feasibility.Demand | None = None,
    status: dict[str, Any] | None = None,
) -> job_state.JobState:
    return job_state.JobState(ref, 1, spec, (), status or {}, declared=spec)


def _limited(
    name: str, pods: int, deadline: int | None
) -> tuple[identity.JobRef, api_spec.TrainingJobSpec, feasibility.Demand]:
    """:func:`_job` with ``runPolicy.activeDeadlineSeconds`` (None: none) and a 10 s grace."""
    ref, spec, demand = _job(name, pods)
    policy = spec.run_policy.model_copy(
        update={"active_deadline_seconds": deadline, "termination_grace_period_seconds": 10}
    )
    return ref, spec.model_copy(update={"run_policy": policy}), demand


def _running_job(name: str, uid: str, deadline: int | None, started: float) -> dict[str, Any]:
    """A TrainingJob as the API server holds it, started at ``started`` (epoch seconds)."""
    policy = {"terminationGracePeriodSeconds": 10}
    if deadline is not None:
        policy["activeDeadlineSeconds"] = deadline
    stamp = datetime.datetime.fromtimestamp(started, datetime.UTC)
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid, "resourceVersion": "1"},
        "spec": {"runPolicy": policy},
        "status": {"phase": "Running", "startTime": stamp.strftime("%Y-%m-%dT%H:%M:%SZ")},
    }


def _our_pod(job: dict[str, Any], node: str, index: int = 0) -> dict[str, Any]:
    """A running pod of ``job`` on ``node`` (8 GPUs), as the operator creates them."""
    pod = _bound(f"{job['metadata']['name']}-{index}", node)
    pod["metadata"].update(
        namespace="ns",
        labels={
            naming.LABEL_MANAGED_BY: naming.MANAGED_BY,
            naming.LABEL_JOB: job["metadata"]["name"],
        },
        ownerReferences=[
            {
                "apiVersion": f"{naming.GROUP}/v1alpha1",
                "kind": api_spec.KIND,
                "name": job["metadata"]["name"],
                "uid": job["metadata"]["uid"],
                "controller": True,
            }
        ],
    )
    return pod


def test_a_job_whose_deadline_ends_it_before_the_reserved_nodes_clear_backfills_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The EASY rule on the cache: the reserved nodes are clear for the holder by the latest
    declared end of the meshtrain jobs on them; while the holder cannot start, a waiting job
    whose own declared end comes no later may take them (its plan sees them, a change wakes it
    for them), a job without a deadline or with a longer one may not.  The clear time follows
    the cache: a job on them ending early brings it in at once, a job without a deadline there
    closes backfill, and once the holder could start on its nodes backfill closes too."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    cache.pods.remove(_bound("busy", "n0"))
    clock[0] = 2000.0
    slack, grace = reservation.ENFORCE_SLACK_SECONDS, 10
    early = _running_job("early", "uid-early", 600, started=1900.0)  # gone by 2540 + slack
    late = _running_job("late", "uid-late", 3000, started=1900.0)  # gone by 4910 + slack
    for job, node in ((early, "n1"), (late, "n2")):
        cache.jobs.upsert(job)
        cache.pods.upsert(_our_pod(job, node))
    cache.pods.upsert(_bound("theirs", "n0"))  # another tenant's: never counted free
    large = _job("large", 4)
    queue.enter(*large, since=0.0)
    short, long_, unbounded = _limited("short", 2, 2000), _limited("long", 2, 5000), _job("none", 2)
    for job in (short, long_, unbounded):
        queue.enter(*job)
    kept = frozenset({"n1", "n2", "n3", "n4"})
    cache.nodes.upsert(_node("n4"))
    _reserve(queue, "uid-large", *kept)
    assert queue.holder() == queue.entries["uid-large"]
    assert queue.reserved_clear() == 1900.0 + 3000 + grace + slack  # the later of the two
    assert queue.excluded_for(_state(*short)) == frozenset()  # 2000 + 2000 + 40 <= 4940
    assert queue.excluded_for(_state(*long_)) == kept
    assert queue.excluded_for(_state(*unbounded)) == kept
    keys = [("ns", "short"), ("ns", "long"), ("ns", "none")]
    assert queue.wake(keys) == [("ns", "short")]  # n3 and n4 free, both reserved
    # a job that started earlier is bounded from its start time, not from now
    started = {"startTime": "1970-01-01T00:00:00Z"}  # 2,000 s ago: gone by 5040 > 4940
    assert queue.excluded_for(_state(*long_, status=started)) == kept
    assert queue.excluded_for(_state(*_limited("older", 2, 4800), status=started)) == frozenset()

    cache.pods.remove(_our_pod(late, "n2"))  # the later job ends early: no re-plan needed
    assert queue.reserved_clear() == 1900.0 + 600 + grace + slack
    assert queue.excluded_for(_state(*short)) == kept  # 4040 > 2540

    unlimited = _running_job("late", "uid-late", None, started=1900.0)  # its deadline removed
    unlimited["metadata"]["resourceVersion"] = "2"
    cache.jobs.upsert(unlimited)
    cache.pods.upsert(_our_pod(late, "n2", 1))  # a job there without a deadline: unknown end
    assert queue.reserved_clear() is None
    assert queue.excluded_for(_state(*_limited("tiny", 1, 1))) == kept

    cache.pods.remove(_our_pod(late, "n2", 1))
    cache.pods.remove(_our_pod(early, "n1"))  # all four free: the holder may start, it goes first
    assert queue.reserved_clear() == clock[0]
    assert queue.excluded_for(_state(*_limited("tiny", 1, 1))) == kept


def test_a_job_whose_backfill_ended_with_time_alone_is_not_planned_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An unstarted job's declared end moves with the clock: once past the reserved nodes'
    clear time it may use fewer nodes than its last plan saw, and no capacity changed: no plan
    (issue #36's one plan per admitting change)."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    clock[0] = 2000.0
    filler = _running_job("filler", "uid-filler", 600, started=1900.0)  # clear by 2540
    cache.jobs.upsert(filler)
    cache.pods.upsert(_our_pod(filler, "n1"))
    cache.nodes.upsert(_node("n4"))  # free, outside the reservation: the slot count admits it
    large = _job("large", 4)
    queue.enter(*large, since=0.0)
    short = _limited("short", 1, 400)  # 2000 + 440 <= 2540
    queue.enter(*short)
    _reserve(queue, "uid-large", "n1", "n2", "n3")
    queue.planning(short[0], 1)  # its plan saw the reserved nodes
    assert queue.excluded_for(_state(*short)) == frozenset()
    clock[0] = 2200.0  # now its end, 2640, comes after the clear time
    assert queue.excluded_for(_state(*short)) == {"n1", "n2", "n3"}
    assert queue.unchanged(short[0], 1)


def test_the_reserved_nodes_clear_by_the_latest_declared_end_of_the_pods_on_them() -> None:
    """``pod_end`` and ``clear_by`` on jobs and pods as the cache keeps them."""
    now = 1_000_000.0
    job = informer.trim_job(
        {
            "metadata": {"name": "j", "namespace": "ns", "uid": "u"},
            "spec": {
                "runPolicy": {
                    "activeDeadlineSeconds": 600,
                    "terminationGracePeriodSeconds": 20,
                    "backoffLimit": 3,
                }
            },
            "status": {"startTime": "1970-01-12T13:46:40Z", "phase": "Running"},  # = now
        }
    )
    assert job["spec"] == {
        "runPolicy": {"activeDeadlineSeconds": 600, "terminationGracePeriodSeconds": 20}
    }
    slack = reservation.ENFORCE_SLACK_SECONDS
    assert reservation.pod_end({}, job, now) == now + 600 + 20 + slack
    assert reservation.pod_end(None, job, now) == now + 600 + 20 + slack  # assumed, not created
    unbounded = informer.trim_job(
        {"metadata": {"uid": "v"}, "status": {"startTime": "1970-01-12T13:46:40Z"}}
    )
    assert reservation.pod_end({}, unbounded, now) is None
    assert reservation.pod_end({}, None, now) is None  # its job is not in the cache
    deleting = {"metadata": {"deletionTimestamp": "1970-01-12T13:47:40Z"}}  # now + 60 (its grace)
    assert reservation.pod_end(deleting, None, now) == now + 60 + slack
    default = informer.trim_job({"spec": {"runPolicy": {"activeDeadlineSeconds": 5}}})
    assert (
        reservation.pod_end({}, default, now) == now + 5 + reservation.DEFAULT_GRACE_SECONDS + slack
    )
    backfilled = {"holder": "ns/big", "deadlineAt": "1970-01-12T13:47:40Z"}  # now + 60
    raised = informer.trim_job(
        {
            "spec": {"runPolicy": {"activeDeadlineSeconds": 9999}},  # raised after it backfilled
            "status": {"startTime": "1970-01-12T13:46:40Z", "backfill": backfilled},
        }
    )
    grace = reservation.DEFAULT_GRACE_SECONDS
    assert reservation.pod_end({}, raised, now) == now + 60 + grace + slack  # the kept deadline
    spec = _limited("j", 1, None)[1]  # its deadline removed since
    assert reservation.job_end(spec, {"backfill": backfilled}, now) == now + 60 + 10 + slack
    assert reservation.clear_by([], now) == now
    assert reservation.clear_by([now + 5, now + 9], now) == now + 9
    assert reservation.clear_by([now + 5, None], now) is None


def test_a_holder_whose_node_set_found_no_place_passes_on_until_the_nodes_change(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache, queue, clock = _three_free_nodes(monkeypatch)
    large, other = _job("large", 4), _job("other", 2)
    queue.enter(*large, since=0.0)
    queue.enter(*other, since=1.0)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 2
    queue.unfit("uid-large")  # its plan with meshtrain's pods gone placed nothing
    assert queue.holder() == queue.entries["uid-other"]
    queue.enter(*large)  # planned again, same nodes: still may not hold
    assert queue.holder() == queue.entries["uid-other"]
    cache.nodes.upsert(_node("n4"))
    queue.enter(*large)
    assert queue.holder() == queue.entries["uid-large"]


def test_a_job_the_counts_admit_but_the_plan_cannot_place_is_not_planned_again_until_capacity_changes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Enough free slots, yet its plan placed nothing (a required level, fragmentation): a resync
    or its own status write plans nothing until a change the wake-up rule admits it on."""
    _, queue, _ = _three_free_nodes(monkeypatch)
    fits = _job("fits", 2)
    ref = fits[0]
    queue.planning(ref, 1)
    queue.enter(*fits)  # 3 free slots >= 2, but say its plan found no domain holding both
    assert queue.wake([("ns", "fits")]) == [("ns", "fits")]  # the counts alone would admit it
    assert queue.unchanged(ref, 1) is True  # nothing changed since that plan: no plan
    queue.capacity_changed()
    assert queue.unchanged(ref, 1) is False  # a change it could be admitted on: one plan
    queue.planning(ref, 1)
    assert queue.unchanged(ref, 1) is True


def test_a_job_whose_plan_left_out_nodes_for_a_while_is_planned_once_when_the_first_returns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A straggler's or a refused node's exclusion ends with time, not with a capacity change:
    until the first avoided node returns, no change means no plan (the reconciler requeues then);
    then one pass plans it, owed to time; a resync after that plan does not."""
    _, queue, _ = _three_free_nodes(monkeypatch)
    ticks = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: ticks[0])
    fits = _job("fits", 2)
    ref = fits[0]
    queue.planning(ref, 1)
    queue.enter(*fits, avoided_until=(ticks[0] + 300.0, frozenset({"n1"})))
    assert queue.unchanged(ref, 1) is True and not queue.time_changed(ref.uid)
    assert queue.time_left(ref.uid) == 300.0
    ticks[0] += 300.0
    assert queue.time_changed(ref.uid)
    assert queue.time_left(ref.uid) == waiting.TIME_CHANGE_RETRY_SECONDS  # owed, never at once
    assert queue.unchanged(ref, 1) is False  # the node is back: the pass owed now plans it
    assert queue.owed_to_time(ref.uid) and not queue.owed_to_time(ref.uid)  # told once
    assert queue.time_left(ref.uid) is None and queue.unchanged(ref, 1) is True  # judged once
    queue.planning(ref, 1)
    queue.enter(*fits)  # planned again without exclusions: back to the capacity rule
    assert queue.unchanged(ref, 1) is True and not queue.time_changed(ref.uid)


def test_an_avoided_node_returns_when_the_last_rule_that_avoids_it_ends() -> None:
    """``GangFit.avoided_until``: a node both refused by the scheduler and replaced as a
    straggler returns at the later end; one excluded for good, or no longer in the cluster,
    brings no change of time."""
    cache = informer.Cache()
    for name in ("a", "b", "forever"):
        cache.nodes.upsert(_node(name))
    fit = gang_fit.GangFit(cache, None, worker=None)  # type: ignore[arg-type]  # not planned
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    at = 500.0
    since = now - datetime.timedelta(seconds=excluded_nodes.EXCLUSION_SECONDS - 100)
    body = JobBuilder("avoids", "ns").manifest()
    body["metadata"]["uid"] = "uid-avoids"
    body["status"] = {
        "excludedNodes": [
            {"node": "a", "reason": "Straggler", "time": conditions.timestamp(since)},
            {"node": "forever", "reason": "Straggler"},  # no time: excluded for good
            {"node": "gone", "reason": "Straggler", "time": conditions.timestamp(now)},
        ]
    }
    job = job_state.read(body)
    fit.refusals[job.ref.uid] = rescheduling.replaced(None, ["a", "b"], now=at - 240.0)
    gpu = job.spec.resources.gpu_resource_name
    refused_for = rescheduling.EXCLUDED_SECONDS - 240.0  # 60 s left of the refusal
    assert refused_for < 100.0
    assert fit.avoided_until(job, gpu, now, at) == (at + refused_for, {"b"})
    del fit.refusals[job.ref.uid]
    assert fit.avoided_until(job, gpu, now, at) == (at + 100.0, {"a"})  # the straggler rule's
    fit.refusals[job.ref.uid] = rescheduling.replaced(None, ["a"], now=at)  # 300 s > 100 s
    assert fit.avoided_until(job, gpu, now, at) == (at + rescheduling.EXCLUDED_SECONDS, {"a"})
    body["status"]["excludedNodes"] = body["status"]["excludedNodes"][1:]
    del fit.refusals[job.ref.uid]
    assert fit.avoided_until(job_state.read(body), gpu, now, at) is None


class _PlannedFit:
    """A ``GangFit`` whose plan of the holder's node set picks ``self.nodes``."""

    def __init__(self, cache: informer.Cache) -> None:
        self.cache = cache
        self.nodes: tuple[str, ...] = ()
        self.claims: dict[str, Any] = {}

    def candidates(self, job: Any, gpu: str, now: Any) -> tuple[list, list, frozenset[str]]:
        return [], [], frozenset()

    async def plan_sizes(self, *_: Any, **__: Any) -> Any:
        answer = placement.Placement(self.nodes, {}, 0.0, (), {})
        return type("Sized", (), {"answer": answer})()


def test_a_reservation_that_lets_nodes_go_has_the_other_waiting_jobs_judged_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The holder's node set planned again on other nodes: a job the released node can take is
    planned at its next pass; the holder itself is not (its plan could use its nodes all along),
    and a node set that only grew releases nothing."""
    cache, queue, clock = _three_free_nodes(monkeypatch)  # n0 busy; n1-n3 free
    fit = _PlannedFit(cache)
    large, small = _job("large", 4), _job("small", 1)
    queue.enter(*large)
    clock[0] = capacity_queue.RESERVE_AFTER_SECONDS + 1
    job = job_state.JobState(large[0], 1, large[1], (), {}, declared=large[1])

    def reserve(*nodes: str) -> None:
        fit.nodes = nodes
        asyncio.run(reserving._plan(queue, fit, job, large[2]))  # type: ignore[arg-type]
        assert queue.reserved_nodes() == frozenset(nodes)

    reserve("n1", "n2", "n3")
    for ref, *_ in (large, small):
        queue.planning(ref, 1)
    queue.enter(*small)  # no free node outside the reserved ones
    assert queue.unchanged(small[0], 1) and queue.unchanged(large[0], 1)
    reserve("n0", "n1", "n2", "n3")  # grew: nothing released
    assert queue.unchanged(small[0], 1) and queue.unchanged(large[0], 1)
    reserve("n0", "n1", "n2")  # n3 let go
    assert not queue.unchanged(small[0], 1)  # n3 is free: one plan
    assert queue.unchanged(large[0], 1)


class _TriedFit(_PlannedFit):
    """A ``GangFit`` on the cache's nodes whose plans of the holder's node set are recorded: the
    first ``cut`` tries run out of time, any other places the gang on the nodes it was given."""

    def __init__(self, cache: informer.Cache, cut: int = 0) -> None:
        super().__init__(cache)
        self.tries: list[set[str]] = []
        self.cut = cut

    def candidates(self, job: Any, gpu: str, now: Any) -> tuple[list, list, frozenset[str]]:
        raw = list(self.cache.nodes.values())
        return raw, [placement.node_from_manifest(n, gpu) for n in raw], frozenset()

    async def plan_sizes(self, job: Any, raw: list, nodes: list, *_: Any, **__: Any) -> Any:
        self.tries.append({n.name for n in nodes})
        if len(self.tries) <= self.cut:
            raise planning.DeadlineExceeded(10)
        chosen = tuple(sorted(n.name for n in nodes))[-2:]
        answer = placement.Placement(chosen, {}, 0.0, (), {})
        return type("Sized", (), {"answer": answer})()


@pytest.mark.parametrize("cut", [0, 1])
def test_the_holder_s_node_set_is_planned_first_where_the_declared_limits_clear_it_soonest(
    monkeypatch: pytest.MonkeyPatch, cut: int
) -> None:
    """n1's job ends by its limit in 10 minutes, n2's in 50, n3 is free, n0 another tenant's: a
    gang of two is planned first on n1 and n3 (``reserving._plan``), and on every node only when
    that try runs out of time (a cut-off try is no verdict on the others)."""
    cache, queue, clock = _three_free_nodes(monkeypatch)
    clock[0] = 2000.0
    for name, node, deadline in (("soon", "n1", 600), ("later", "n2", 3000)):
        job = _running_job(name, f"uid-{name}", deadline, started=1900.0)
        cache.jobs.upsert(job)
        cache.pods.upsert(_our_pod(job, node))
    large = _job("large", 2)
    queue.enter(*large, since=0.0)
    fit = _TriedFit(cache, cut)
    held = job_state.JobState(large[0], 1, large[1], (), {}, declared=large[1])
    asyncio.run(reserving._plan(queue, fit, held, large[2]))  # type: ignore[arg-type]
    every = {"n0", "n1", "n2", "n3"}
    assert fit.tries == ([{"n1", "n3"}] if cut == 0 else [{"n1", "n3"}, every])
    assert queue.reservation is not None
    assert queue.reservation.nodes == ({"n1", "n3"} if cut == 0 else {"n2", "n3"})


def test_a_change_of_time_plans_only_where_the_counts_admit_the_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An avoided node's return (or a hold's end) is judged as a capacity change is: a job the
    free slots cannot hold is not planned for it, and no plan is owed to it."""
    _, queue, _ = _three_free_nodes(monkeypatch)  # 3 free slots
    ticks = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: ticks[0])
    large = _job("large", 4)
    ref = large[0]
    queue.planning(ref, 1)
    queue.enter(
        *large, avoided_until=(ticks[0] + 5.0, frozenset({"n1"})), held_until=ticks[0] + 9.0
    )
    assert queue.time_left(ref.uid) == 5.0  # the first of the two
    ticks[0] += 5.0
    assert queue.unchanged(ref, 1) is True and not queue.owed_to_time(ref.uid)
    assert queue.time_left(ref.uid) == 4.0  # judged the node's return; the hold still runs
    ticks[0] += 4.0
    assert queue.unchanged(ref, 1) is True and not queue.owed_to_time(ref.uid)
    assert not queue.time_changed(ref.uid) and queue.time_left(ref.uid) is None


def test_an_avoided_node_that_comes_back_full_owes_no_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The free slots would admit the job, but the node that came back has no room for a pod
    of it: its return changes nothing the plan could use."""
    _, queue, _ = _three_free_nodes(monkeypatch)  # n0 busy
    ticks = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: ticks[0])
    fits = _job("fits", 2)
    ref = fits[0]
    for node, planned in (("n0", False), ("n1", True)):
        queue.planning(ref, 1)
        queue.enter(*fits, avoided_until=(ticks[0] + 5.0, frozenset({node})))
        ticks[0] += 5.0
        assert queue.unchanged(ref, 1) is not planned and queue.owed_to_time(ref.uid) is planned


def test_a_job_a_preferred_level_holds_is_planned_once_more_when_its_hold_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``waitSeconds``: while the hold runs, no change means no plan (the reconciler's requeue
    comes when it ends); then a pass plans it, across domains if need be, with no change."""
    _, queue, _ = _three_free_nodes(monkeypatch)
    ticks = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: ticks[0])
    fits = _job("fits", 2)
    ref = fits[0]
    queue.planning(ref, 1)
    queue.enter(*fits, held_until=ticks[0] + 30.0)
    assert queue.unchanged(ref, 1) is True
    assert queue.time_left(ref.uid) == 30.0
    ticks[0] += 30.0
    assert queue.unchanged(ref, 1) is False  # the pass owed now plans it
    assert queue.time_left(ref.uid) is None  # judged: no requeue at once, again and again
    queue.planning(ref, 1)
    queue.enter(*fits)  # planned without a hold: the capacity rule again
    assert queue.unchanged(ref, 1) is True
    queue.enter(*fits, held_until=ticks[0] + 5.0)
    queue.leave(ref)
    assert queue.time_left(ref.uid) is None


def test_while_a_level_holds_a_job_only_a_change_that_frees_one_domain_for_it_wakes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Racks r0 (n0, n1) and r1 (n2, n3); n0 and n2 busy.  A 2-pod job held to one rack: the two
    free slots (one per rack) wake it no more; a change that frees a rack does; once the hold
    ends the fleet-wide count decides again."""
    cache = informer.Cache()
    for i in range(4):
        node = _node(f"n{i}")
        node["metadata"]["labels"] = {"example.com/rack": f"r{i // 2}"}
        cache.nodes.upsert(node)
    cache.pods.upsert(_bound("busy0", "n0"))
    cache.pods.upsert(_bound("busy2", "n2"))
    queue = waiting.Queue(cache)
    ticks = [1000.0]
    monkeypatch.setattr(waiting.time, "monotonic", lambda: ticks[0])
    held = _job("held", 2)
    queue.enter(*held, held_until=ticks[0] + 30.0, held_in=frozenset({"example.com/rack"}))
    assert queue.free_slots(waiting.shape_of(held[2])) == 2  # the count alone would admit it
    assert queue.wake([("ns", "held")]) == []
    cache.pods.remove(_bound("busy0", "n0"))  # rack r0 free
    assert queue.wake([("ns", "held")]) == [("ns", "held")]
    cache.pods.upsert(_bound("busy0", "n0"))
    ticks[0] += 30.0  # the hold ended: the count decides (and a pass is owed anyway)
    assert queue.wake([("ns", "held")]) == [("ns", "held")]


@pytest.mark.parametrize("seed", range(40))
def test_a_held_job_is_woken_whenever_a_plan_with_its_held_levels_required_would_place_it(
    seed: int,
) -> None:
    """The wake rule of a held job stays a necessary condition of a placement: on random small
    fleets (unlabelled nodes, busy GPUs, 8- and 16-GPU nodes) whenever ``placement.plan`` with the
    held levels required places the gang, the job is woken."""
    rng = random.Random(seed)
    rack, block = "example.com/rack", "example.com/block"
    cache, offered = informer.Cache(), []
    for i in range(rng.randint(2, 8)):
        gpus = rng.choice([8, 16])
        node = _node(f"n{i}", gpus)
        labels = {rack: f"r{rng.randint(0, 2)}"} if rng.random() < 0.8 else {}
        if rng.random() < 0.8:
            labels[block] = f"b{rng.randint(0, 1)}"
        node["metadata"]["labels"] = labels
        cache.nodes.upsert(node)
        busy = rng.choice([0, 0, 8, gpus])
        if busy:
            cache.pods.upsert(_bound(f"busy{i}", f"n{i}", busy))
        offered.append(placement.Node(f"n{i}", gpus - busy, labels))
    pods = rng.randint(1, 3)
    levels = [{"label": block, "waitSeconds": 60}, {"label": rack, "waitSeconds": 60}]
    spec = api_spec.TrainingJobSpec.model_validate(
        JobBuilder().layout(data=8 * pods, gpus_per_node=8).topology(levels=levels).raw()
    )
    held = frozenset(rng.sample([block, rack], rng.randint(1, 2)))
    demand = feasibility.Demand(requests={GPU: 8}, tolerations=(), node_selector={})
    queue = waiting.Queue(cache)
    ref = identity.JobRef("held", "ns", "uid-held")
    queue.enter(ref, spec, demand, held_until=time.monotonic() + 60, held_in=held)
    planned = placement.plan(placement_request.request_from_spec(spec, held), offered, [])
    if isinstance(planned, placement.Placement):
        assert queue.wake([("ns", "held")]) == [("ns", "held")], (held, offered, planned)


def test_the_holder_is_tried_first_on_the_nodes_that_clear_soonest() -> None:
    """``clearing_limits``: walking the nodes that can take a pod of the holder from the soonest
    declared end, the end at which their slots reach its pods times 1, 1.25, 1.5 and 2; then
    every node.  A node that takes none of its pods, or whose end is unknown, bounds nothing."""
    ends = {f"n{i}": 100.0 + i for i in range(10)} | {"x": math.inf, "full": 50.0}
    slots = {f"n{i}": 1 for i in range(10)} | {"x": 1, "full": 0}
    assert reservation.clearing_limits(ends, slots, 4) == [103.0, 104.0, 105.0, 107.0, math.inf]
    assert reservation.clearing_limits(ends, slots, 8) == [107.0, 109.0, math.inf]  # 10 known
    two = {name: 2 for name in slots if name != "full"}  # two pods a node: half the nodes
    assert reservation.clearing_limits(ends, two, 4) == [101.0, 102.0, 103.0, math.inf]
    assert reservation.clearing_limits({"x": math.inf}, {"x": 1}, 1) == [math.inf]
    # the set planned before clears at 106: tried too, so a plan again keeps a set no later
    assert reservation.clearing_limits(ends, slots, 4, 106.0) == [103, 104, 105, 106, 107, math.inf]
    assert reservation.clearing_limits(ends, slots, 4, math.inf) == [103, 104, 105, 107, math.inf]
