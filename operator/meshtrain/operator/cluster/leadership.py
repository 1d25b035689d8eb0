"""Leader election over a coordination.k8s.io Lease: one replica reconciles, the others wait warm.

``kubernetes_asyncio.leaderelection`` runs client-go's protocol; a watchdog here stops the
holder ``renew_deadline`` after the last renewal it sent that succeeded, before any candidate
may take the Lease, so two replicas never start new passes at once.  A standby keeps its
watches and caches filled and acts on the first pass after it takes over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import socket
import time
import uuid
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
from kubernetes_asyncio.leaderelection.resourcelock import leaselock

from meshtrain.operator.cluster import kube, metrics

logger = logging.getLogger("meshtrain.operator")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
WATCHDOG_SECONDS = 0.1
"""How often the holder checks that its last renewal is recent enough to go on acting."""


class Tenure:
    """Until when this replica may act: ``renew_deadline`` after it sent its last Lease write that succeeded.

    A candidate takes the Lease only ``lease_seconds`` after it saw that write, which it
    can have seen only after it was sent; so what lands before the tenure ends lands
    before any other replica acts (``lease_seconds - renew_deadline`` is the margin for
    clock rates and for the API server finishing a request the client gave up on).
    """

    def __init__(self, until: float = -math.inf) -> None:
        self.until = until
        """time.monotonic() at the end."""

    def left(self) -> float:
        return self.until - time.monotonic()


class _TimedLeaseLock(leaselock.LeaseLock):
    """The library's Lease lock with a timeout on every request; each success extends the tenure."""

    def __init__(self, *args: Any, timeout: float, tenure: Tenure, renew_deadline: float) -> None:
        super().__init__(*args)
        self._timeout = timeout
        self._tenure = tenure
        self._renew_deadline = renew_deadline

    async def get(self, name: str, namespace: str) -> tuple[bool, Any]:
        try:
            return await asyncio.wait_for(super().get(name, namespace), self._timeout)
        except TimeoutError:
            # With a Status body as the API server's: the library reads its "code" (and asserts one).
            timed_out = ApiException(status=504, reason="Lease read timed out")
            timed_out.body = json.dumps(
                {
                    "kind": "Status",
                    "code": 504,
                    "reason": "Timeout",
                    "message": "Lease read timed out",
                }
            ).encode()
            return False, timed_out

    async def _held(self, write: Any) -> bool:
        sent = time.monotonic()
        try:
            done = bool(await asyncio.wait_for(write, self._timeout))
        except TimeoutError:
            return False
        if done:  # this replica held the Lease when it sent the write
            self._tenure.until = sent + self._renew_deadline
        return done

    async def create(self, name: str, namespace: str, election_record: Any) -> bool:
        return await self._held(super().create(name, namespace, election_record))

    async def update(self, name: str, namespace: str, updated_record: Any) -> bool:
        return await self._held(super().update(name, namespace, updated_record))


@dataclasses.dataclass(frozen=True)
class Election:
    """Where the Lease lives and how long it lasts (flags of ``meshtrain operator``)."""

    lease: str
    """Name of the Lease object (``--lease``)."""
    namespace: str
    """Namespace of the Lease (the operator's own)."""
    identity: str
    """This replica's name in ``spec.holderIdentity``; must outlive a container restart, so that a
    restarted operator finds the Lease held by itself and resumes at once."""
    lease_seconds: int = 15
    """How long a candidate waits on an unchanged record before it takes the Lease (whole seconds)."""
    renew_deadline: float = 10.0
    """How long the holder keeps trying to renew before it stops acting."""
    retry: float = 2.0
    """Pause between two attempts to acquire or renew."""


def default_identity() -> str:
    """$POD_NAME (the downward API in the chart), else the host name made unique to this process.

    Two processes with one identity would both take the Lease as their own (the
    library renews a Lease whose holder is its identity) and both act; outside a
    pod, two operators on one host share the host name.  A process restarted
    outside a pod therefore waits for its old Lease to expire.
    """
    return os.environ.get("POD_NAME") or f"{socket.gethostname()}_{uuid.uuid4().hex[:8]}"


def default_namespace() -> str:
    """$POD_NAMESPACE, else the service account's namespace in a pod, else ``default``."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as found:
            return found.read().strip() or "default"
    except OSError:
        return "default"


async def run(
    client: kube.Client, election: Election, leading: asyncio.Event, tenure: Tenure
) -> None:
    """Hold ``leading`` set exactly while this replica holds the Lease, and ``tenure`` its end;
    runs until cancelled.

    The watchdog, not the library's renew loop, ends the tenure: the library sends its Lease
    requests without a timeout, so a renewal that hangs (a partition that drops packets) kept
    the old leader acting forever while a standby took over.
    """

    def stand_by() -> None:
        leading.clear()
        tenure.until = -math.inf
        # Its per-job series would stay frozen beside the new leader's (a deleted Failed job
        # still failing, a placed job's unschedulable seconds still growing).
        metrics.forget_all()

    async def started() -> None:
        logger.info("leading: Lease %s/%s held", election.namespace, election.lease)
        leading.set()

    async def stopped() -> None:
        stand_by()
        logger.warning("lost Lease %s/%s: standing by", election.namespace, election.lease)

    while True:
        lock = _TimedLeaseLock(
            election.lease,
            election.namespace,
            election.identity,
            client.api_client,
            timeout=election.renew_deadline,
            tenure=tenure,
            renew_deadline=election.renew_deadline,
        )
        config = electionconfig.Config(
            lock,
            lease_duration=election.lease_seconds,
            renew_deadline=election.renew_deadline,
            retry_period=election.retry,
            onstarted_leading=started,
            onstopped_leading=stopped,
        )
        elector = asyncio.create_task(leaderelection.LeaderElection(config).run())
        try:
            while not elector.done():
                if leading.is_set() and tenure.left() < 0:
                    stand_by()
                    logger.warning(
                        "Lease %s/%s not renewed for %.0f s: standing by",
                        election.namespace,
                        election.lease,
                        election.renew_deadline,
                    )
                    elector.cancel()
                    break
                await asyncio.wait({elector}, timeout=WATCHDOG_SECONDS)
            (ended,) = await asyncio.gather(elector, return_exceptions=True)
        except asyncio.CancelledError:
            elector.cancel()
            stand_by()
            raise
        stand_by()
        if isinstance(ended, Exception):  # the API unreachable: stand by and try again
            logger.warning("leader election interrupted: %s", ended)
        await asyncio.sleep(election.retry)
