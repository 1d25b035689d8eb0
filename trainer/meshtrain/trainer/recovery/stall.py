"""A hung gang, seen from the store's host: rank 0 stopped making progress while every rank is in
the round.

A collective that never returns (a GPU or link that stopped, a rank that left a collective its
peers entered) blocks every rank.  Nothing else ends it: NCCL's watchdog is told to leave the
communicators to the watcher's abort (``TORCH_NCCL_ASYNC_ERROR_HANDLING=0``, :mod:`.abort`), the
pods' heartbeats come from their supervisors and keep beating, and gloo waits out the
process-group timeout.  So global rank 0 marks its progress in the store
(:data:`.rendezvous.PROGRESS`: its restore, each step), and the host that watches the pods'
heartbeats (pod 0's supervisor or the store pod) also watches that mark, on its own clock, from the
moment every rank joined the round.  When it has not moved for
``runPolicy.recovery.stallTimeoutSeconds`` the host starts the next round with cause
:data:`STALLED`: every worker's watcher aborts its groups, the blocked collectives raise, and the
gang meets again in the same processes; past the in-place budget the round's claimant halts the
gang for a rebuild instead (:func:`.rendezvous.start_round`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from torch._C import _distributed_c10d as c10d

from meshtrain.trainer.recovery import rendezvous

STALLED = "stalled"
"""The cause of a round started because the gang made no progress."""
FINISHING = "finishing"
"""Rank 0's mark once it trained its last step: the final saves and barrier are not watched."""
MAX_MARK = 64
"""Bytes of rank 0's progress mark read (the store is shared by every pod: bound what is trusted)."""


class StallWatch:
    """The host's clock on rank 0's progress mark in the current round."""

    def __init__(
        self,
        store: c10d.Store,
        world: int,
        timeout_s: float,
        in_place_limit: int,
        say: Callable[[str], None],
    ) -> None:
        """``timeout_s`` 0: never; ``in_place_limit`` 0: a stall halts the gang for a rebuild."""
        self.store = store
        self.world = world
        self.timeout_s = timeout_s
        self.in_place_limit = in_place_limit
        self.say = say
        self.seen: tuple[int, bytes] | None = None
        """The round and mark last read, and (``since``) when this host first read them."""
        self.since = 0.0
        self.fired: tuple[int, bytes] | None = None

    def look(self, now: float | None = None) -> bool:
        """Read the round and rank 0's mark once; whether a new round was started for a stall."""
        if self.timeout_s <= 0:
            return False
        now = time.monotonic() if now is None else now
        store = self.store
        if store.check([rendezvous.FINISHED]) or rendezvous.halted(store) is not None:
            self.seen = None
            return False
        generation = rendezvous.generation(store)
        if not rendezvous.formed(store, generation, self.world):
            self.seen = None  # ranks still joining: the round's rejoin timeout covers them
            return False
        mark = (
            store.get(rendezvous.PROGRESS)[:MAX_MARK] if store.check([rendezvous.PROGRESS]) else b""
        )
        current = (generation, mark)
        if mark == f"{generation}:{FINISHING}".encode():
            self.seen = None  # this round's final saves and barrier: as long as they take
            return False
        if current != self.seen:
            self.seen, self.since = current, now
            return False
        silent = now - self.since
        if silent < self.timeout_s or self.fired == current:
            return False
        self.say(
            f"round {generation}: no progress from rank 0 for {silent:.0f}s with every rank in "
            "the round; taking the gang for hung"
        )
        failure = rendezvous.Failure("process", STALLED, (), time.time() - silent)
        started = rendezvous.start_round(store, generation, failure, self.in_place_limit)
        self.fired = current  # once it went through: a store error above is tried again
        return started
