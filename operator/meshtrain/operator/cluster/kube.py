"""The operator's Kubernetes API client: every API request the operator sends goes through here.

One keyword-only coroutine per API call on ``kubernetes_asyncio`` (why: docs/architecture.md),
so docs/operator.md can list the RBAC verbs.  Bodies stay the server's JSON as plain dicts
(``_preload_content=False``): generated model classes would cost seconds and hundreds of MB
on 100,000 pods.  Every write is idempotent: ``AlreadyExists`` on create and ``NotFound`` on
delete are answers, not errors.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from typing import Any, TypeAlias

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from meshtrain.operator.cluster import api_errors, clock, dra_calls, metrics
from meshtrain.operator.cluster import kubeconfig as clientconfig
from meshtrain.operator.cluster.api_errors import (
    ApiError,
    Conflict,
    NotLeading,
    error_message,
    transport_error,
)
from meshtrain.operator.cluster.device_reads import DeviceReads
from meshtrain.operator.cluster.kueue_calls import KueueCalls
from meshtrain.operator.policy import naming

__all__ = ["ApiError", "Body", "Client", "Conflict", "NotLeading", "connection"]

Body: TypeAlias = dict[str, Any]
"""An API object as the server sends it (camelCase JSON)."""

WATCH_SECONDS = 300
"""Server-side timeout of one watch request; the caller then resumes from the last version."""
CONCURRENCY = 32
"""Requests in flight at once for one batch (pods of a gang)."""
PAGE_SIZE = 500
"""Objects per page of a list (``limit``/``continue``)."""
REQUEST_SECONDS = 30
"""Client-side timeout of one non-watch request."""
GROUP, VERSION = naming.GROUP, naming.API_VERSION.split("/")[1]
PLURAL = "trainingjobs"


POD_GROUP_API = ("scheduling.k8s.io", "v1alpha2")
POD_GROUP_PLURAL = "podgroups"


def _group_version(api_version: str | None) -> tuple[str, str]:
    """A PodGroup's (group, version): the native one's, or the ``apiVersion`` of the gang backend's."""
    if not api_version or "/" not in api_version:
        return POD_GROUP_API
    group, version = api_version.split("/", 1)
    return group, version


async def _send(
    call: Callable[..., Awaitable[Any]],
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    timeout: float,
) -> tuple[int, str, str | None]:
    """Status, body and ``Retry-After`` header of one request."""
    response = await call(*args, _preload_content=False, _request_timeout=timeout, **kwargs)
    return response.status, await response.text(), response.headers.get("Retry-After")


async def _configuration(kubeconfig: str | None) -> tuple[k8s.Configuration, Any]:
    """Settings from a kubeconfig (:func:`clientconfig.kubeconfig_paths`) or in-cluster, and the loader."""
    configuration = k8s.Configuration()
    paths = clientconfig.kubeconfig_paths(kubeconfig)
    if paths is not None:
        loader = await k8s_config.load_kube_config(
            config_file=paths, client_configuration=configuration, persist_config=False
        )
        return configuration, loader
    k8s_config.load_incluster_config(client_configuration=configuration)
    return configuration, None


async def connection(kubeconfig: str | None = None) -> dict[str, Any]:
    """Server, CA, client certificate and current bearer token: what kopf's login needs."""
    configuration, _ = await _configuration(kubeconfig)
    token = await configuration.get_api_key_with_prefix("BearerToken")
    return {
        "server": configuration.host,
        "ca_path": configuration.ssl_ca_cert,
        "insecure": not configuration.verify_ssl,
        "token": token.removeprefix("Bearer ").strip() if token else None,
        "certificate_path": configuration.cert_file,
        "private_key_path": configuration.key_file,
    }


class Client(KueueCalls, dra_calls.DraCalls, DeviceReads):
    """Async API client; one per process (:meth:`connect`), closed with :meth:`close`."""

    def __init__(self, *, api: k8s.ApiClient, refresher: asyncio.Task[None] | None) -> None:
        self._api = api
        self.api_client = api
        """The library's client, for its own protocols (leader election's Lease)."""
        self._core = k8s.CoreV1Api(api)
        self._custom = k8s.CustomObjectsApi(api)
        self._networking = k8s.NetworkingV1Api(api)
        self._resource = k8s.ResourceV1Api(api)
        self._refresher = refresher
        self._limit = asyncio.Semaphore(CONCURRENCY)
        self.on_write: Callable[[str, Body], None] | None = None
        """Called with (verb, object) of every write's answer: the informer cache learns its own writes."""
        self.lease_left: Callable[[], float] = lambda: math.inf
        """Seconds this replica may still act, asked right before every write is sent (leader
        election sets it).  None left raises :class:`NotLeading`, so a pass under way when the
        Lease is lost writes nothing more; a write's timeout is the time left, so one that could
        land after another replica took over is abandoned instead (:class:`NotLeading` too)."""

    @classmethod
    async def connect(cls, *, kubeconfig: str | None = None) -> Client:
        configuration, loader = await _configuration(kubeconfig)
        configuration.connection_pool_maxsize = CONCURRENCY * 2
        refresher = None
        if loader is not None:  # exec and auth-provider tokens expire: re-run them periodically
            refresher = asyncio.create_task(
                k8s_config.refresh_token(loader, client_configuration=configuration)
            )
        return cls(api=k8s.ApiClient(configuration), refresher=refresher)

    async def close(self) -> None:
        if self._refresher is not None:
            self._refresher.cancel()
        await self._api.close()

    async def _request(
        self,
        verb: str,
        resource: str,
        call: Callable[..., Awaitable[Any]],
        *args: Any,
        ok: Iterable[int] = (),
        **kwargs: Any,
    ) -> Body | None:
        """Send one request; the JSON answer, None for a status in ``ok``; ApiError otherwise.

        Every call passes through here, the one place that counts requests by verb.
        """
        write = verb not in ("get", "list")
        async with self._limit:
            timeout = min(self.lease_left(), REQUEST_SECONDS) if write else REQUEST_SECONDS
            if timeout <= 0:
                raise NotLeading(f"{verb} {resource} not sent: this replica is not the leader")
            metrics.API_REQUESTS.labels(verb=verb, resource=resource).inc()
            try:
                # The whole exchange within the timeout: cancelled, the connection is closed and
                # the API server abandons the request (its context ends with the connection).
                status, text, wait = await asyncio.wait_for(
                    _send(call, args, kwargs, timeout), timeout
                )
            except k8s.ApiException as err:  # refused before sending (bad arguments)
                raise ApiError(err.status, verb, resource, str(err.reason)) from err
            except Exception as err:
                if transport_error(err):
                    if write and self.lease_left() <= 0:
                        raise NotLeading(
                            f"{verb} {resource} abandoned: the Lease ran out before the answer"
                        ) from err
                    metrics.api_error(verb)
                    raise ApiError(0, verb, resource, str(err)) from err
                raise
        if status >= 300:  # without preloading, the library leaves the status to the caller
            if status in tuple(ok):
                return None
            metrics.api_error(verb)
            error = Conflict if status == 409 and verb != "create" else ApiError
            after = api_errors.retry_after(wait, clock.now())
            raise error(status, verb, resource, error_message(text), after)
        answer = json.loads(text) if text else {}
        if verb != "get" and verb != "list" and self.on_write is not None:
            self.on_write(verb, answer)
        return answer

    async def _list(
        self,
        resource: str,
        call: Callable[..., Awaitable[Any]],
        *args: Any,
        keep: Callable[[Body], Body] | None = None,
        **kwargs: Any,
    ) -> tuple[list[Body], str]:
        """Every item of a paginated list, and the list's resourceVersion (to watch from).

        ``keep`` is applied to each item as its page arrives, so a caller that keeps
        less than the whole object never holds every whole object at once.
        """
        items: list[Body] = []
        token: str | None = None
        while True:
            page = await self._request(
                "list", resource, call, *args, limit=PAGE_SIZE, _continue=token, **kwargs
            )
            assert page is not None
            found = page.get("items") or []
            items.extend(map(keep, found) if keep is not None else found)
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                return items, str(metadata.get("resourceVersion") or "")

    # TrainingJobs: get, list, watch, update status, label, delete.
    async def list_jobs(
        self, *, namespace: str | None, keep: Callable[[Body], Body] | None = None
    ) -> tuple[list[Body], str]:
        """TrainingJobs of a namespace (None: of every namespace), and the list's version."""
        call, args = self._jobs_call(namespace)
        return await self._list("trainingjobs", call, *args, keep=keep)

    async def watch_jobs(
        self, *, namespace: str | None, resource_version: str
    ) -> AsyncIterator[tuple[str, Body]]:
        """(type, job) events from ``resource_version`` on (see :meth:`_watch`)."""
        call, args = self._jobs_call(namespace)
        async for event in self._watch(
            "trainingjobs", call, *args, resource_version=resource_version
        ):
            yield event

    def _jobs_call(
        self, namespace: str | None
    ) -> tuple[Callable[..., Awaitable[Any]], tuple[str, ...]]:
        """The list call of TrainingJobs in ``namespace`` (None: all) and its arguments."""
        if namespace:
            return self._custom.list_namespaced_custom_object, (GROUP, VERSION, namespace, PLURAL)
        return self._custom.list_cluster_custom_object, (GROUP, VERSION, PLURAL)

    async def get_job(self, *, namespace: str, name: str) -> Body | None:
        """The TrainingJob, or None when it is gone."""
        return await self._request(
            "get",
            "trainingjobs",
            self._custom.get_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            ok=(404,),
        )

    async def patch_job_status(
        self, *, namespace: str, name: str, status: Body, resource_version: str | None = None
    ) -> Body | None:
        """Merge ``status`` into the status subresource; None when the job is gone.

        With ``resource_version`` the write applies only to that version of the job
        (:class:`Conflict` otherwise): a read-modify-write that cannot lose an update.
        """
        patch: Body = {"status": status}
        if resource_version:
            patch["metadata"] = {"resourceVersion": resource_version}
        call = self._custom.patch_namespaced_custom_object_status
        return await self._merge_job("trainingjobs/status", call, namespace, name, patch)

    async def patch_job_metadata(self, *, namespace: str, name: str, patch: Body) -> Body | None:
        """Merge ``patch`` (labels, guarded by its ``metadata.resourceVersion``) into the job.

        None when the job is gone; :class:`Conflict` when it changed since it was read.
        """
        call = self._custom.patch_namespaced_custom_object
        return await self._merge_job("trainingjobs", call, namespace, name, patch)

    async def _merge_job(
        self,
        resource: str,
        call: Callable[..., Awaitable[Any]],
        namespace: str,
        name: str,
        patch: Body,
    ) -> Body | None:
        """A JSON merge patch of the job (or its status); None when it is gone."""
        return await self._request(
            "patch",
            resource,
            call,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            patch,
            ok=(404,),
            _content_type="application/merge-patch+json",
        )

    async def delete_job(self, *, namespace: str, name: str) -> None:
        await self._request(
            "delete",
            "trainingjobs",
            self._custom.delete_namespaced_custom_object,
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            propagation_policy="Background",
            ok=(404,),
        )

    # Pods: list, watch, create, patch (gates), delete.
    async def list_pods(
        self,
        *,
        namespace: str | None = None,
        selector: str | None = None,
        keep: Callable[[Body], Body] | None = None,
    ) -> tuple[list[Body], str]:
        """Pods of a namespace (or of every namespace), optionally by label, and the list's version."""
        if namespace:
            return await self._list(
                "pods",
                self._core.list_namespaced_pod,
                namespace,
                label_selector=selector,
                keep=keep,
            )
        return await self._list(
            "pods", self._core.list_pod_for_all_namespaces, label_selector=selector, keep=keep
        )

    async def watch_pods(
        self, *, namespace: str | None, resource_version: str
    ) -> AsyncIterator[tuple[str, Body]]:
        """(type, pod) events from ``resource_version`` on (see :meth:`_watch`)."""
        if namespace:
            call: Callable[..., Awaitable[Any]] = self._core.list_namespaced_pod
            args: tuple[Any, ...] = (namespace,)
        else:
            call, args = self._core.list_pod_for_all_namespaces, ()
        async for event in self._watch("pods", call, *args, resource_version=resource_version):
            yield event

    def _collection(self, manifest: Body) -> tuple[str, Callable[..., Awaitable[Any]]]:
        kind = manifest["kind"]
        if kind == "Pod":
            return "pods", self._core.create_namespaced_pod
        if kind == "Service":
            return "services", self._core.create_namespaced_service
        if kind == "ConfigMap":
            return "configmaps", self._core.create_namespaced_config_map
        if kind == "PodGroup":
            return "podgroups", self._create_pod_group
        if kind == "NetworkPolicy":
            return "networkpolicies", self._networking.create_namespaced_network_policy
        raise ValueError(f"no create call for kind {kind}")

    # PodGroups of the gang backend: the native gang API (scheduling.k8s.io/v1alpha2) where it is
    # served, scheduler-plugins' (scheduling.x-k8s.io/v1alpha1); each by its ``apiVersion``.
    async def _create_pod_group(self, namespace: str, body: Body, **kwargs: Any) -> Any:
        return await self._custom.create_namespaced_custom_object(
            *_group_version(body.get("apiVersion")), namespace, POD_GROUP_PLURAL, body, **kwargs
        )

    async def _read_pod_group(
        self, name: str, namespace: str, api_version: str | None = None, **kwargs: Any
    ) -> Any:
        return await self._custom.get_namespaced_custom_object(
            *_group_version(api_version), namespace, POD_GROUP_PLURAL, name, **kwargs
        )

    async def server_version(self) -> Body:
        """The API server's ``/version`` document (``major``, ``minor``, ``gitVersion``, ...)."""
        found = await self._request("get", "version", k8s.VersionApi(self._api).get_code)
        return found or {}

    async def serves_pod_groups(self) -> bool:
        """Whether the API server serves PodGroups (the GenericWorkload feature gate is on)."""
        found = await self._request(
            "get",
            "discovery",
            self._custom.get_api_resources,
            *POD_GROUP_API,
            ok=(404, 503),
        )
        return any(r.get("name") == POD_GROUP_PLURAL for r in (found or {}).get("resources") or [])

    async def create(self, *, manifest: Body) -> Body | None:
        """Create a job's child (Pod, Service, ConfigMap, PodGroup, NetworkPolicy, DRA claim
        object); None when it already exists."""
        if manifest["kind"] in dra_calls.APIS:
            return await self.create_claim_object(manifest=manifest)
        resource, call = self._collection(manifest)
        return await self._request(
            "create", resource, call, manifest["metadata"]["namespace"], manifest, ok=(409,)
        )

    async def lift_gates(self, *, namespace: str, uids: Mapping[str, str]) -> list[str]:
        """Remove the gang gate, and only it, from these pods (name -> UID); the names lifted.

        A strategic merge patch deletes one entry of the list by its merge key
        (``name``), so another controller's gate (e.g. Kueue's) stays.  The patch
        carries the pod's UID: the API server refuses it (422, ``metadata.uid`` is
        immutable) when the name now belongs to another pod (a namesake job's,
        another tenant's), which is then left as it is, like a pod that is gone.
        """

        async def lift(name: str, uid: str) -> str | None:
            patch = {
                "metadata": {"uid": uid},
                "spec": {"schedulingGates": [{"name": naming.GANG_GATE, "$patch": "delete"}]},
            }
            try:
                answer = await self._request(
                    "patch",
                    "pods",
                    self._core.patch_namespaced_pod,
                    name,
                    namespace,
                    patch,
                    ok=(404,),
                    _content_type="application/strategic-merge-patch+json",
                )
            except ApiError as err:
                if err.status == 422 and "metadata.uid" in err.body:
                    return None  # another pod of that name: not ours to release
                raise
            return None if answer is None else name

        lifted = await asyncio.gather(*(lift(name, uid) for name, uid in uids.items()))
        return [name for name in lifted if name is not None]

    async def delete_pods(
        self,
        *,
        namespace: str,
        names: Iterable[str],
        grace_seconds: int | None = None,
        uids: Mapping[str, str] | None = None,
    ) -> None:
        """Delete pods (gone ones are fine); ``grace_seconds`` overrides their terminationGracePeriodSeconds.

        With ``uids`` (name -> UID) each delete carries a UID precondition: a pod that
        took the name since (another job's, another tenant's) answers 409 and stays.
        Both go in the DeleteOptions body: with a body, the API server ignores the
        ``gracePeriodSeconds`` query parameter.
        """
        uids = uids or {}
        grace = {} if grace_seconds is None else {"gracePeriodSeconds": grace_seconds}
        await asyncio.gather(
            *(
                self._request(
                    "delete",
                    "pods",
                    self._core.delete_namespaced_pod,
                    name,
                    namespace,
                    ok=(404, 409) if name in uids else (404,),
                    body={
                        **grace,
                        **({"preconditions": {"uid": uids[name]}} if name in uids else {}),
                    },
                )
                for name in names
            )
        )

    # Pods, Services, ConfigMaps, NetworkPolicies: read one, patch one, delete (create is above).
    _READ = {
        "Pod": "pods",
        "Service": "services",
        "ConfigMap": "configmaps",
        "PodGroup": POD_GROUP_PLURAL,
        "NetworkPolicy": "networkpolicies",
    }

    async def read(
        self, *, kind: str, namespace: str, name: str, api_version: str | None = None
    ) -> Body | None:
        """A Pod, Service, ConfigMap, PodGroup (of ``api_version``; default the native one),
        NetworkPolicy or DRA claim object, or None when there is none of that name."""
        if kind in dra_calls.APIS:
            return await self.read_claim_object(kind=kind, namespace=namespace, name=name)
        calls: dict[str, Callable[..., Awaitable[Any]]] = {
            "Pod": self._core.read_namespaced_pod,
            "Service": self._core.read_namespaced_service,
            "ConfigMap": self._core.read_namespaced_config_map,
            "PodGroup": functools.partial(self._read_pod_group, api_version=api_version),
            "NetworkPolicy": self._networking.read_namespaced_network_policy,
        }
        return await self._request("get", self._READ[kind], calls[kind], name, namespace, ok=(404,))

    async def patch(self, *, manifest: Body, uid: str, resource_version: str) -> None:
        """Merge ``manifest`` into the Service, ConfigMap or NetworkPolicy of its name, only if it
        is still the object ``uid`` at ``resource_version`` (:class:`Conflict` otherwise: one
        deleted and created again meanwhile, perhaps by another tenant, is never patched)."""
        resource, _ = self._collection(manifest)
        call = {
            "services": self._core.patch_namespaced_service,
            "configmaps": self._core.patch_namespaced_config_map,
            "networkpolicies": self._networking.patch_namespaced_network_policy,
        }[resource]
        metadata = manifest["metadata"]
        guarded = {
            **manifest,
            "metadata": {**metadata, "uid": uid, "resourceVersion": resource_version},
        }
        await self._request(
            "patch",
            resource,
            call,
            metadata["name"],
            metadata["namespace"],
            guarded,
            _content_type="application/merge-patch+json",
        )

    async def delete(self, *, kind: str, namespace: str, name: str, uid: str) -> None:
        """Delete the Service, ConfigMap, NetworkPolicy or DRA claim object ``name`` if it is
        still the object ``uid`` (a precondition)."""
        if kind in dra_calls.APIS:
            return await self.delete_claim_object(
                kind=kind, namespace=namespace, name=name, uid=uid
            )
        calls = {
            "Service": self._core.delete_namespaced_service,
            "ConfigMap": self._core.delete_namespaced_config_map,
            "NetworkPolicy": self._networking.delete_namespaced_network_policy,
        }
        await self._request(
            "delete",
            self._READ[kind],
            calls[kind],
            name,
            namespace,
            body={"preconditions": {"uid": uid}},
            ok=(404, 409),
        )

    # Nodes: list, watch, get.
    async def get_node(self, *, name: str) -> Body | None:
        return await self._request("get", "nodes", self._core.read_node, name, ok=(404,))

    # Volume topology: a job's claim, its volume or class, local volumes.
    async def get_claim(self, *, namespace: str, name: str) -> Body | None:
        call = self._core.read_namespaced_persistent_volume_claim
        return await self._request(
            "get", "persistentvolumeclaims", call, name, namespace, ok=(404,)
        )

    async def get_volume(self, *, name: str) -> Body | None:
        call = self._core.read_persistent_volume
        return await self._request("get", "persistentvolumes", call, name, ok=(404,))

    async def list_volumes(self) -> list[Body]:
        return (await self._list("persistentvolumes", self._core.list_persistent_volume))[0]

    async def get_storage_class(self, *, name: str) -> Body | None:
        call = k8s.StorageV1Api(self._api).read_storage_class
        return await self._request("get", "storageclasses", call, name, ok=(404,))

    async def list_nodes(
        self, *, keep: Callable[[Body], Body] | None = None
    ) -> tuple[list[Body], str]:
        return await self._list("nodes", self._core.list_node, keep=keep)

    async def watch_nodes(self, *, resource_version: str) -> AsyncIterator[tuple[str, Body]]:
        async for event in self._watch(
            "nodes", self._core.list_node, resource_version=resource_version
        ):
            yield event

    async def _watch(
        self,
        resource: str,
        call: Callable[..., Awaitable[Any]],
        *args: Any,
        resource_version: str,
    ) -> AsyncIterator[tuple[str, Body]]:
        """Yield (type, object) of one watch request, BOOKMARKs included.

        Ends when the server closes the stream (after ``WATCH_SECONDS``); an ``ERROR``
        event (e.g. 410 Gone: the version is too old) raises :class:`ApiError`.
        The stream's lines are read here rather than through ``kubernetes_asyncio.watch``,
        which would build a generated model object for every event.
        """
        metrics.API_REQUESTS.labels(verb="watch", resource=resource).inc()
        try:
            response = await call(
                *args,
                watch=True,
                allow_watch_bookmarks=True,
                resource_version=resource_version,
                timeout_seconds=WATCH_SECONDS,
                _preload_content=False,
                _request_timeout=WATCH_SECONDS + 30,
            )
        except k8s.ApiException as err:
            raise ApiError(err.status, "watch", resource, str(err.reason)) from err
        except Exception as err:
            if transport_error(err):
                metrics.api_error("watch")
                raise ApiError(0, "watch", resource, str(err)) from err
            raise
        if response.status >= 300:
            metrics.api_error("watch")
            text = await response.text()
            after = api_errors.retry_after(response.headers.get("Retry-After"), clock.now())
            raise ApiError(response.status, "watch", resource, error_message(text), after)
        try:
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                obj = event.get("object") or {}
                if event.get("type") == "ERROR":
                    raise ApiError(
                        int(obj.get("code") or 500), "watch", resource, str(obj.get("message"))
                    )
                yield str(event.get("type", "")), obj
        except Exception as err:
            if transport_error(err):
                raise ApiError(0, "watch", resource, str(err)) from err
            raise
        finally:
            response.release()

    # Events: create.
    async def create_event(
        self, *, job: Body, type_: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event about ``job`` (best effort: the caller ignores failures)."""
        metadata = job.get("metadata") or {}
        involved = {
            "apiVersion": naming.API_VERSION,
            "kind": "TrainingJob",
            "name": metadata.get("name"),
            "namespace": metadata.get("namespace"),
            "uid": metadata.get("uid"),
            "resourceVersion": metadata.get("resourceVersion"),
        }
        await self._record(metadata.get("namespace"), involved, type_, reason, message, now)

    async def create_node_event(
        self, *, node: str, uid: str | None, type_: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event about a Node, in ``default`` where the kubelet records node Events."""
        involved = {"apiVersion": "v1", "kind": "Node", "name": node, "uid": uid}
        await self._record("default", involved, type_, reason, message, now)

    async def _record(
        self,
        namespace: str | None,
        involved: dict[str, Any],
        type_: str,
        reason: str,
        message: str,
        now: str,
    ) -> None:
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{involved['name']}.", "namespace": namespace},
            "involvedObject": involved,
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": naming.MANAGED_BY},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._request(
            "create", "events", self._core.create_namespaced_event, namespace, event
        )
