"""The store host's heartbeat watch, on a real TCPStore: a pod whose heartbeat stops changing is
declared lost once (its ranks' round moves on), one that moves again is watched afresh, one that
left is not watched; pod 0 is watched like the others when the store runs in a pod of its own."""

from __future__ import annotations

import time
import types

import pytest

from meshtrain.trainer import launch
from meshtrain.trainer.recovery import liveness, rendezvous


@pytest.fixture
def store():
    return rendezvous.connect("127.0.0.1", launch.free_port(), master=True, timeout_s=10)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The watch's monotonic clock, moved by hand (the module's only: the store's waits keep theirs)."""
    now = [1000.0]
    fake = types.SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    monkeypatch.setattr(liveness, "time", fake)
    return now


def _watch(store, said: list[str]) -> liveness.PodWatch:
    return liveness.PodWatch(store, range(2), 2, 10, said.append)


def test_pod_0_whose_heartbeat_stops_is_declared_lost_once_and_its_round_moves(store, clock):
    rendezvous.init_generation(store)
    for rank in range(4):  # every rank joined round 0
        rendezvous.join(
            store,
            0,
            rank,
            1,
            1,
            member=f"m{rank}",
            incarnation=rendezvous.Incarnation(rank // 2, 1, f"uid-{rank // 2}"),
        )
    said: list[str] = []
    watch = _watch(store, said)
    store.set(liveness.heartbeat_key(0), "1")
    store.set(liveness.heartbeat_key(1), "1")
    watch.look()
    assert watch.alive(1.0)
    clock[0] += liveness.HEARTBEAT_TIMEOUT_S / 2
    store.set(liveness.heartbeat_key(1), "2")  # pod 1 beats, pod 0 does not
    watch.look()
    clock[0] += liveness.HEARTBEAT_TIMEOUT_S / 2 + 1
    watch.look()
    assert rendezvous.generation(store) == 1, said
    summary = rendezvous.summary(store, 1)
    assert summary["tier"] == "pod" and summary["ranks"] == (0, 1), summary
    assert said == ["pod 0 lost (no heartbeat for 31s): a round waits for it"]
    clock[0] += liveness.HEARTBEAT_TIMEOUT_S
    store.set(liveness.heartbeat_key(1), "3")
    watch.look()  # pod 0 still silent: not declared again
    assert rendezvous.generation(store) == 1 and len(said) == 1


def test_a_pod_that_left_or_never_beat_is_not_watched(store, clock):
    rendezvous.init_generation(store)
    said: list[str] = []
    watch = _watch(store, said)
    store.set(liveness.heartbeat_key(0), "1")
    store.set(rendezvous.left_key(0), "1")
    watch.look()
    clock[0] += 10 * liveness.HEARTBEAT_TIMEOUT_S
    watch.look()
    assert said == [] and rendezvous.generation(store) == 0
    assert not watch.alive(liveness.HEARTBEAT_TIMEOUT_S)
