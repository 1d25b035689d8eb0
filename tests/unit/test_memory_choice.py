"""The restore choice of in-memory checkpoints: which step every rank's shard exists of, who sends
what, and memory against storage (no processes: the pure parts of memory.py and recovery.py)."""

from __future__ import annotations

import pytest

from meshtrain.trainer.checkpointing import memory, recovery


@pytest.mark.parametrize(
    ("held", "world", "expected"),
    [
        # every rank has its own copy of step 20 (and 10): 20, nothing to send
        ([[(0, 10), (0, 20), (1, 20)], [(1, 10), (1, 20), (0, 20)]], 2, (20, [])),
        # pod 1 replaced (empty): rank 0 holds rank 1's peer copy and sends it
        ([[(0, 20), (1, 20)], []], 2, (20, [(0, 1)])),
        # step 20 of rank 1 is nowhere: the newest complete step is 10
        ([[(0, 10), (0, 20), (1, 10)], [(1, 10)]], 2, (10, [])),
        # both copies of rank 1 lost: no step
        ([[(0, 20)], [(0, 20)]], 2, None),
        # the lowest holder sends; ranks outside the world are ignored
        ([[(0, 5), (2, 5)], [(1, 5), (2, 5), (7, 5)], []], 3, (5, [(0, 2)])),
        ([[], []], 2, None),
    ],
)
def test_choose_the_newest_step_every_shard_exists_of(held, world, expected) -> None:
    assert memory.choose(held, world) == expected


def _pods(*nodes: str, per_pod: int) -> list[str]:
    """Each pod's node, for each of its ``per_pod`` ranks (ranks in pod order)."""
    return [node for node in nodes for _ in range(per_pod)]


@pytest.mark.parametrize(
    ("nodes", "expected"),
    [
        # one pod per node: the same local rank of the next pod, as before
        (_pods("a", "b", per_pod=8), [*range(8, 16), *range(8)]),
        (_pods("a", "b", "c", per_pod=2), [2, 3, 4, 5, 0, 1]),
        # four pods of one rank, two on each node: never the neighbour pod on the same node
        (_pods("a", "a", "b", "b", per_pod=1), [2, 3, 0, 1]),
        # the placement interleaved the nodes: still across
        (_pods("a", "b", "a", "b", per_pod=2), [2, 3, 0, 1, 6, 7, 4, 5]),
        # every pod on one node: no peer copy (it would die with the original)
        (_pods("a", "a", per_pod=2), None),
        (["a"], None),
    ],
    ids=["two-nodes", "three-nodes", "two-pods-a-node", "interleaved", "one-node", "one-rank"],
)
def test_the_buddy_is_on_another_node(nodes: list[str], expected: list[int] | None) -> None:
    chosen = memory.buddies(nodes)
    assert chosen == expected
    if chosen is not None:
        assert sorted(chosen) == list(range(len(nodes)))  # each rank keeps exactly one copy
        assert memory.same_node(nodes, chosen) == []  # one node's loss leaves a copy of each


def test_a_node_with_more_than_half_the_ranks_is_named() -> None:
    nodes = _pods("a", "a", "b", per_pod=1)
    chosen = memory.buddies(nodes)
    assert chosen is not None and sorted(chosen) == [0, 1, 2]
    assert memory.same_node(nodes, chosen) == [1]  # rank 1's copy is on node a as well


def test_the_node_name_and_its_fallback_outside_kubernetes() -> None:
    assert memory.node_name({"MESHTRAIN_NODE_NAME": "gpu-7", "GROUP_RANK": "1"}, 3) == "gpu-7"
    assert memory.node_name({"GROUP_RANK": "1"}, 3) == "pod-1"  # torchrun's and the supervisor's
    assert memory.node_name({"LOCAL_WORLD_SIZE": "2"}, 3) == "pod-1"
    assert memory.node_name({"GROUP_RANK": "x", "LOCAL_WORLD_SIZE": "0"}, 3) == "pod-0"
    assert len(memory.node_name({"MESHTRAIN_NODE_NAME": "n" * 999}, 0)) == memory.MAX_NODE_NAME


class _Snapshots:
    """A stand-in whose snapshot fails half-way (recovery.restore's fallback, without processes)."""

    resumed = None

    def available(self) -> int:
        return 6

    def restore(self) -> int:
        raise memory.HalfLoaded("rank 1: copy failed")


class _Saver:
    def __init__(self, on_storage: int | None) -> None:
        self.on_storage, self.restored = on_storage, False

    def locate(self) -> int | None:
        return self.on_storage

    def restore(self) -> int | None:
        self.restored = True
        return self.on_storage


def test_a_snapshot_failing_half_way_is_overwritten_from_storage() -> None:
    saver = _Saver(4)
    assert recovery.restore(None, saver, _Snapshots()) == (4, "storage")  # type: ignore[arg-type]
    assert saver.restored


def test_a_snapshot_failing_half_way_without_storage_asks_for_a_fresh_engine() -> None:
    saver = _Saver(None)
    with pytest.raises(memory.HalfLoaded, match="copy failed"):
        recovery.restore(None, saver, _Snapshots())  # type: ignore[arg-type]
    assert saver.restored  # storage was asked first


@pytest.mark.parametrize(
    ("in_memory", "on_storage", "expected"),
    [(20, 10, True), (20, 20, True), (10, 20, False), (None, 20, False), (10, None, True)],
)
def test_memory_is_preferred_unless_storage_is_newer(in_memory, on_storage, expected) -> None:
    assert recovery.prefer_memory(in_memory, on_storage) is expected


def test_default_root_is_per_job_and_uid_and_the_override_wins() -> None:
    env = {"MESHTRAIN_NAMESPACE": "ns", "MESHTRAIN_JOB_NAME": "job", "MESHTRAIN_JOB_UID": "1-a"}
    assert str(memory.default_root(env)) == "/dev/shm/meshtrain/ns/job/1-a"
    assert str(memory.default_root(env | {memory.ROOT_ENV: "/x"})) == "/x"
    with pytest.raises(ValueError, match="MESHTRAIN_JOB_UID"):
        memory.default_root(env | {"MESHTRAIN_JOB_UID": "../../etc"})
