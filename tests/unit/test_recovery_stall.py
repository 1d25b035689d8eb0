"""The store host's stall watch, on a real TCPStore: a round whose every rank joined and whose rank 0
stopped marking progress is taken for hung once (the next round starts, cause ``stalled``); a round
still forming, a mark that moves, a finished or halted gang, and a timeout of 0 never are; with
no in-place budget the stall halts the gang for a rebuild.  The supervisor test
(``tests/trainer/test_supervise.py``) runs a real hung collective through it."""

from __future__ import annotations

import time
import types

import pytest

from meshtrain.api import exitcodes
from meshtrain.trainer.recovery import rendezvous, stall

TIMEOUT_S = 60.0
WORLD = 2


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The watch's monotonic clock, moved by hand (the store's own waits keep theirs)."""
    now = [1000.0]
    monkeypatch.setattr(
        stall, "time", types.SimpleNamespace(monotonic=lambda: now[0], time=time.time)
    )
    return now


def _join(store, round_: int, ranks: range) -> None:
    for rank in ranks:
        outcome = rendezvous.join(
            store,
            round_,
            rank,
            1,  # each call returns at once; the round's count is what the watch reads
            1,
            member=f"m{round_}-{rank}",
            incarnation=rendezvous.Incarnation(rank, 1, f"uid-{rank}"),
        )
        assert outcome == "ready", outcome


def _watch(store, said: list[str], limit: int = 10, timeout_s: float = TIMEOUT_S):
    return stall.StallWatch(store, WORLD, timeout_s, limit, said.append)


def test_a_formed_round_whose_mark_stops_is_taken_for_hung_once(store, clock) -> None:
    said: list[str] = []
    watch = _watch(store, said)
    _join(store, 0, range(WORLD))
    rendezvous.mark_progress(store, 0, "restored")
    assert not watch.look()
    for step in (1, 2, 3):  # progress: the clock starts again at each mark
        clock[0] += TIMEOUT_S - 1
        rendezvous.mark_progress(store, 0, str(step))
        assert not watch.look()
    clock[0] += TIMEOUT_S - 1
    assert not watch.look() and rendezvous.generation(store) == 0
    clock[0] += 2
    assert watch.look()
    assert rendezvous.generation(store) == 1, said
    summary = rendezvous.summary(store, 1)
    assert summary["tier"] == "process" and summary["cause"] == stall.STALLED, summary
    assert summary["ranks"] == ()
    assert said and "no progress from rank 0 for 61s" in said[0]
    clock[0] += 10 * TIMEOUT_S  # the next round forms only when every rank joined it again
    assert not watch.look() and rendezvous.generation(store) == 1


def test_a_round_still_forming_is_never_hung(store, clock) -> None:
    watch = _watch(store, [])
    _join(store, 0, range(WORLD - 1))  # one rank has yet to come (an image pull, a new pod)
    watch.look()
    clock[0] += 10 * TIMEOUT_S
    assert not watch.look() and rendezvous.generation(store) == 0


@pytest.mark.parametrize("over", ["finished", "halted"])
def test_a_gang_that_finished_or_was_halted_is_never_hung(store, clock, over: str) -> None:
    watch = _watch(store, [])
    _join(store, 0, range(WORLD))
    watch.look()
    if over == "finished":
        store.set(rendezvous.FINISHED, "1")  # rank 0 past the final barrier, the last save late
    else:
        rendezvous.halt(store, exitcodes.GANG_RESTART)
    clock[0] += 10 * TIMEOUT_S
    assert not watch.look() and rendezvous.generation(store) == 0


def test_a_timeout_of_zero_never_watches(store, clock) -> None:
    watch = _watch(store, [], timeout_s=0)
    _join(store, 0, range(WORLD))
    watch.look()
    clock[0] += 1e6
    assert not watch.look() and rendezvous.generation(store) == 0


def test_without_in_place_budget_a_stall_halts_the_gang_for_a_rebuild(store, clock) -> None:
    watch = _watch(store, [], limit=0)
    _join(store, 0, range(WORLD))
    watch.look()
    clock[0] += TIMEOUT_S + 1
    assert not watch.look()  # no round to recover in
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART


def test_a_gang_that_keeps_hanging_uses_its_budget_up(store, clock) -> None:
    """Each stall comes a whole timeout after the round's last progress, and the budget starts
    again only for a gang that ran 10 minutes up to its failure: with a limit of 1 the second
    stall halts the gang for a rebuild, even with the default timeout of 600 s."""
    timeout = float(rendezvous.api_run_policy.STEADY_RUNNING_SECONDS)
    watch = stall.StallWatch(store, WORLD, timeout, 1, [].append)
    _join(store, 0, range(WORLD))
    rendezvous.mark_progress(store, 0, "restored")
    watch.look()
    clock[0] += timeout + 1
    assert watch.look() and rendezvous.generation(store) == 1
    _join(store, 1, range(WORLD))
    rendezvous.mark_progress(store, 1, "restored")  # the round forms, then hangs again
    watch.look()
    clock[0] += timeout + 1
    store.set(rendezvous.IN_PLACE_AT, repr(time.time() - timeout - 2))  # the wall clock too
    assert not watch.look()
    assert rendezvous.halted(store) == exitcodes.GANG_RESTART


def test_the_final_saves_are_not_watched(store, clock) -> None:
    watch = _watch(store, [])
    _join(store, 0, range(WORLD))
    rendezvous.mark_progress(store, 0, stall.FINISHING)  # the last step trained
    watch.look()
    clock[0] += 10 * TIMEOUT_S
    assert not watch.look() and rendezvous.generation(store) == 0


def test_a_finishing_mark_left_from_an_earlier_round_does_not_exempt_a_new_one(
    store, clock
) -> None:
    """Rank 0 marked ``finishing`` in round 0, then a rank failed in the final barrier: round 1 has
    no mark of its own yet, and a hang there is still a hang."""
    said: list[str] = []
    watch = _watch(store, said)
    _join(store, 0, range(WORLD))
    rendezvous.mark_progress(store, 0, stall.FINISHING)
    rendezvous.start_round(
        store, 0, rendezvous.Failure("process", "exited 1", (1,), time.time()), 10
    )
    _join(store, 1, range(WORLD))
    watch.look()
    clock[0] += TIMEOUT_S + 1
    assert watch.look() and rendezvous.generation(store) == 2, said
