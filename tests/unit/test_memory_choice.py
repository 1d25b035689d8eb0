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


@pytest.mark.parametrize(
    ("rank", "world", "per_pod", "expected"),
    [(0, 16, 8, 8), (9, 16, 8, 1), (15, 16, 8, 7), (3, 8, 8, None), (2, 6, 2, 4), (5, 6, 2, 1)],
)
def test_the_buddy_is_the_same_local_rank_of_the_next_pod(rank, world, per_pod, expected) -> None:
    assert memory.buddy(rank, world, per_pod) == expected
    if expected is not None:  # never a rank of the same pod: one node's loss leaves a copy
        assert expected // per_pod != rank // per_pod


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
