"""The client's reads of Dynamic Resource Allocation objects (``resource.k8s.io/v1``) for placement.

A part of ``kube.Client``: ResourceSlices, ResourceClaims (every namespace) and DeviceClasses,
listed page by page and watched, for the informer's device cache (``device_cache``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

Body = dict[str, Any]


class DeviceReads:
    """List and watch ResourceSlices, ResourceClaims and DeviceClasses."""

    _resource: Any
    """``kubernetes_asyncio``'s ResourceV1Api of the client."""

    _list: Callable[..., Awaitable[tuple[list[Body], str]]]
    """kube.Client's paginated list."""
    _watch: Callable[..., AsyncIterator[tuple[str, Body]]]
    """kube.Client's watch."""

    def _dra_call(self, resource: str) -> Callable[..., Awaitable[Any]]:
        calls = {
            "resourceslices": self._resource.list_resource_slice,
            "resourceclaims": self._resource.list_resource_claim_for_all_namespaces,
            "deviceclasses": self._resource.list_device_class,
        }
        return calls[resource]  # type: ignore[no-any-return]

    async def list_devices(
        self, *, resource: str, keep: Callable[[Body], Body] | None = None
    ) -> tuple[list[Body], str]:
        """Every object of ``resource`` (resourceslices, resourceclaims, deviceclasses), and the version."""
        return await self._list(resource, self._dra_call(resource), keep=keep)

    async def watch_devices(
        self, *, resource: str, resource_version: str
    ) -> AsyncIterator[tuple[str, Body]]:
        """(type, object) events of ``resource`` from ``resource_version`` on."""
        async for event in self._watch(
            resource, self._dra_call(resource), resource_version=resource_version
        ):
            yield event
