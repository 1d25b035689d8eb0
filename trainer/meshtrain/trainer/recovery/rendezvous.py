"""The rendezvous protocol on the job's TCPStore: generations, failure reports, joins, the halt code.

Pod 0's supervisor hosts a ``torch.distributed.TCPStore`` on ``MASTER_PORT``, or the store pod
does (``rendezvousStore: dedicated``, :mod:`.store_host`); supervisors and workers are its clients.  Keys (all under ``rdzv/``; a process group of generation ``g`` keeps its
own under ``g{g}/``):

- ``generation``: the current round, ``"{n}"`` or ``"{n}:{token}"``.  A round is started by one
  atomic compare-and-set ``generation: "{n-1}..." -> "{n}:{token}"``: the bump is the claim, the
  caller whose token comes back started it (one bump per failure, whoever detects it first: the
  failed rank's supervisor, or a worker whose collective failed).  A claimant that dies after its
  bump leaves a moved generation, never a wedged one.  A failure that happened before its rank
  joined the current round needs no new round: it is only reported to the current one (the round
  waits for the replacement).
- ``r{n}/nfail`` and ``r{n}/fail{i}``: the failures that round ``n`` recovers from (JSON).
- ``r{n}/detectedAt``: when the claimant started round ``n``.
- ``g{n}/rank{r}`` (the joining process's identity, set once by compare-and-set) and
  ``g{n}/joined`` (distinct ranks counted): who joined round ``n``; ``rank{r}/gen``: the newest
  round rank ``r`` joined.
- ``pod{p}/incarnation``: the newest incarnation number of pod ``p``'s supervisor (one per
  container start; ``pod{p}/holder``: its number and identity).  A process of an older
  incarnation (a pod declared lost whose containers still run) is fenced: it never joins a round
  and leaves with :data:`SUPERSEDED`.  With ``MESHTRAIN_POD_UID``, ``pod{p}/uid`` names the pod
  holding node rank ``p`` and ``fenced/{uid}`` the pods it replaced: a replaced pod that comes
  back takes no new incarnation.
- ``inplace``: in-place recoveries of this gang attempt (the store lives as long as its host,
  i.e. one gang attempt); past ``inPlaceLimit`` the claimant halts the gang instead.
  ``inplaceAt`` (unix time of the last): after ``STEADY_RUNNING_SECONDS`` with none the count
  starts again, as the operator's does.
- ``halt``: an exit code every supervisor and worker leaves with (first writer wins).
- ``step``: the newest step global rank 0 completed (a recovery's lost steps).
- ``progress``: global rank 0's progress mark (``{round}:{what}``, set at its restore and each
  step): the store's host takes a round whose mark stops moving for hung (:mod:`.stall`).
- ``count/{tier}``: in-place recoveries of each tier this store has seen (each round once, by
  ``r{n}/counted``): the progress report carries them so that the operator misses none, whatever
  rank 0's process or the report's few newest records saw.
- ``finished``: rank 0 passed the final barrier (losing the store after it is not a failure).
- ``changes``: a counter bumped after each write the pollers must see (a new round, the halt, a
  new incarnation, ``finished``): every rank's watcher and every supervisor reads this one key
  each poll, and the keys it stands for only when it moved (:class:`ChangeGate`).
- ``pod{p}/hb``, ``done``: supervisors' liveness and finish.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from torch._C import _distributed_c10d as c10d

from meshtrain.api import exitcodes
from meshtrain.api.spec import kube_names
from meshtrain.api.spec import run_policy as api_run_policy

GENERATION = "rdzv/generation"
HALT = "rdzv/halt"
"""The exit code every process of the gang leaves with, once set (the first set stays); a bare
number, which every release of the trainer reads (a replacement pod may run a newer image than
its gang)."""
DEVICE_RANKS = "rdzv/deviceRanks"
"""The ranks whose GPU failed with a device error in this gang (comma-separated, merged by every
writer, :func:`name_device_ranks`), written before any halt they cause: every pod's failure report
of a rebuild names them, so the operator learns their nodes' errors from whichever exit it reads
first."""
MAX_DEVICE_RANKS_BYTES = 512
"""Most bytes of :data:`DEVICE_RANKS` written or read (about 80 ranks)."""
MERGE_TRIES = 8
"""Compare-and-set attempts of one merge into :data:`DEVICE_RANKS` before it gives up (each lost
try means another writer merged meanwhile)."""
IN_PLACE = "rdzv/inplace"
IN_PLACE_AT = "rdzv/inplaceAt"
STEP = "rdzv/step"
PROGRESS = "rdzv/progress"
CHANGES = "rdzv/changes"
FULL_READ_S = 2.0
"""Longest time a :class:`ChangeGate` trusts an unmoved counter: a writer that died between its
write and its bump is noticed this late, never missed."""
DONE = "rdzv/done"
FINISHED = "rdzv/finished"
SUPERSEDED = exitcodes.FENCED
"""Exit code of a process fenced off: a newer incarnation of its pod runs (docs/recovery.md)."""
INCARNATION_ENV = "MESHTRAIN_INCARNATION"
"""Set by the supervisor for its workers: its incarnation (``{number}:{identity}``)."""
POD_UID_ENV = "MESHTRAIN_POD_UID"
"""The pod's UID (downward API): an incarnation's identity when set."""
MAX_FAILURES = 64
"""Failure reports read per round."""
MAX_VALUE = 4096
"""Bytes of a report read back (the store is shared by every pod: bound what is trusted)."""
MAX_UID = 64
"""Bytes of a pod UID kept (a Kubernetes UID has 36)."""
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
    node: str = ""
    """The node ``ranks`` ran on, when the observer runs there too (their pod's supervisor, from
    ``$MESHTRAIN_NODE_NAME``); empty when unknown (a peer's report, or outside Kubernetes).  It
    stays true after the pod is replaced, where the pod's current node no longer is."""

    def dumps(self) -> str:
        value: dict[str, Any] = {
            "tier": self.tier,
            "cause": self.cause,
            "ranks": list(self.ranks),
            "at": self.failed_at,
        }
        if self.node:
            value["node"] = self.node
        return json.dumps(value)

    @staticmethod
    def loads(raw: bytes) -> Failure | None:
        try:
            value = json.loads(raw[:MAX_VALUE])
            node = value.get("node")  # absent from older trainers' reports
            return Failure(
                tier=str(value["tier"]) if value["tier"] in TIER_ORDER else "process",
                cause=str(value["cause"])[:200],
                ranks=tuple(int(r) for r in value["ranks"][:MAX_FAILURES]),
                failed_at=float(value["at"]),
                node=node if kube_names.is_node_name(node) else "",
            )
        except (ValueError, KeyError, TypeError, AttributeError):
            return None


def left_key(pod: int) -> str:
    """Set by pod ``pod``'s supervisor when it finished or saw the gang halted (never when it was
    stopped alone or fenced off: its slot waits for a replacement)."""
    return f"rdzv/pod{pod}/left"


def connect(host: str, port: int, *, master: bool, timeout_s: float) -> c10d.TCPStore:
    """The job's store: hosted here when ``master`` (its host: pod 0's supervisor or the store
    pod), else a client of it."""
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


def number(raw: bytes) -> int:
    """The round of a generation value (``{n}`` or ``{n}:{token}``); -1 when garbled."""
    try:
        return int(raw[:64].split(b":", 1)[0])
    except ValueError:
        return -1


def init_generation(store: c10d.Store) -> int:
    """The current generation, 0 when the store is new."""
    return number(store.compare_set(GENERATION, "", "0"))


def generation(store: c10d.Store) -> int:
    return number(store.get(GENERATION)) if store.check([GENERATION]) else 0


@dataclasses.dataclass(frozen=True)
class Incarnation:
    """One start of a pod's supervisor (and the workers it starts): the fence of its ranks."""

    pod: int
    """The pod (node rank)."""
    number: int
    """Its place among the pod's starts (1, 2, ...): the newest runs, older ones are fenced."""
    identity: str
    """Who took it: the pod's UID when known (``MESHTRAIN_POD_UID``), else a random token."""

    def dumps(self) -> str:
        return f"{self.number}:{self.identity}"

    @staticmethod
    def loads(pod: int, raw: str) -> Incarnation:
        value, _, identity = raw.partition(":")
        return Incarnation(pod, int(value), identity[:200])


def take_incarnation(
    store: c10d.Store, pod: int, identity: str, *, uid: str = ""
) -> Incarnation | None:
    """A new incarnation of ``pod``: every older one is fenced from now on.  With the pod's
    ``uid`` (``MESHTRAIN_POD_UID``) a new pod holding node rank ``pod`` also fences the UID it
    replaces for good (``pod{p}/uid``, ``fenced/{uid}``): None when ``uid`` itself was fenced (the
    replaced pod came back: it must leave, not supersede its replacement)."""
    if not claim_slot(store, pod, uid):
        return None
    store.delete_key(left_key(pod))  # a replacement is not done: the store's host watches it again
    taken = Incarnation(pod, store.add(f"rdzv/pod{pod}/incarnation", 1), identity)
    store.set(f"rdzv/pod{pod}/holder", taken.dumps())
    _changed(store)  # the older incarnation's pollers must see it
    return taken


def superseded(store: c10d.Store, incarnation: Incarnation) -> bool:
    """Whether a newer incarnation of the pod took over (this one must leave, not join)."""
    return _int(store, f"rdzv/pod{incarnation.pod}/incarnation", 0) > incarnation.number


def halted(store: c10d.Store) -> int | None:
    """The exit code the gang was told to leave with, if any."""
    code = _int(store, HALT, -1)
    return None if code < 0 else code


def halt(store: c10d.Store, code: int, device_error_ranks: Sequence[int] = ()) -> int:
    """Tell every supervisor and worker to leave with ``code`` (the first code set stays), the
    ranks whose device error caused it named first; the code in force."""
    name_device_ranks(store, device_error_ranks)
    in_force = int(store.compare_set(HALT, "", str(code))[:32])
    _changed(store)
    return in_force


def _ranks(raw: bytes) -> set[int]:
    text = raw[:MAX_DEVICE_RANKS_BYTES].decode("ascii", "replace")
    return {int(r) for r in text.split(",") if r.strip().isdigit()}


def name_device_ranks(store: c10d.Store, ranks: Sequence[int]) -> None:
    """Merge ``ranks`` into :data:`DEVICE_RANKS` (one compare-and-set per try, so two pods whose
    GPUs failed together both stay named), before or after the halt they caused."""
    for _ in range(MERGE_TRIES if ranks else 0):
        before = store.get(DEVICE_RANKS) if store.check([DEVICE_RANKS]) else b""
        known = _ranks(before)
        merged = known | set(ranks)
        if merged == known:
            return
        text = ",".join(str(r) for r in sorted(merged))[:MAX_DEVICE_RANKS_BYTES]
        text = text.rsplit(",", 1)[0] if len(text) == MAX_DEVICE_RANKS_BYTES else text
        if (
            store.compare_set(DEVICE_RANKS, before.decode("ascii", "replace"), text)
            == text.encode()
        ):
            _changed(store)
            return


def named_device_ranks(store: c10d.Store) -> tuple[int, ...]:
    """The ranks named by :func:`name_device_ranks` in this gang (none when none failed so)."""
    if not store.check([DEVICE_RANKS]):
        return ()
    return tuple(sorted(_ranks(store.get(DEVICE_RANKS))))


def device_error_ranks(store: c10d.Store, round_: int) -> tuple[int, ...]:
    """The ranks reported failed in round ``round_`` with a device error (exit 78)."""
    found = failures(store, round_)
    return tuple(
        sorted({r for f in found if f.cause == exitcodes.DEVICE_ERROR_CAUSE for r in f.ranks})
    )


def finish(store: c10d.Store) -> None:
    """Rank 0 passed the final barrier: the supervisors may lose the store from now on."""
    store.set(FINISHED, "1")
    _changed(store)


def changes(store: c10d.Store) -> int:
    """The change counter (:data:`CHANGES`): one request."""
    return int(store.add(CHANGES, 0))


def _changed(store: c10d.Store) -> None:
    """After a write the pollers must see: bump the counter they read."""
    store.add(CHANGES, 1)


class ChangeGate:
    """Whether a poller's keys may have moved since it last read them, from one read of
    :data:`CHANGES`: before it, a watcher read every key each poll (25 requests a second per
    rank, on the one store every rank of the gang shares).

    The counter is read before the keys and bumped after them, so a change is never missed: a
    poll that reads the counter before a bump reads the keys again at the next one."""

    def __init__(self, store: c10d.Store, full_read_s: float = FULL_READ_S) -> None:
        self.store = store
        self.full_read_s = full_read_s
        self.seen: int | None = None
        self.read_at = 0.0

    def moved(self, now: float | None = None) -> bool:
        """Whether to read the keys now (the counter moved, or :data:`FULL_READ_S` passed)."""
        now = time.monotonic() if now is None else now
        count = changes(self.store)
        if count == self.seen and now - self.read_at < self.full_read_s:
            return False
        self.seen, self.read_at = count, now
        return True

    def forget(self) -> None:
        """The keys' read failed: read them again at the next poll."""
        self.seen = None


def formed(store: c10d.Store, round_: int, world: int) -> bool:
    """Whether all ``world`` ranks joined round ``round_`` (it runs, or is building its groups)."""
    return _int(store, f"rdzv/g{round_}/joined", 0) >= world


def mark_progress(store: c10d.Store, round_: int, what: str) -> None:
    """Global rank 0 made progress in round ``round_`` (``what``: ``restored``, a step)."""
    store.set(PROGRESS, f"{round_}:{what}")


def joined_generation(store: c10d.Store, rank: int) -> int:
    """The newest round ``rank`` joined (-1: none)."""
    return _int(store, f"rdzv/rank{rank}/gen", -1)


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


def joined(store: c10d.Store, round_: int, rank: int) -> bool:
    """Whether a process took ``rank``'s place in ``round_`` (counted or about to be)."""
    return joined_generation(store, rank) >= round_ or store.check([f"rdzv/g{round_}/rank{rank}"])


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


def start_round(
    store: c10d.Store, current: int, failure: Failure, limit: int, token: str = ""
) -> bool:
    """Report ``failure`` and start round ``current + 1`` unless another caller did; whether this
    one did (the bump is the claim: one atomic compare-and-set, see the module).

    Past ``limit`` in-place recoveries the winner halts the gang with
    :data:`exitcodes.GANG_RESTART` (and says False: no round to recover in).
    """
    nxt = current + 1
    report(store, nxt, failure)
    raw = store.get(GENERATION) if store.check([GENERATION]) else b""
    if number(raw) != current:
        return False  # the round moved on already
    claim = f"{nxt}:{token or uuid.uuid4().hex}"
    if store.compare_set(GENERATION, raw.decode("ascii", "replace"), claim) != claim.encode():
        return False
    _changed(store)  # every watcher aborts its groups
    now = time.time()
    # A gang that ran steadily up to the failure starts its budget again.  Measured to the
    # failure, not to now: a stall's failure is rank 0's last progress, so a gang that keeps
    # hanging (silent for the whole stall timeout each time) uses its budget up.
    if _quiet(store, min(failure.failed_at, now)):
        store.set(IN_PLACE, "0")
    store.set(IN_PLACE_AT, repr(now))
    store.set(f"rdzv/r{nxt}/detectedAt", repr(time.time()))
    if store.add(IN_PLACE, 1) > limit:
        halt(store, exitcodes.GANG_RESTART, device_error_ranks(store, nxt))
        return False
    return True


def _quiet(store: c10d.Store, now: float) -> bool:
    """Whether the gang ran without an in-place recovery long enough for its budget to restart."""
    last = _float(store, IN_PLACE_AT)
    return last is not None and now - last >= api_run_policy.STEADY_RUNNING_SECONDS


def recoveries_left(store: c10d.Store, limit: int) -> int:
    """In-place recoveries the gang may still start before :func:`start_round` halts it."""
    used = 0 if _quiet(store, time.time()) else _int(store, IN_PLACE, 0)
    return max(limit - used, 0)


def leave(
    store: c10d.Store, round_: int, rank: int, member: str, failure: Failure, limit: int
) -> None:
    """``member`` leaves round ``round_`` (a stop during its join): when it was counted there,
    the gang moves to the next round, so the round never starts with ``rank`` missing (its
    peers would wait for the process-group timeout)."""
    if _joined(store, round_, rank) == member and generation(store) == round_:
        start_round(store, round_, failure, limit, token=member)


def ranks_failed(store: c10d.Store, ranks: tuple[int, ...], failure: Failure, limit: int) -> int:
    """``ranks`` are gone: start a new round if one of them was in the current round, else report
    the failure to the current round (which waits for their replacements); the round that recovers."""
    current = generation(store)
    if any(joined(store, current, r) for r in ranks):
        start_round(store, current, failure, limit)
        return current + 1
    report(store, current, failure)
    return current


def join(
    store: c10d.Store,
    round_: int,
    rank: int,
    world: int,
    timeout_s: float,
    *,
    member: str,
    incarnation: Incarnation,
    stopped: Callable[[], bool] = lambda: False,
) -> str:
    """Join round ``round_`` as process ``member`` of ``incarnation`` and wait for all ``world``
    ranks: ``ready``, ``moved`` (a newer round started meanwhile), ``halt``, ``stopped`` (a stop
    was requested), ``superseded`` (fenced: leave with :data:`SUPERSEDED`) or ``timeout``.

    ``g{n}/rank{r}`` is set once by compare-and-set, so a rank is counted once.  A process finding
    it held by itself (it joined this round already) or by another process of an older or the
    same incarnation never joins again: it waits for the round to move on; one held by a newer
    incarnation is fenced off.
    """
    deadline = time.monotonic() + timeout_s
    if superseded(store, incarnation):
        return "superseded"
    mine = f"{incarnation.number}:{member}"
    held = store.compare_set(f"rdzv/g{round_}/rank{rank}", "", mine)
    if held != mine.encode() or _joined(store, round_, rank) == member:
        if number(held) > incarnation.number:
            return "superseded"
        return _wait(store, round_, world, deadline, incarnation, stopped, count=False)
    store.add(f"rdzv/g{round_}/joined", 1)
    store.set(f"rdzv/rank{rank}/gen", str(round_))
    store.set(f"rdzv/g{round_}/counted{rank}", mine)
    return _wait(store, round_, world, deadline, incarnation, stopped, count=True)


def _joined(store: c10d.Store, round_: int, rank: int) -> str:
    """The member counted for ``rank`` in ``round_`` (empty: none yet)."""
    key = f"rdzv/g{round_}/counted{rank}"
    if not store.check([key]):
        return ""
    return store.get(key)[:MAX_VALUE].decode("ascii", "replace").partition(":")[2]


def _wait(
    store: c10d.Store,
    round_: int,
    world: int,
    deadline: float,
    incarnation: Incarnation,
    stopped: Callable[[], bool],
    *,
    count: bool,
) -> str:
    """Wait for every rank of ``round_`` (``count``) or only for the round to move on."""
    while True:
        if halted(store) is not None:
            return "halt"
        if stopped():
            return "stopped"
        if superseded(store, incarnation):
            return "superseded"
        if generation(store) != round_:
            return "moved"
        if count and store.add(f"rdzv/g{round_}/joined", 0) >= world:
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
    """What round ``round_`` recovered from, merged: tier (the widest), cause, ranks, their nodes
    where known, failedAt, detectedAt."""
    found = failures(store, round_)
    now = time.time()
    failed_at = min((f.failed_at for f in found), default=now)
    tiers = [f.tier for f in found] or ["process"]
    causes = list(dict.fromkeys(f.cause for f in found if f.ranks)) or [f.cause for f in found[:1]]
    return {
        "tier": max(tiers, key=TIER_ORDER.index),
        "cause": ", ".join(causes) or "unknown",
        "ranks": tuple(sorted({r for f in found for r in f.ranks})),
        "nodes": failed_nodes(found),
        "failed_at": failed_at,
        "detected_at": detected_at(store, round_) or failed_at,
    }


def failed_nodes(found: Sequence[Failure]) -> dict[str, tuple[int, ...]]:
    """The nodes of the failed ranks whose observers said where they ran, each with its ranks,
    the lowest ranks' first (as many as reports were read: a record keeps the few it has room for)."""
    by_node: dict[str, set[int]] = {}
    for failure in found:
        if failure.node and failure.ranks:
            by_node.setdefault(failure.node, set()).update(failure.ranks)
    kept = sorted(by_node.items(), key=lambda item: min(item[1]))
    return {node: tuple(sorted(ranks)) for node, ranks in kept}
