"""The rendezvous protocol on the job's TCPStore: generations, failure reports, joins, the halt code.

Pod 0's supervisor hosts a ``torch.distributed.TCPStore`` on ``MASTER_PORT``; supervisors and
workers are its clients.  Keys (all under ``rdzv/``; a process group of generation ``g`` keeps its
own under ``g{g}/``):

- ``generation``: the current round.  A round is started by the one caller that claims it
  (``r{n}/claim``, an atomic add) and then sets ``generation: n-1 -> n`` by compare-and-set:
  one bump per failure, whoever detects it first (the failed rank's supervisor, or a worker whose
  collective failed).  A failure that happened before its rank joined the current round needs no
  new round: it is only reported to the current one (the round waits for the replacement).
- ``r{n}/nfail`` and ``r{n}/fail{i}``: the failures that round ``n`` recovers from (JSON).
- ``r{n}/detectedAt``: when the claimant started round ``n``.
- ``g{g}/joined`` (count) and ``rank{r}/gen``: who joined which round.
- ``inplace``: in-place recoveries of this gang attempt (the store lives as long as pod 0's
  supervisor, i.e. one gang attempt); past ``inPlaceLimit`` the claimant halts the gang instead.
- ``halt``: an exit code every supervisor and worker leaves with (first writer wins).
- ``step``: the newest step global rank 0 completed (a recovery's lost steps).
- ``pod{p}/hb``, ``pod{p}/incarnation``, ``done``: supervisors' liveness, restarts and finish.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Any

from torch._C import _distributed_c10d as c10d

from meshtrain.api import exitcodes

GENERATION = "rdzv/generation"
HALT = "rdzv/halt"
IN_PLACE = "rdzv/inplace"
STEP = "rdzv/step"
DONE = "rdzv/done"
MAX_FAILURES = 64
"""Failure reports read per round."""
MAX_VALUE = 4096
"""Bytes of a report read back (the store is shared by every pod: bound what is trusted)."""
POLL_S = 0.05
TIER_ORDER = ("process", "container", "pod", "gang")


@dataclasses.dataclass(frozen=True)
class Failure:
    """A failure as its observer reported it."""

    tier: str
    """What has to be restarted: ``process``, ``container`` or ``pod``."""
    cause: str
    """e.g. ``SIGKILL``, ``exit 1``, ``peer lost``, ``pod lost``."""
    ranks: tuple[int, ...]
    """The global ranks lost (empty: unknown to the observer, e.g. a peer's collective failed)."""
    failed_at: float
    """Unix time of the observation."""

    def dumps(self) -> str:
        return json.dumps(
            {
                "tier": self.tier,
                "cause": self.cause,
                "ranks": list(self.ranks),
                "at": self.failed_at,
            }
        )

    @staticmethod
    def loads(raw: bytes) -> Failure | None:
        try:
            value = json.loads(raw[:MAX_VALUE])
            return Failure(
                tier=str(value["tier"]) if value["tier"] in TIER_ORDER else "process",
                cause=str(value["cause"])[:200],
                ranks=tuple(int(r) for r in value["ranks"][:MAX_FAILURES]),
                failed_at=float(value["at"]),
            )
        except (ValueError, KeyError, TypeError):
            return None


def connect(host: str, port: int, *, master: bool, timeout_s: float) -> c10d.TCPStore:
    """The job's store: hosted here when ``master`` (pod 0's supervisor), else a client of it."""
    return c10d.TCPStore(
        host,
        port,
        is_master=master,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=timeout_s),
    )


def _int(store: c10d.Store, key: str, default: int) -> int:
    if not store.check([key]):
        return default
    try:
        return int(store.get(key)[:32])
    except ValueError:
        return default


def init_generation(store: c10d.Store) -> int:
    """The current generation, 0 when the store is new."""
    return int(store.compare_set(GENERATION, "", "0")[:32])


def generation(store: c10d.Store) -> int:
    return _int(store, GENERATION, 0)


def halted(store: c10d.Store) -> int | None:
    """The exit code the gang was told to leave with, if any."""
    code = _int(store, HALT, -1)
    return None if code < 0 else code


def halt(store: c10d.Store, code: int) -> int:
    """Tell every supervisor and worker to leave with ``code`` (the first code set stays); the code in force."""
    return int(store.compare_set(HALT, "", str(code))[:32])


def joined_generation(store: c10d.Store, rank: int) -> int:
    """The newest round ``rank`` joined (-1: none)."""
    return _int(store, f"rdzv/rank{rank}/gen", -1)


def report(store: c10d.Store, round_: int, failure: Failure) -> None:
    """Add ``failure`` to what round ``round_`` recovers from."""
    index = store.add(f"rdzv/r{round_}/nfail", 1)
    store.set(f"rdzv/r{round_}/fail{index}", failure.dumps())


def failures(store: c10d.Store, round_: int) -> list[Failure]:
    """The failures reported to round ``round_`` (at most :data:`MAX_FAILURES`)."""
    count = min(_int(store, f"rdzv/r{round_}/nfail", 0), MAX_FAILURES)
    found = []
    for index in range(1, count + 1):
        key = f"rdzv/r{round_}/fail{index}"
        if store.check([key]):
            failure = Failure.loads(store.get(key))
            if failure is not None:
                found.append(failure)
    return found


def detected_at(store: c10d.Store, round_: int) -> float | None:
    key = f"rdzv/r{round_}/detectedAt"
    if not store.check([key]):
        return None
    try:
        return float(store.get(key)[:32])
    except ValueError:
        return None


def start_round(store: c10d.Store, current: int, failure: Failure, limit: int) -> bool:
    """Report ``failure`` and start round ``current + 1`` unless another caller did; whether this one did.

    Past ``limit`` in-place recoveries the gang is halted with :data:`exitcodes.GANG_RESTART`
    instead.
    """
    nxt = current + 1
    report(store, nxt, failure)
    if store.add(f"rdzv/r{nxt}/claim", 1) != 1:
        return False
    if store.add(IN_PLACE, 1) > limit:
        halt(store, exitcodes.GANG_RESTART)
        return False
    store.set(f"rdzv/r{nxt}/detectedAt", repr(time.time()))
    store.compare_set(GENERATION, str(current), str(nxt))
    return True


def ranks_failed(store: c10d.Store, ranks: tuple[int, ...], failure: Failure, limit: int) -> int:
    """``ranks`` are gone: start a new round if one of them was in the current round, else report
    the failure to the current round (which waits for their replacements); the round that recovers."""
    current = generation(store)
    if any(joined_generation(store, r) >= current for r in ranks):
        start_round(store, current, failure, limit)
        return current + 1
    report(store, current, failure)
    return current


def join(store: c10d.Store, round_: int, rank: int, world: int, timeout_s: float) -> str:
    """Join round ``round_`` and wait for all ``world`` ranks: ``ready``, ``moved`` (a newer round
    started meanwhile), ``halt``, or ``timeout`` (after ``timeout_s``)."""
    store.set(f"rdzv/rank{rank}/gen", str(round_))
    key = f"rdzv/g{round_}/joined"
    store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while True:
        if halted(store) is not None:
            return "halt"
        if generation(store) != round_:
            return "moved"
        if store.add(key, 0) >= world:
            return "ready"
        if time.monotonic() > deadline:
            return "timeout"
        time.sleep(POLL_S)


def summary(store: c10d.Store, round_: int) -> dict[str, Any]:
    """What round ``round_`` recovered from, merged: tier (the widest), cause, ranks, failedAt, detectedAt."""
    found = failures(store, round_)
    now = time.time()
    failed_at = min((f.failed_at for f in found), default=now)
    tiers = [f.tier for f in found] or ["process"]
    causes = list(dict.fromkeys(f.cause for f in found if f.ranks)) or [f.cause for f in found[:1]]
    return {
        "tier": max(tiers, key=TIER_ORDER.index),
        "cause": ", ".join(causes) or "unknown",
        "ranks": tuple(sorted({r for f in found for r in f.ranks})),
        "failed_at": failed_at,
        "detected_at": detected_at(store, round_) or failed_at,
    }
