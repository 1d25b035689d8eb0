"""The pollers' change counter on a real TCPStore: a rank's watcher on a quiet gang reads one key
per poll, not every key; each writer the watchers must see (a new round, the halt, a new
incarnation of the pod) wakes it; a change whose writer died before its bump is still seen,
within the full-read interval (docs/recovery.md, "Store load")."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from meshtrain.trainer.recovery import abort, generations, rendezvous

QUIET_S = 3.0


class CountingStore:
    """A TCPStore client that counts the requests made through it (and through its clones)."""

    def __init__(self, inner: Any, calls: collections.Counter[str] | None = None) -> None:
        self.inner = inner
        self.calls: collections.Counter[str] = collections.Counter() if calls is None else calls

    def clone(self) -> CountingStore:
        return CountingStore(self.inner.clone(), self.calls)

    def set_timeout(self, timeout: Any) -> None:
        self.inner.set_timeout(timeout)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self.inner, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        return counted


@pytest.fixture
def watchers() -> Iterator[list[generations.Watcher]]:
    """The watchers a test started, stopped at its end whatever happened."""
    started: list[generations.Watcher] = []
    yield started
    for watcher in started:
        watcher.stop()
        watcher.join(5)


def _watch(
    store: Any, started: list[generations.Watcher], full_read_s: float = 60.0
) -> tuple[generations.Watcher, collections.Counter[str]]:
    """A rank's real watcher on a counting client; ``full_read_s`` long: only the counter wakes it."""
    counting = CountingStore(store)
    incarnation = rendezvous.take_incarnation(store, 0, "pod-0")
    assert incarnation is not None
    watcher = generations.Watcher(
        counting,  # type: ignore[arg-type]
        rendezvous.generation(store),
        abort.GlooSockets(store.port),
        backend="gloo",
        incarnation=incarnation,
        full_read_s=full_read_s,
    )
    watcher.start()
    started.append(watcher)
    return watcher, counting.calls


EVERY_KEY = 6
"""Requests of one read of every key: generation, halt and the incarnation, a check and a get each."""


def test_a_watcher_on_a_quiet_gang_reads_one_key_per_poll(store, watchers) -> None:
    watcher, calls = _watch(store, watchers)
    time.sleep(QUIET_S)
    watcher.stop()
    watcher.join(5)
    polls = calls["add"]  # the counter, once a poll
    assert polls >= 3, calls
    assert sum(calls.values()) - polls <= EVERY_KEY, calls  # the keys once: the first poll
    assert not watcher.fired.is_set()


@pytest.mark.parametrize(
    "change",
    [
        lambda s: rendezvous.start_round(
            s, rendezvous.generation(s), rendezvous.Failure("process", "x", (1,), time.time()), 5
        ),
        lambda s: rendezvous.halt(s, 75),
        lambda s: rendezvous.take_incarnation(s, 0, "pod-0-again"),
    ],
    ids=["new-round", "halt", "new-incarnation"],
)
def test_every_change_a_watcher_must_see_wakes_it_at_the_next_poll(store, watchers, change) -> None:
    """No full read is due for a minute: only the writer's bump can wake the watcher."""
    watcher, _ = _watch(store, watchers)
    time.sleep(3 * generations.WATCH_S)  # past its first poll
    change(store)
    assert watcher.fired.wait(30 * generations.WATCH_S), "not seen: the writer did not bump"


def test_a_change_whose_writer_died_before_its_bump_is_seen_by_the_next_full_read(
    store, watchers
) -> None:
    full_read_s = 1.0
    watcher, _ = _watch(store, watchers, full_read_s)
    time.sleep(3 * generations.WATCH_S)
    store.set(rendezvous.GENERATION, "1:died-before-bumping")  # no bump of the counter
    assert watcher.fired.wait(full_read_s + 5.0), "missed"


def test_the_gate_reads_the_keys_when_the_counter_moved_or_the_interval_passed(store) -> None:
    gate = rendezvous.ChangeGate(store, full_read_s=10.0)
    assert gate.moved(now=0.0)  # never read
    assert not gate.moved(now=1.0)
    rendezvous.halt(store, 1)
    assert gate.moved(now=2.0)
    assert not gate.moved(now=3.0)
    assert gate.moved(now=12.0)  # the interval
    gate.forget()  # a failed read of the keys
    assert gate.moved(now=12.5)
