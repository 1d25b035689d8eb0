"""Wake-up streams: pods of TrainingJobs and cluster nodes, watched without kopf.

What it is: :func:`run`, background watches that turn pod and node changes
into wake-ups of job daemons (:class:`handlers.Wakeups` duck type: ``poke``
and ``poke_waiting``).  A pod change wakes its job; a pod that finished or
went away, and any node change, wake the jobs waiting for capacity.  These
watches only *wake*; every decision is made from fresh reads by the
reconciler, so a missed or replayed event costs a pass, never correctness.

Why not kopf: kopf runs its full per-object machinery (a diff-base deep copy,
a worker, handler bookkeeping) for every event, which dominated the
operator's CPU when a 128-pod gang was created; a plain watch that parses a
line and sets an ``asyncio.Event`` is an order of magnitude cheaper.

What it is not: a cache or an informer; nothing here is read back.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import aiohttp

from meshtrain.operator import kube, naming

logger = logging.getLogger("meshtrain.operator")

RETRY_SECONDS = 1.0
"""Pause before re-opening a watch that failed."""


class Waker(Protocol):
    def poke(self, key: tuple[str, str]) -> None: ...
    def poke_waiting(self) -> None: ...


def _on_pod(waker: Waker, type_: str, pod: dict[str, Any]) -> None:
    metadata = pod.get("metadata") or {}
    job = (metadata.get("labels") or {}).get(naming.LABEL_JOB)
    if job:
        waker.poke((metadata.get("namespace", ""), job))
    if type_ == "DELETED" or ((pod.get("status") or {}).get("phase") in ("Succeeded", "Failed")):
        waker.poke_waiting()


def _on_node(waker: Waker, type_: str, node: dict[str, Any]) -> None:
    waker.poke_waiting()


async def _follow(
    client: kube.Client,
    path: str,
    selector: str | None,
    handle: Callable[[Waker, str, dict[str, Any]], None],
    waker: Waker,
) -> None:
    """Watch ``path`` forever, resuming from the last resourceVersion; start over after 410 Gone."""
    version: str | None = None
    while True:
        try:
            async for type_, obj in client.watch(
                path=path, selector=selector, resource_version=version
            ):
                version = (obj.get("metadata") or {}).get("resourceVersion") or version
                if type_ != "BOOKMARK":
                    handle(waker, type_, obj)
        except kube.ApiError as err:
            if err.status == 410:
                version = None  # too old: replay the current state (ADDED for every object)
            else:
                logger.warning("watch of %s failed: %s", path, err)
                await asyncio.sleep(RETRY_SECONDS)
        except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as err:
            logger.warning("watch of %s interrupted: %s", path, err)
            await asyncio.sleep(RETRY_SECONDS)


async def run(client: kube.Client, waker: Waker, namespaces: Sequence[str]) -> None:
    """Watch pods of TrainingJobs (in ``namespaces``, or everywhere when empty) and nodes, until cancelled."""
    pod_paths = [f"/api/v1/namespaces/{ns}/pods" for ns in namespaces] or ["/api/v1/pods"]
    streams = [_follow(client, path, naming.LABEL_JOB, _on_pod, waker) for path in pod_paths]
    streams.append(_follow(client, "/api/v1/nodes", None, _on_node, waker))
    await asyncio.gather(*streams)
