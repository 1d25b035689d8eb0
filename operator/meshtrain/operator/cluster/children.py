"""Creating a job's children, owned by its UID, with the API server's refusals as answers.

A same-named object this UID does not own (another tenant's Service, the terminating pods of an
earlier job of the same name) is never patched nor deleted: the job reports ``NameConflict``.
A create the API server refuses (Pod Security, a ResourceQuota, validation) becomes
``CreateRejected`` with the server's message.  Either way the caller drops the placement and
tries again after :func:`retry_delay`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import conditions, device_claims, gang_backend, naming, store_pod

RETRY_BASE_SECONDS = 2.0
"""Wait after the first refused create."""
RETRY_CAP_SECONDS = 120.0
"""Longest wait between two tries (a fixed namespace or quota is picked up within two minutes)."""
_TRANSIENT = (409, 429)
"""Statuses that are no refusal: already exists (examined), throttled."""
INVALID = 422
"""The API server's answer to an object its validation refuses (not Pod Security's 403)."""
INVALID_TRIES = 3
"""Refusals of a pod or DRA claim object as invalid, for one spec generation, after which the job
fails (InvalidSpec): they are the spec's, and would be refused for ever."""


def retry_delay(failures: int) -> float:
    """Seconds to wait before the next try after ``failures`` refused creates in a row.

    Doubling up to a cap, a job that cannot be created costs a few requests a minute, not a
    hot loop.
    """
    doublings = max(failures - 1, 0)
    return min(RETRY_BASE_SECONDS * float(2**doublings), RETRY_CAP_SECONDS)


@dataclasses.dataclass(frozen=True)
class Refused:
    """Why the gang's objects could not all be created."""

    reason: str
    """``conditions.CREATE_REJECTED`` or ``conditions.NAME_CONFLICT``."""
    message: str
    """Which object, and the API server's message or the owner that holds the name."""
    invalid: bool = False
    """The API server's validation refused a pod or DRA claim object (422): the spec, not the
    cluster, is at fault."""


def owner_uids(obj: Mapping[str, Any]) -> list[str]:
    return [ref.get("uid", "") for ref in (obj.get("metadata") or {}).get("ownerReferences") or []]


def _conflict(kind: str, existing: Mapping[str, Any]) -> Refused:
    metadata = existing.get("metadata") or {}
    owners = ", ".join(
        f"{ref.get('kind')}/{ref.get('name')} (uid {ref.get('uid')})"
        for ref in metadata.get("ownerReferences") or []
    )
    holder = f"owned by {owners}" if owners else "owned by no controller"
    return Refused(
        conditions.NAME_CONFLICT,
        f"{kind} {metadata.get('namespace')}/{metadata.get('name')} already exists and is {holder}; "
        "the operator never patches nor deletes what this job does not own: delete or rename it, "
        "or give the TrainingJob another name",
    )


UPDATED = ("Service", "ConfigMap", "NetworkPolicy")
"""Kinds brought up to date when they exist and are the job's (a rebuilt gang's new spec or ports,
the operator's new peers); pods and PodGroups are immutable where it matters and get new names
instead."""


REPLACED = (device_claims.COMPUTE_DOMAIN,)
"""Kinds whose spec is immutable and whose name does not follow it: one of the job's whose
``meshtrain.io/spec-hash`` differs from the job's (a ComputeDomain an earlier release made with
``numNodes`` the gang's size) is deleted and created anew; one of the same hash is kept.  The GPU
ResourceClaimTemplate is never replaced: its name carries its spec's hash, so a changed
``resources.dra`` is a new template (a restarted gang claims from the same one)."""


def _stamp(obj: Mapping[str, Any]) -> str | None:
    return ((obj.get("metadata") or {}).get("labels") or {}).get(naming.LABEL_SPEC_HASH)


async def _replace(
    client: kube.Client, manifest: dict[str, Any], existing: Mapping[str, Any]
) -> Refused | None:
    """Replace the job's own ``existing`` object of an outdated spec by ``manifest``."""
    kind, metadata = manifest["kind"], manifest["metadata"]
    where = f"{metadata['namespace']}/{metadata['name']}"
    await client.delete(
        kind=kind,
        namespace=metadata["namespace"],
        name=metadata["name"],
        uid=existing["metadata"]["uid"],
    )
    if await client.create(manifest=manifest) is not None:
        return None
    return Refused(  # still being deleted (a finalizer): the next try after the backoff creates it
        conditions.CREATE_REJECTED,
        f"{kind} {where} of an earlier spec is still being deleted; the job's new one follows",
    )


async def _stale_store(client: kube.Client, existing: Mapping[str, Any]) -> Refused:
    """The job's store pod of that name is an earlier gang's (the same attempt placed again after
    a Kueue eviction or a suspension): its state is not the new gang's.  It is deleted (unless
    it is going away already), and the placement follows once it is gone."""
    metadata = existing["metadata"]
    if not metadata.get("deletionTimestamp"):
        await client.delete_pods(
            namespace=metadata["namespace"],
            names=[metadata["name"]],
            uids={metadata["name"]: metadata["uid"]},
        )
    return Refused(
        conditions.CREATE_REJECTED,
        f"pod {metadata['namespace']}/{metadata['name']}, the rendezvous store of an earlier gang, "
        "is going away; the gang follows once it is gone",
    )


def _store_gone(manifest: Mapping[str, Any]) -> Refused:
    """An earlier gang's store pod of that name left between the create and the read: no trainer
    pod may be made without its store, so the placement is tried again."""
    metadata = manifest["metadata"]
    return Refused(
        conditions.CREATE_REJECTED,
        f"pod {metadata['namespace']}/{metadata['name']}, the rendezvous store of an earlier "
        "gang, was just going away; the gang follows",
    )


def _rejected(manifest: dict[str, Any], err: kube.ApiError) -> Refused:
    kind, metadata = manifest["kind"], manifest["metadata"]
    said = f"the API server refused to create {kind} {metadata['namespace']}/{metadata['name']}: "
    unserved = kind == "PodGroup" and err.status == 404  # the gang backend's API is missing
    missing = f" ({gang_backend.missing_api(manifest)})" if unserved else ""
    return Refused(
        conditions.CREATE_REJECTED,
        device_claims.refusal(kind, err.status, err.body) or f"{said}{err.body}{missing}",
        invalid=kind in ("Pod", *device_claims.KINDS) and err.status == INVALID,
    )


async def _create(client: kube.Client, manifest: dict[str, Any], uid: str) -> Refused | None:
    kind, metadata = manifest["kind"], manifest["metadata"]
    update = kind in UPDATED
    try:
        if await client.create(manifest=manifest) is not None:
            return None
        existing = await client.read(
            kind=kind,
            namespace=metadata["namespace"],
            name=metadata["name"],
            api_version=manifest.get("apiVersion"),
        )
        if existing is None:  # gone between the two calls: the next pass creates it
            return _store_gone(manifest) if store_pod.is_store(manifest) else None
        if uid not in owner_uids(existing):
            return _conflict(kind, existing)
        if kind in REPLACED and _stamp(existing) != _stamp(manifest):
            return await _replace(client, manifest, existing)
        if store_pod.is_store(existing) and store_pod.stale(existing, manifest):
            return await _stale_store(client, existing)
        if (
            update
        ):  # that very object: a Conflict if it was re-created since (the next pass reads again)
            await client.patch(
                manifest=manifest,
                uid=existing["metadata"]["uid"],
                resource_version=existing["metadata"]["resourceVersion"],
            )
        return None
    except kube.ApiError as err:
        if err.status < 400 or err.status >= 500 or err.status in _TRANSIENT:
            raise
        return _rejected(manifest, err)


async def ensure(
    client: kube.Client,
    uid: str,
    shared: Sequence[dict[str, Any]],
    pods: Sequence[dict[str, Any]],
) -> Refused | None:
    """Create ``shared`` objects (ConfigMap, Service, NetworkPolicy — updated when the job owns them —,
    PodGroup, DRA claim objects — replaced when their spec changed —), then ``pods``.

    Two waves, each concurrent: a pod exists only once every shared object does, so an
    operator killed between the calls leaves at worst shared objects without pods (crash
    recovery creates the missing pods), never pods whose gates would be lifted without the
    Service their peers resolve.  Returns the first refusal (shared objects first, and then
    no pod is created), or None when every object exists and is the job's.
    """
    for wave in (shared, pods):
        answers = await asyncio.gather(*(_create(client, m, uid) for m in wave))
        refused = next((answer for answer in answers if answer is not None), None)
        if refused is not None:
            return refused
    return None


async def delete_owned(client: kube.Client, uid: str, kind: str, namespace: str, name: str) -> None:
    """Delete ``kind`` ``name`` only if the job ``uid`` owns it (and only that very object)."""
    existing = await client.read(kind=kind, namespace=namespace, name=name)
    if existing is not None and uid in owner_uids(existing):
        await client.delete(
            kind=kind, namespace=namespace, name=name, uid=existing["metadata"]["uid"]
        )
