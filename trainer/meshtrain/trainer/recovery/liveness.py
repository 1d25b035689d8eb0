"""Pods' liveness on the job's store: each supervisor bumps ``rdzv/pod{p}/hb``; the store's host
declares a pod whose heartbeat stopped changing lost, so that a round waits for its replacement.

The host is pod 0's supervisor (``runPolicy.recovery.rendezvousStore: pod0``; it watches the
other pods) or the store pod (``dedicated``; it watches every pod, pod 0 included).  Liveness is
by observed change, never by clocks compared across machines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from torch._C import _distributed_c10d as c10d

from meshtrain.trainer.recovery import rendezvous

HEARTBEAT_S = 1.0
"""How often a supervisor bumps its heartbeat key."""
HEARTBEAT_TIMEOUT_S = 30.0
"""A pod is declared lost when its heartbeat has not changed for this long (a fixed constant,
docs/recovery.md: long enough for a paused or busy node, short against the rejoin timeout)."""
MAX_HEARTBEAT = 32
"""Bytes of a heartbeat value read (the store is shared by every pod: bound what is trusted)."""


def heartbeat_key(pod: int) -> str:
    return f"rdzv/pod{pod}/hb"


class PodWatch:
    """The host's view of the watched pods' heartbeats: which moved lately, which stopped."""

    def __init__(
        self,
        store: c10d.Store,
        pods: Iterable[int],
        local: int,
        in_place_limit: int,
        say: Callable[[str], None],
    ) -> None:
        self.store = store
        self.pods = tuple(pods)
        self.local = local
        self.in_place_limit = in_place_limit
        self.say = say
        self.seen: dict[int, tuple[bytes, float]] = {}
        self.lost: set[int] = set()

    def alive(self, within_s: float) -> bool:
        """Whether a watched pod's heartbeat changed within ``within_s``."""
        now = time.monotonic()
        return any(now - at < within_s for _, at in self.seen.values())

    def look(self) -> None:
        """Read every watched pod's heartbeat once; report the pods whose heartbeat stopped."""
        now = time.monotonic()
        for pod in self.pods:
            key = heartbeat_key(pod)
            if not self.store.check([key]) or self.store.check([rendezvous.left_key(pod)]):
                self.seen.pop(pod, None)
                continue  # not started yet (the round's rejoin timeout covers it), or done
            value = self.store.get(key)[:MAX_HEARTBEAT]
            if pod not in self.seen or self.seen[pod][0] != value:
                self.seen[pod] = (value, now)
                self.lost.discard(pod)
            elif now - self.seen[pod][1] > HEARTBEAT_TIMEOUT_S and pod not in self.lost:
                self.lost.add(pod)
                self._lost(pod, now - self.seen[pod][1])

    def _lost(self, pod: int, silent_s: float) -> None:
        ranks = tuple(range(pod * self.local, (pod + 1) * self.local))
        self.say(f"pod {pod} lost (no heartbeat for {silent_s:.0f}s): a round waits for it")
        failure = rendezvous.Failure("pod", "pod lost", ranks, time.time() - silent_s)
        rendezvous.ranks_failed(self.store, ranks, failure, self.in_place_limit)
