"""Reads what :mod:`volumes` needs to know where a job's checkpoint claim lets its pods go.

The claim, then the volume it is bound to, or for an unbound claim its
StorageClass (and, for a class of local volumes, the cluster's volumes).  A few
GETs per placement of a job with a claim; none for a job without one.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import volumes


async def topology(
    client: kube.Client, namespace: str, spec: api_spec.TrainingJobSpec
) -> volumes.Topology | None:
    """Where the job's claim lets its pods go (None: no claim, or anywhere)."""
    name = spec.checkpoint.claim_name
    if not name:
        return None
    claim = await client.get_claim(namespace=namespace, name=name)
    if claim is None:
        return None
    claim_spec = claim.get("spec") or {}
    if claim_spec.get("volumeName"):
        volume = await client.get_volume(name=claim_spec["volumeName"])
        return volumes.topology(claim, volume, None)
    class_name = claim_spec.get("storageClassName")
    if not class_name:
        return None
    storage_class = await client.get_storage_class(name=class_name)
    local = (
        storage_class is not None
        and storage_class.get("provisioner") == volumes.NO_PROVISIONER
        and storage_class.get("volumeBindingMode") == volumes.WAIT_FOR_FIRST_CONSUMER
    )
    candidates = await client.list_volumes() if local else []
    return volumes.topology(claim, None, storage_class, candidates)


async def access_refusal(
    client: kube.Client, namespace: str, spec: api_spec.TrainingJobSpec, nodes: int
) -> str | None:
    """Why the gang placed on ``nodes`` nodes cannot all mount its claim (None: it can, or no claim)."""
    name = spec.checkpoint.claim_name
    if not name or (nodes <= 1 and spec.pods <= 1):
        return None
    claim = await client.get_claim(namespace=namespace, name=name)
    return volumes.access_refusal(claim, nodes, spec.pods)
