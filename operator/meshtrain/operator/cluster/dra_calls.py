"""The client's requests to a DRA job's claim objects (ResourceClaimTemplates, ComputeDomains).

A part of ``kube.Client``: its ``create``, ``read`` and ``delete`` of a job's children send these
for the kinds of :mod:`~meshtrain.operator.policy.device_claims`.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from meshtrain.operator.policy import device_claims

Body = dict[str, Any]

APIS = {
    device_claims.CLAIM_TEMPLATE: ("resource.k8s.io", "v1", "resourceclaimtemplates"),
    device_claims.COMPUTE_DOMAIN: ("resource.nvidia.com", "v1beta1", "computedomains"),
}
"""Group, version and plural of each kind."""


class DraCalls:
    """Create, read and delete a job's ResourceClaimTemplate and ComputeDomain."""

    _custom: Any
    """``kubernetes_asyncio``'s CustomObjectsApi of the client."""

    _request: Callable[..., Awaitable[Body | None]]
    """``kube.Client``'s one way to send a request (counted, timed, leader-guarded)."""

    async def create_claim_object(self, *, manifest: Body) -> Body | None:
        """Create one; None when one of that name exists already."""
        group, version, plural = APIS[manifest["kind"]]
        return await self._request(
            "create",
            plural,
            self._custom.create_namespaced_custom_object,
            *(group, version, manifest["metadata"]["namespace"], plural, manifest),
            ok=(409,),
        )

    async def read_claim_object(self, *, kind: str, namespace: str, name: str) -> Body | None:
        """The object, or None when there is none of that name."""
        group, version, plural = APIS[kind]
        return await self._request(
            "get",
            plural,
            self._custom.get_namespaced_custom_object,
            *(group, version, namespace, plural, name),
            ok=(404,),
        )

    async def delete_claim_object(self, *, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete ``name`` if it is still the object ``uid`` (a precondition)."""
        group, version, plural = APIS[kind]
        await self._request(
            "delete",
            plural,
            self._custom.delete_namespaced_custom_object,
            *(group, version, namespace, plural, name),
            body={"preconditions": {"uid": uid}},
            ok=(404, 409),
        )
