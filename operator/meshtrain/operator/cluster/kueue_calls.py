"""The client's requests to Kueue's objects (Workloads, priority classes, ResourceFlavors).

A part of ``kube.Client``, one keyword-only coroutine per call; ``workloads`` uses them.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from meshtrain.operator.policy import kueue_workload

Body = dict[str, Any]


class KueueCalls:
    """Workloads of queued jobs (get, create, patch status and queue, delete), priorities, flavors."""

    _custom: Any
    """``kubernetes_asyncio``'s CustomObjectsApi of the client."""

    async def _request(
        self,
        verb: str,
        resource: str,
        call: Callable[..., Awaitable[Any]],
        *args: Any,
        ok: Iterable[int] = (),
        **kwargs: Any,
    ) -> Body | None:
        raise NotImplementedError  # kube.Client's

    async def get_workload(self, *, namespace: str, name: str) -> Body | None:
        """The Workload, or None when it does not exist."""
        return await self._request(
            "get",
            "workloads",
            self._custom.get_namespaced_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            namespace,
            kueue_workload.PLURAL,
            name,
            ok=(404,),
        )

    async def create_workload(self, *, manifest: Body) -> Body | None:
        """Create a Workload; None when one of that name exists already."""
        return await self._request(
            "create",
            "workloads",
            self._custom.create_namespaced_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            manifest["metadata"]["namespace"],
            kueue_workload.PLURAL,
            manifest,
            ok=(409,),
        )

    async def patch_workload_status(
        self, *, namespace: str, name: str, patch: Body, resource_version: str
    ) -> Body | None:
        """Merge ``patch`` into a Workload's status, only if it is still at ``resource_version``."""
        return await self._request(
            "patch",
            "workloads/status",
            self._custom.patch_namespaced_custom_object_status,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            namespace,
            kueue_workload.PLURAL,
            name,
            {**patch, "metadata": {"resourceVersion": resource_version}},
            ok=(404,),
            _content_type="application/merge-patch+json",
        )

    async def patch_workload_queue(
        self, *, namespace: str, name: str, queue: str, resource_version: str
    ) -> Body | None:
        """Point a Workload at another LocalQueue, only if it is still at ``resource_version``."""
        return await self._request(
            "patch",
            "workloads",
            self._custom.patch_namespaced_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            namespace,
            kueue_workload.PLURAL,
            name,
            {"metadata": {"resourceVersion": resource_version}, "spec": {"queueName": queue}},
            ok=(404,),
            _content_type="application/merge-patch+json",
        )

    async def delete_workload(self, *, namespace: str, name: str, uid: str) -> None:
        """Delete a Workload if it is still the object ``uid`` (a precondition)."""
        await self._request(
            "delete",
            "workloads",
            self._custom.delete_namespaced_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            namespace,
            kueue_workload.PLURAL,
            name,
            body={"preconditions": {"uid": uid}},
            ok=(404, 409),
        )

    async def workload_priority(self, *, name: str) -> int | None:
        """The value of a Kueue WorkloadPriorityClass, or None when there is none of that name."""
        found = await self._request(
            "get",
            "workloadpriorityclasses",
            self._custom.get_cluster_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            "workloadpriorityclasses",
            name,
            ok=(404,),
        )
        return None if found is None else int(found.get("value") or 0)

    async def pod_priority(self, *, name: str) -> int | None:
        """The value of a PriorityClass (scheduling.k8s.io), or None when there is none of that name."""
        found = await self._request(
            "get",
            "priorityclasses",
            self._custom.get_cluster_custom_object,
            kueue_workload.POD_PRIORITY_GROUP,
            "v1",
            "priorityclasses",
            name,
            ok=(404,),
        )
        return None if found is None else int(found.get("value") or 0)

    async def list_priority_classes(self) -> list[Body]:
        """Every PriorityClass (few per cluster): the global default is among them."""
        found = await self._request(
            "list",
            "priorityclasses",
            self._custom.list_cluster_custom_object,
            kueue_workload.POD_PRIORITY_GROUP,
            "v1",
            "priorityclasses",
        )
        return list((found or {}).get("items") or [])

    async def resource_flavor(self, *, name: str) -> Body | None:
        """A Kueue ResourceFlavor, or None when there is none of that name."""
        return await self._request(
            "get",
            "resourceflavors",
            self._custom.get_cluster_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            "resourceflavors",
            name,
            ok=(404,),
        )

    async def kueue_object(
        self, *, plural: str, name: str, namespace: str | None = None
    ) -> Body | None:
        """A Kueue LocalQueue (namespaced), ClusterQueue or Topology, or None when it does not exist."""
        if namespace is not None:
            return await self._request(
                "get",
                plural,
                self._custom.get_namespaced_custom_object,
                kueue_workload.GROUP,
                kueue_workload.VERSION,
                namespace,
                plural,
                name,
                ok=(404,),
            )
        return await self._request(
            "get",
            plural,
            self._custom.get_cluster_custom_object,
            kueue_workload.GROUP,
            kueue_workload.VERSION,
            plural,
            name,
            ok=(404,),
        )
