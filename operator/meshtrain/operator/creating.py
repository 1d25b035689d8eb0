"""A placed gang created outside the placement lock: :class:`Gang`, :func:`create`.

``placing`` chooses the plan, writes it and assumes the gang's pods in the cache under its lock,
so the next plan sees their GPUs taken before the pods exist (``cluster.assumed``); the API round
trips of creating them (32 in flight, ``kube.CONCURRENCY``) run after the lock is released.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from meshtrain.operator.cluster import assumed, children, informer, kube
from meshtrain.operator.policy import identity


@dataclasses.dataclass(frozen=True)
class Gang:
    """A placed gang whose objects are yet to be created."""

    ref: identity.JobRef
    """The job."""
    shared: list[dict[str, Any]]
    """Its objects besides the pods (ConfigMap, Service, PodGroup, ...: ``children.ensure``'s
    first wave, so no pod exists before them)."""
    pods: list[dict[str, Any]]
    """Its pods, gated, each on its planned node."""


def assume(cache: informer.Cache, gang: Gang) -> int:
    """Charge the gang's pods to their planned nodes in ``cache`` until they appear; how many."""
    return cache.assume(gang.ref.uid, gang.pods)


async def create(client: kube.Client, cache: informer.Cache, gang: Gang) -> children.Refused | None:
    """Create the gang's objects (``children.ensure``); a refusal or an error (a crash of the
    pass included) ends the gang's assumptions: the pods created count as themselves, the others
    never will."""
    renewing = asyncio.create_task(_renew(cache, gang.ref.uid))
    try:
        refused = await children.ensure(client, gang.ref.uid, gang.shared, gang.pods)
    except BaseException:
        _release(cache, gang)
        raise
    finally:
        renewing.cancel()
    if refused is not None:
        _release(cache, gang)
    else:  # created: each assumption lasts until its pod is seen (or the informer's lag runs out)
        cache.assumed.renew(gang.ref.uid, time.monotonic())
    return refused


async def _renew(cache: informer.Cache, job: str) -> None:
    """Keep the gang's assumptions alive while its pods are being created (a large gang against a
    throttling API server may take longer than one assumption lives)."""
    while True:
        await asyncio.sleep(assumed.ASSUME_SECONDS / 2)
        cache.assumed.renew(job, time.monotonic())


def _release(cache: informer.Cache, gang: Gang) -> None:
    """End the gang's assumptions; what they held is free again: the waiting jobs are told."""
    if cache.assumed.release(gang.ref.uid):
        cache.waker.poke_waiting()
