"""What the churn benchmark sees of the fleet: one pod watch (never a poll, which would load the API
server under test) turned into per-job start times, GPUs allocated over time, and capacity changes;
one watch of the operator's ``NodesReserved`` Events turned into each holder's stated bound.

:class:`Observer` follows the trace's namespace, :class:`Holders` the reservation's holders;
:func:`percentiles` and :func:`allocated_minutes` summarise what they recorded.
"""

from __future__ import annotations

import dataclasses
import datetime
import statistics
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import kubernetes

from benchmarks.fleet import kwok
from meshtrain.operator.policy import conditions, reservation

JOB_LABEL = "meshtrain.io/job"
FINISHED = ("Succeeded", "Failed")
CHANGE_SECONDS = 1.0
"""GPUs freed within this many seconds are one capacity change (a gang's pods end together)."""


@dataclasses.dataclass
class JobRecord:
    """What the watch saw of one job."""

    gpus: int
    """GPUs it asks."""
    applied: float
    """Monotonic time the benchmark created it."""
    all_running: float | None = None
    """Monotonic time all its pods first ran at once (None: not yet)."""
    finished: float | None = None
    """Monotonic time its pods first ended (any attempt)."""
    room_at_apply: bool = False
    """Whether, when it was applied, the fleet's free GPUs less those asked by the jobs waiting
    ahead of it covered it: capacity existed, it had to wait for no one."""
    running: set[str] = dataclasses.field(default_factory=set)
    """Names of its pods running now."""


@dataclasses.dataclass(frozen=True)
class CapacityChange:
    """GPUs freed within :data:`CHANGE_SECONDS`, and who waited then."""

    at: float
    """Monotonic time of the first freeing."""
    free_gpus: int
    """Free GPUs of the fleet once the change settled."""
    waiting: tuple[int, ...]
    """GPUs asked by each job waiting then (applied, not all running, not finished)."""

    def could_admit(self) -> int:
        """Waiting jobs the freed capacity could start (their GPUs fit in the free ones)."""
        return sum(1 for gpus in self.waiting if gpus <= self.free_gpus)


class WatchThread:
    """A daemon thread running ``_run`` until :meth:`stop`; subclasses watch objects in it."""

    def __init__(self, api: kubernetes.client.ApiClient) -> None:
        self._core = kubernetes.client.CoreV1Api(api)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.watch_restarts = 0
        """Watches started again after a dropped connection or an expired version."""

    def _run(self) -> None:
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _watch(self, lister: Any, *args: Any, **kwargs: Any) -> None:
        """Feed every event of ``lister``'s watch to :meth:`_event` until stopped, watching again
        after a dropped connection (from the start after a 410: handlers are idempotent)."""
        version = None
        while not self._stop.is_set():
            stream = kubernetes.watch.Watch()
            try:
                for event in stream.stream(
                    lister,
                    *args,
                    resource_version=version,
                    timeout_seconds=60,
                    allow_watch_bookmarks=True,
                    **kwargs,
                ):
                    if event["type"] == "BOOKMARK":  # not made a model object: read it raw
                        raw = event.get("raw_object") or {}
                        version = (raw.get("metadata") or {}).get("resourceVersion") or version
                    else:
                        version = event["object"].metadata.resource_version
                        self._event(event["type"], event["object"])
                    if self._stop.is_set():
                        stream.stop()
            except kubernetes.client.ApiException as err:
                if err.status == 410:
                    version = None
                self.watch_restarts += 1
            except Exception:  # noqa: BLE001 - a dropped connection: watch again
                self.watch_restarts += 1
                time.sleep(0.5)

    def _event(self, type_: str, found: Any) -> None:
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class Stated:
    """One ``NodesReserved`` Event: the holder it was written for, and the time it said."""

    at: float
    """Epoch seconds it was first written (``firstTimestamp``: whole seconds)."""
    job: str
    """The holder's name."""
    clear: float | None
    """Epoch seconds its nodes clear by, as it said (None: no time said)."""


def stated_bound(message: str) -> float | None:
    """The epoch seconds a holder's Event says its reserved nodes clear by (None: none said)."""
    marker = f"{reservation.CLEAR_BY} "
    if marker not in message:
        return None
    stamp = message.split(marker, 1)[1].split(" ", 1)[0]
    found = conditions.parse_time(stamp)
    return None if found is None else found.timestamp()


class Holders(WatchThread):
    """A watch of the operator's ``NodesReserved`` Events of one namespace: each holder's Events in
    the order written (``reservation.described``), once each however often a relist shows them."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str) -> None:
        super().__init__(api)
        self._namespace = namespace
        self._seen: set[str] = set()
        self._stated: list[Stated] = []
        self._lock = threading.Lock()

    def stated(self) -> list[Stated]:
        """Every Event seen, oldest first (ties in the order they were seen)."""
        with self._lock:
            return sorted(self._stated, key=lambda s: s.at)  # stable: ties keep their order

    def _run(self) -> None:
        selector = f"reason={conditions.NODES_RESERVED}"
        self._watch(self._core.list_namespaced_event, self._namespace, field_selector=selector)

    def _event(self, type_: str, found: Any) -> None:
        if type_ == "DELETED" or "kept for this job" not in (found.message or ""):
            return
        when = found.first_timestamp or found.metadata.creation_timestamp
        at = when.timestamp() if isinstance(when, datetime.datetime) else time.time()
        with self._lock:
            if found.metadata.name in self._seen:
                return
            self._seen.add(found.metadata.name)
            self._stated.append(Stated(at, found.involved_object.name, stated_bound(found.message)))


START_ALLOWANCE_SECONDS = 60.0
"""From the time a holder's nodes clear to all its pods running, what :func:`holds` allows: a
wake-up, the operator's spacing of a slow plan (20 times its last plan's seconds), its plan,
the creation of up to 512 pods and their binding by the scheduler and KWOK."""


def holds(
    stated: Sequence[Stated], ran: Mapping[str, float | None], origin: float, end: float
) -> dict[str, Any]:
    """Each holder's periods of holding (from its first Event to another holder's next, or
    ``end``) and whether the time its Events said its nodes clear by held: ``kept`` when all its
    pods ran (``ran``, epoch seconds; None: never) by the earliest time said in the period plus
    :data:`START_ALLOWANCE_SECONDS`; ``passed on`` when another job held before that came due
    (``run ended`` when the run did); ``broken`` otherwise; ``no time`` when no Event said one.  Times out are seconds after
    ``origin``; ``later`` counts Events that said a later time than the one before."""
    periods: list[tuple[str, float, list[Stated]]] = []
    for said in stated:
        if not periods or periods[-1][0] != said.job:
            periods.append((said.job, said.at, []))
        periods[-1][2].append(said)
    found: dict[str, Any] = {}
    for index, (job, began, said) in enumerate(periods):
        until = periods[index + 1][1] if index + 1 < len(periods) else end
        times = [s.clear for s in said if s.clear is not None]
        started = ran.get(job)
        row: dict[str, Any] = {
            "from": round(began - origin, 2),
            "until": round(until - origin, 2),
            "events": len(said),
            "first": None if not times else round(times[0] - origin, 2),
            "earliest": None if not times else round(min(times) - origin, 2),
            "later": sum(b > a for a, b in zip(times, times[1:], strict=False)),
            "all_running": None if started is None else round(started - origin, 2),
        }
        if not times:
            row["verdict"] = "no time"
        else:
            due = min(times) + START_ALLOWANCE_SECONDS
            last = index + 1 == len(periods)
            if started is not None and started <= due:
                row["verdict"] = "kept"
            elif until <= due:
                row["verdict"] = "run ended" if last else "passed on"
            else:
                row["verdict"] = "broken"
            ended = until if started is None else started
            row["late"] = round(max(0.0, ended - min(times)), 2)
        found.setdefault(job, []).append(row)
    return found


class Observer(WatchThread):
    """A pod watch of one namespace in a thread, and what it recorded."""

    def __init__(self, api: kubernetes.client.ApiClient, namespace: str, fleet_gpus: int) -> None:
        super().__init__(api)
        self._namespace = namespace
        self.fleet_gpus = fleet_gpus
        self.jobs: dict[str, JobRecord] = {}
        self._held: dict[str, int] = {}  # pod -> GPUs it holds (bound, not ended)
        self._pending_change: float | None = None
        self.changes: list[CapacityChange] = []
        self.samples: list[tuple[float, int, int]] = []
        """(monotonic time, allocated GPUs, waiting jobs) every sample."""
        self._lock = threading.Lock()

    def applied(self, name: str, gpus: int) -> None:
        with self._lock:
            ahead = sum(self._waiting())
            room = self.fleet_gpus - sum(self._held.values()) - ahead >= gpus
            self.jobs[name] = JobRecord(gpus=gpus, applied=time.monotonic(), room_at_apply=room)

    def allocated(self) -> int:
        with self._lock:
            return sum(self._held.values())

    def waiting(self) -> list[int]:
        with self._lock:
            return self._waiting()

    def _waiting(self) -> list[int]:
        return [r.gpus for r in self.jobs.values() if r.all_running is None and r.finished is None]

    def sample(self) -> None:
        """Record allocation and the queue now; settle a capacity change that is over."""
        now = time.monotonic()
        with self._lock:
            self.samples.append((now, sum(self._held.values()), len(self._waiting())))
            self._settle(now)

    def _settle(self, now: float) -> None:
        if self._pending_change is not None and now - self._pending_change >= CHANGE_SECONDS:
            free = self.fleet_gpus - sum(self._held.values())
            self.changes.append(CapacityChange(self._pending_change, free, tuple(self._waiting())))
            self._pending_change = None

    def _run(self) -> None:
        self._watch(self._core.list_namespaced_pod, self._namespace)

    def _event(self, type_: str, pod: Any) -> None:
        name, now = pod.metadata.name, time.monotonic()
        job = (pod.metadata.labels or {}).get(JOB_LABEL)
        phase = pod.status.phase if pod.status else None
        with self._lock:
            record = self.jobs.get(job or "")
            ended = type_ == "DELETED" or phase in FINISHED
            holds = pod.spec.node_name and not ended
            if holds:
                self._held[name] = kwok.GPUS_PER_NODE
            elif self._held.pop(name, None) is not None:
                self._pending_change = self._pending_change or now
            if record is None:
                return
            if phase == "Running" and not ended:
                record.running.add(name)
            else:
                record.running.discard(name)
            if (
                record.all_running is None
                and len(record.running) * kwok.GPUS_PER_NODE >= record.gpus
            ):
                record.all_running = now
            if phase in FINISHED and record.finished is None and record.all_running is not None:
                record.finished = now


def percentiles(values: Sequence[float]) -> dict[str, float | int]:
    """Count, p50, p95, p99 and max of ``values`` (empty: the count only)."""
    if not values:
        return {"count": 0}
    ordered = sorted(values)

    def at(share: float) -> float:
        return ordered[min(len(ordered) - 1, int(share * len(ordered)))]

    return {
        "count": len(ordered),
        "p50": statistics.median(ordered),
        "p95": at(0.95),
        "p99": at(0.99),
        "max": ordered[-1],
    }


def allocated_minutes(samples: Iterable[tuple[float, int, int]], gpus: int, share: float) -> float:
    """Minutes during which the allocated GPUs were above ``share`` of ``gpus``."""
    total, previous = 0.0, None
    for at, allocated, _ in samples:
        if previous is not None and previous[1] > share * gpus:
            total += at - previous[0]
        previous = (at, allocated)
    return total / 60
