"""Leader election over a coordination.k8s.io Lease: one replica reconciles, the others wait warm.

``kubernetes_asyncio.leaderelection`` does the protocol (client-go's): the
holder renews the Lease every ``retry`` seconds and gives up acting when it
could not renew for ``renew_deadline``; a candidate takes the Lease once it
has seen the same record unchanged for ``lease_seconds``.  Since the holder
stops before any candidate may start, two replicas never act at once.

The identity is the pod's name, which a container restart keeps: an operator
killed and restarted in its pod finds the Lease held by itself and resumes at
once, instead of waiting for a dead peer's record to expire as with kopf
peering.  A standby keeps its watches and caches filled, so it acts on the
first pass after it takes over.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import socket

from kubernetes_asyncio.leaderelection import electionconfig, leaderelection
from kubernetes_asyncio.leaderelection.resourcelock import leaselock

from meshtrain.operator import kube

logger = logging.getLogger("meshtrain.operator")

SERVICE_ACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


@dataclasses.dataclass(frozen=True)
class Election:
    """Where the Lease lives and how long it lasts (flags of ``meshtrain operator``)."""

    lease: str
    """Name of the Lease object."""
    namespace: str
    """Namespace of the Lease (the operator's own)."""
    identity: str
    """This replica's name in ``spec.holderIdentity``; must outlive a container restart."""
    lease_seconds: int = 15
    """How long a candidate waits on an unchanged record before it takes the Lease (whole seconds)."""
    renew_deadline: float = 10.0
    """How long the holder keeps trying to renew before it stops acting."""
    retry: float = 2.0
    """Pause between two attempts to acquire or renew."""


def default_identity() -> str:
    """$POD_NAME (the downward API in the chart), else the host name."""
    return os.environ.get("POD_NAME") or socket.gethostname()


def default_namespace() -> str:
    """$POD_NAMESPACE, else the service account's namespace in a pod, else ``default``."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SERVICE_ACCOUNT_NAMESPACE) as found:
            return found.read().strip() or "default"
    except OSError:
        return "default"


async def run(client: kube.Client, election: Election, leading: asyncio.Event) -> None:
    """Hold ``leading`` set exactly while this replica holds the Lease; runs until cancelled."""

    async def started() -> None:
        logger.info("leading: Lease %s/%s held", election.namespace, election.lease)
        leading.set()
        await asyncio.Event().wait()

    async def stopped() -> None:
        leading.clear()
        logger.warning("lost Lease %s/%s: standing by", election.namespace, election.lease)

    while True:
        lock = leaselock.LeaseLock(
            election.lease, election.namespace, election.identity, client.api_client
        )
        config = electionconfig.Config(
            lock,
            lease_duration=election.lease_seconds,
            renew_deadline=election.renew_deadline,
            retry_period=election.retry,
            onstarted_leading=started,
            onstopped_leading=stopped,
        )
        try:
            await leaderelection.LeaderElection(config).run()
        except asyncio.CancelledError:
            leading.clear()
            raise
        except Exception as err:  # noqa: BLE001 - the API unreachable: stand by and try again
            leading.clear()
            logger.warning("leader election interrupted: %s", err)
        await asyncio.sleep(election.retry)
