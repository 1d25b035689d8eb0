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
  ``inplaceAt`` (unix time of the last): after ``STEADY_RUNNING_SECONDS`` with none the count
  starts again, as the operator's does.
- ``halt``: an exit code every supervisor and worker leaves with (first writer wins).
- ``step``: the newest step global rank 0 completed (a recovery's lost steps).
- ``count/{tier}``: in-place recoveries of each tier this store has seen (each round once, by
  ``r{n}/counted``): the progress report carries them so that the operator misses none, whatever
  rank 0's process or the report's few newest records saw.
- ``pod{p}/hb``, ``pod{p}/incarnation``, ``done``: supervisors' liveness, restarts and finish.
- ``pod{p}/uid`` and ``fenced/{uid}``: the pod (its UID) that holds node rank ``p``, and the pods
  that held it before (fencing: a replacement registers its UID and fences the one it replaces,
  whose supervisor then exits with ``exitcodes.FENCED``, even when it comes back later).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
from typing import Any

from torch._C import _distributed_c10d as c10d

from meshtrain.api import exitcodes
from meshtrain.api.spec import run_policy as api_run_policy

GENERATION = "rdzv/generation"
HALT = "rdzv/halt"
IN_PLACE = "rdzv/inplace"
IN_PLACE_AT = "rdzv/inplaceAt"
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


MAX_UID = 64
"""Bytes of a pod UID kept (a Kubernetes UID has 36)."""
MAX_CLAIMS = 8
"""Tries to take a slot that other pods keep taking (each try fences the one before)."""


def claim_slot(store: c10d.Store, pod: int, uid: str) -> bool:
    """Register the pod ``uid`` as the holder of node rank ``pod``, fencing the one before it;
    False when ``uid`` itself was fenced (a replacement holds the slot: exit).  An empty ``uid``
    (no downward API: a loopback run) claims nothing and is never fenced."""
    uid = uid[:MAX_UID]
    if not uid:
        return True
    if store.check([f"rdzv/fenced/{uid}"]):
        return False
    key, expected = f"rdzv/pod{pod}/uid", ""
    for _ in range(MAX_CLAIMS):
        held = store.compare_set(key, expected, uid).decode(errors="replace")[:MAX_UID]
        if held == uid:
            return True
        store.set(f"rdzv/fenced/{held}", "1")  # the pod this one replaces
        if store.check([f"rdzv/fenced/{uid}"]):  # a newer one fenced this pod meanwhile
            return False
        expected = held
    return False


def holds_slot(store: c10d.Store, pod: int, uid: str) -> bool:
    """Whether the pod ``uid`` still holds node rank ``pod`` (not fenced by a replacement)."""
    uid = uid[:MAX_UID]
    return not uid or not store.check([f"rdzv/fenced/{uid}"])


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


def _float(store: c10d.Store, key: str) -> float | None:
    if not store.check([key]):
        return None
    try:
        return float(store.get(key)[:32])
    except ValueError:
        return None


def detected_at(store: c10d.Store, round_: int) -> float | None:
    return _float(store, f"rdzv/r{round_}/detectedAt")


def start_round(store: c10d.Store, current: int, failure: Failure, limit: int) -> bool:
    """Report ``failure`` and start round ``current + 1`` unless another caller did; whether this one did.

    Past ``limit`` in-place recoveries the gang is halted with :data:`exitcodes.GANG_RESTART`
    instead.
    """
    nxt = current + 1
    report(store, nxt, failure)
    if store.add(f"rdzv/r{nxt}/claim", 1) != 1:
        return False
    now = time.time()
    last = _float(store, IN_PLACE_AT)
    if last is not None and now - last >= api_run_policy.STEADY_RUNNING_SECONDS:
        store.set(IN_PLACE, "0")  # a quiet gang: its budget starts again
    store.set(IN_PLACE_AT, repr(now))
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


def counted(store: c10d.Store, round_: int, tier: str) -> dict[str, int]:
    """Count round ``round_`` (of ``tier``) once, whoever asks; every tier's count so far."""
    if store.add(f"rdzv/r{round_}/counted", 1) == 1:
        store.add(f"rdzv/count/{tier}", 1)
    return {t: store.add(f"rdzv/count/{t}", 0) for t in TIER_ORDER[:3]}


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
