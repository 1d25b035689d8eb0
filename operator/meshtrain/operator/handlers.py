"""kopf handlers of the meshtrain operator: thin wiring of watches to the reconciler.

One kopf daemon per TrainingJob loops ``reconcile``, woken by the job's events, by the pod and
node informers or by a timer; a deletion handler removes the job's children; start-up and
clean-up hold the shared API client and leader election.  In a replica that does not hold the
Lease the daemons wait, with the caches kept warm.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import random
from collections.abc import Callable, Mapping
from typing import Any

import kopf

from meshtrain.api import spec as api_spec
from meshtrain.operator import device_wake, reconciler, replan_counts
from meshtrain.operator.cluster import api_errors, children, informer, kube, leadership
from meshtrain.operator.policy import kueue_workload, naming

RESOURCE = (api_spec.API_GROUP, api_spec.API_VERSION, api_spec.PLURAL)
API_ERRORS_REPORTED_AFTER = 3
"""Consecutive failed passes (5xx, 429, unreachable) after which the job's ApiErrors condition says so."""
STANDBY_POLL_SECONDS = 2.0
"""How often a standby's deletion handler looks whether the leader has finished the job's deletion."""
WAIT_FOR_PODS_SECONDS = 1.0
"""How often a deleted job queued by Kueue looks again whether its pods are gone."""
MAX_IMMEDIATE_PASSES = 25
"""Back-to-back passes allowed while each one changes something, before waiting for an event."""

logger = logging.getLogger("meshtrain.operator")


WAKE_COALESCE_SECONDS = 0.2
"""Capacity changes within this long wake the waiting jobs once (a gang's pods end together)."""


class Wakeups:
    """Per-job wake-up events: pod and job events wake their job; node and freed-GPU events wake
    the waiting jobs that the change could admit (``admit``), once per :data:`WAKE_COALESCE_SECONDS`."""

    def __init__(
        self,
        admit: Callable[[list[tuple[str, str]]], list[tuple[str, str]]] = lambda keys: keys,
        changed: Callable[[], None] = lambda: None,
        missed: Callable[[tuple[str, str]], bool] = lambda key: False,
        admit_devices: Callable[
            [list[tuple[str, str]], frozenset[str]], list[tuple[str, str]]
        ] = lambda keys, nodes: keys,
        counts: replan_counts.Counts | None = None,
    ) -> None:
        self._events: dict[tuple[str, str], asyncio.Event] = {}
        self._waiting: set[tuple[str, str]] = set()
        self._admit = admit
        """Of the waiting jobs, those a capacity change could admit (``waiting.Queue.wake``)."""
        self._changed = changed
        """Counts a capacity change (``waiting.Queue.capacity_changed``)."""
        self._missed = missed
        """Whether capacity changed since a job's last plan started (``waiting.Queue.missed``)."""
        self._admit_devices = admit_devices
        """Of the waiting jobs, those a device change on these nodes could admit
        (``device_wake.admitted``)."""
        self._device_nodes: set[str] = set()
        """Nodes whose devices changed since the last wake-up."""
        self._broad = False
        """Whether a change other than on :attr:`_device_nodes` came since the last wake-up."""
        self._recheck: set[tuple[str, str]] = set()
        """Jobs whose plan raced a change of any kind: asked with the broad rule."""
        self._counts = counts or replan_counts.Counts()
        """Per waiting job, the wake-ups it got (and, counted by the placer, its plans)."""
        self._flush: asyncio.TimerHandle | None = None
        self.woken = 0
        """Wake-ups of waiting jobs so far (each one a capacity change that could admit the job)."""

    def event(self, key: tuple[str, str]) -> asyncio.Event:
        return self._events.setdefault(key, asyncio.Event())

    def poke(self, key: tuple[str, str]) -> None:
        if key in self._events:
            self._events[key].set()

    def set_waiting(self, key: tuple[str, str], waiting: bool) -> None:
        """Mark a job as waiting for capacity (woken when nodes change or GPUs are freed); one
        whose plan raced a capacity change is asked about at the next wake-up."""
        if waiting:
            if key not in self._waiting and self._missed(key):
                self._waiting.add(key)
                self._recheck.add(key)
                self._schedule()
            self._waiting.add(key)
        else:
            self._waiting.discard(key)
            self._counts.settled(key)

    def poke_waiting(self) -> None:
        """Capacity changed: wake the waiting jobs it could admit, after the changes that follow
        within :data:`WAKE_COALESCE_SECONDS` (one wake-up for them all)."""
        self._broad = True
        self._changed()
        self._schedule()

    def poke_devices(self, nodes: frozenset[str] | None) -> None:
        """Devices changed on ``nodes`` (None: anywhere; empty: none freed or added): wake the
        waiting jobs that could use those nodes' devices, as :meth:`poke_waiting` does."""
        if nodes is not None and not nodes:
            return
        if nodes is None:
            self._broad = True
        else:
            self._device_nodes.update(nodes)
        self._changed()
        self._schedule()

    def _schedule(self) -> None:
        if self._flush is None and self._waiting:
            loop = asyncio.get_running_loop()
            self._flush = loop.call_later(WAKE_COALESCE_SECONDS, self._wake_admitted)

    def _wake_admitted(self) -> None:
        self._flush = None
        waiting, nodes = sorted(self._waiting), frozenset(self._device_nodes)
        broad, self._broad = self._broad or not nodes, False
        recheck = [k for k in waiting if k in self._recheck]
        self._device_nodes.clear()
        self._recheck.clear()
        if broad:
            admitted = self._admit(waiting)
        else:
            rest = [k for k in waiting if k not in recheck]
            admitted = sorted({*self._admit_devices(rest, nodes), *self._admit(recheck)})
        for key in admitted:
            self.woken += 1
            self._counts.admitted(key)
            self.poke(key)

    def forget(self, key: tuple[str, str]) -> None:
        self._events.pop(key, None)
        self._waiting.discard(key)
        self._counts.settled(key)


@kopf.on.login()
async def login(memo: kopf.Memo, **_: Any) -> kopf.ConnectionInfo:
    """kopf's watches use the same credentials as the operator's client (``--kubeconfig`` or in-cluster)."""
    found = await kube.connection(memo.kubeconfig)
    return kopf.ConnectionInfo(scheme="Bearer" if found["token"] else None, **found)


@kopf.on.startup()
async def start(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Create the API client and the reconciler; keep kopf's own bookkeeping in meshtrain.io annotations."""
    settings.persistence.finalizer = f"{naming.GROUP}/cleanup"
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=naming.GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.GROUP, key="last-handled-configuration"
    )
    settings.posting.enabled = (
        False  # events are written by the reconciler, with reasons of our own
    )
    settings.watching.server_timeout = 300
    client = await kube.Client.connect(kubeconfig=memo.kubeconfig)
    cache = informer.Cache(follow_devices=True)
    resolved = await reconciler.resolved(client, memo.settings)
    memo.reconciler = reconciler.Reconciler(client=client, cache=cache, settings=resolved)
    queue = memo.reconciler.placer.waiting
    memo.wakeups = Wakeups(  # the queue's change count is the cache's own (informer._Counted)
        queue.wake,
        missed=queue.missed,
        admit_devices=functools.partial(device_wake.admitted, queue),
        counts=memo.reconciler.placer.replans,
    )
    memo.watches = asyncio.create_task(cache.run(client, memo.wakeups, memo.namespaces))
    memo.leading = asyncio.Event()
    tenure = leadership.Tenure(math.inf if memo.election is None else -math.inf)
    # A pass under way when the Lease is lost writes no more, and no write outlives the Lease.
    client.lease_left = lambda: tenure.left() if memo.leading.is_set() else 0.0
    if memo.election is None:
        memo.leading.set()
        memo.elector = None
    else:
        memo.elector = asyncio.create_task(
            leadership.run(client, memo.election, memo.leading, tenure)
        )


@kopf.on.cleanup()
async def stop(memo: kopf.Memo, **_: Any) -> None:
    memo.watches.cancel()
    if memo.elector is not None:
        memo.elector.cancel()
    memo.reconciler.fit.worker.stop()
    await memo.reconciler.client.close()
    await memo.reconciler.progress.close()


async def _sleep(wake: asyncio.Event, stopped: kopf.DaemonStopped, timeout: float) -> None:
    """Until the job is poked, the daemon is stopped, or ``timeout`` passes."""
    waiters = {asyncio.ensure_future(wake.wait()), asyncio.ensure_future(stopped.wait())}
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


@kopf.daemon(*RESOURCE, cancellation_timeout=10.0)
async def run_job(
    stopped: kopf.DaemonStopped, namespace: str | None, name: str, memo: kopf.Memo, **_: Any
) -> None:
    """Reconcile one job until it is deleted, finished for good, or the operator stops."""
    assert namespace is not None  # TrainingJobs are namespaced
    key = (namespace, name)
    wake = memo.wakeups.event(key)
    settings: reconciler.Settings = memo.settings
    passes = 0
    failures = 0  # passes in a row that failed on the API server
    try:
        while not stopped:
            if not memo.leading.is_set():  # a standby: wait for the Lease (or the stop)
                await _sleep(memo.leading, stopped, settings.resync_seconds)
                continue
            wake.clear()
            try:
                outcome = await memo.reconciler.reconcile(namespace=namespace, name=name)
            except kube.NotLeading as err:  # the Lease was lost during the pass: stand by
                logger.info("reconcile of %s/%s stopped: %s", namespace, name, err)
                # The tenure can end a moment before the watchdog clears ``leading``: no spin.
                await asyncio.sleep(leadership.WATCHDOG_SECONDS)
                continue
            except kube.Conflict as err:  # the job changed under the pass: decide again from it
                logger.info("reconcile of %s/%s raced a write, again: %s", namespace, name, err)
                outcome = reconciler.Outcome(changed=True, requeue_after=0)
            except (TimeoutError, kube.ApiError, OSError) as err:
                failures += 1
                delay = api_errors.retry_delay(
                    err,
                    failures,
                    random.random(),
                    base=children.RETRY_BASE_SECONDS,
                    cap=children.RETRY_CAP_SECONDS,
                )
                logger.warning(
                    "reconcile of %s/%s failed (%d in a row), again in %.0f s: %s",
                    *key,
                    failures,
                    delay,
                    err,
                )
                if failures >= API_ERRORS_REPORTED_AFTER:
                    await _report(memo, key, failures, str(err))
                # Events do not cut this wait short: the report's own write is one.
                await _sleep(asyncio.Event(), stopped, delay)
                continue
            else:
                if failures >= API_ERRORS_REPORTED_AFTER:
                    await _report(memo, key, failures, None)
                failures = 0
            if outcome.gone or outcome.done:
                return
            memo.wakeups.set_waiting(key, outcome.waiting_for_capacity)
            passes = passes + 1 if outcome.changed else 0
            if outcome.changed and passes < MAX_IMMEDIATE_PASSES:
                continue
            timeout = settings.resync_seconds
            if outcome.requeue_after is not None:
                timeout = min(timeout, max(outcome.requeue_after, 0.05))
            await _sleep(wake, stopped, timeout)
    finally:
        memo.wakeups.forget(key)


async def _report(memo: kopf.Memo, key: tuple[str, str], failures: int, error: str | None) -> None:
    with contextlib.suppress(TimeoutError, kube.ApiError, OSError):  # the API may still be failing
        await memo.reconciler.report_api_errors(
            namespace=key[0], name=key[1], failures=failures, error=error
        )


@kopf.on.event(*RESOURCE)
async def job_event(namespace: str | None, name: str, memo: kopf.Memo, **_: Any) -> None:
    """Spec or status changes wake the job's daemon (e.g. suspend toggled)."""
    memo.wakeups.poke((namespace, name))


@kopf.on.event(
    kueue_workload.GROUP,
    kueue_workload.VERSION,
    kueue_workload.PLURAL,
    labels={naming.LABEL_JOB: kopf.PRESENT},
)
async def workload_event(
    namespace: str | None, labels: Mapping[str, str], memo: kopf.Memo, **_: Any
) -> None:
    """Kueue admitted, evicted or requeued a job's Workload: wake the job's daemon at once.

    Served only where Kueue's CRDs exist; elsewhere kopf waits for them to appear.
    """
    memo.wakeups.poke((namespace, labels[naming.LABEL_JOB]))


@kopf.on.delete(*RESOURCE)
async def delete_children(
    namespace: str | None, name: str, uid: str, memo: kopf.Memo, **_: Any
) -> None:
    """Delete the pods, Service and ConfigMap this job owns (also done by the garbage collector where one runs).

    A standby touches nothing: it returns once the job is gone (the leader deleted
    the children and removed the finalizer), or does the deletion itself if it
    takes the Lease first.  It never returns while the job still exists, which
    would have kopf remove the finalizer before the children are gone.
    """
    assert namespace is not None
    while True:
        if memo.leading.is_set():
            try:
                held = await memo.reconciler.delete_children(
                    namespace=namespace, name=name, uid=uid
                )
            except kube.NotLeading:  # the Lease was lost meanwhile: stand by again
                # The tenure can end a moment before the watchdog clears ``leading``: no spin.
                await asyncio.sleep(leadership.WATCHDOG_SECONDS)
                continue
            if not held:
                break
            # Its Workload keeps Kueue's quota until the stopping ranks are gone.
            logger.debug(
                "%s/%s: %d pod(s) still stopping before its Workload goes", namespace, name, held
            )
            await asyncio.sleep(WAIT_FOR_PODS_SECONDS)
            continue
        if not await memo.reconciler.job_exists(namespace=namespace, name=name, uid=uid):
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(memo.leading.wait(), STANDBY_POLL_SECONDS)
    memo.wakeups.forget((namespace, name))
