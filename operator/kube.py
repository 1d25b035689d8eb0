"""The operator's Kubernetes API client: the only module that sends API requests.

What it is: a small asyncio client over aiohttp with one keyword-only method
per API call the operator makes (so ``docs/operator.md`` can list the exact
RBAC verbs), each returning plain dict bodies.  Credentials come from a
kubeconfig or the in-cluster service account, read with the ``kubernetes``
package's loaders.  ``AlreadyExists`` on create and ``NotFound`` on delete are
answers, not errors: every write is idempotent.

What it is not: no caching, no retries beyond the caller's reconcile loop, no
watches (kopf owns those), and no decisions.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import AsyncIterator, Iterable
from typing import Any

import aiohttp
import kubernetes

from meshtrain.operator import metrics, naming

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
WATCH_SECONDS = 300
"""Server-side timeout of one watch request; the watcher then resumes from the last version."""
CONCURRENCY = 32
"""Requests in flight at once for one batch (pods of a gang)."""


def load_configuration(*, kubeconfig: str | None = None) -> kubernetes.client.Configuration:
    """Connection settings from ``kubeconfig`` (else $KUBECONFIG, ~/.kube/config, then in-cluster)."""
    config = kubernetes.client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG") or os.path.expanduser("~/.kube/config")
    if kubeconfig or os.path.exists(path):
        kubernetes.config.load_kube_config(config_file=path, client_configuration=config)
    else:
        kubernetes.config.load_incluster_config(client_configuration=config)
    return config


def bearer_token(config: kubernetes.client.Configuration) -> str | None:
    """The bearer token of a configuration, without its ``Bearer`` prefix."""
    token = config.api_key.get("authorization") or config.api_key.get("BearerToken")
    return token.removeprefix("Bearer ").strip() if token else None


class ApiError(RuntimeError):
    """A non-2xx answer of the API server."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path} -> {status}: {body[:500]}")
        self.status = status


class Client:
    """Async API client; create one per process with :meth:`connect`, close with :meth:`close`."""

    def __init__(
        self, *, host: str, session: aiohttp.ClientSession, headers: dict[str, str]
    ) -> None:
        self._host = host.rstrip("/")
        self._session = session
        self._headers = headers
        self._limit = asyncio.Semaphore(CONCURRENCY)

    @classmethod
    async def connect(cls, *, kubeconfig: str | None = None) -> Client:
        """Credentials from ``kubeconfig`` (or $KUBECONFIG / ~/.kube/config), else in-cluster."""
        config = load_configuration(kubeconfig=kubeconfig)
        context = (
            ssl.create_default_context(cafile=config.ssl_ca_cert) if config.verify_ssl else False
        )
        if context and config.cert_file:
            context.load_cert_chain(config.cert_file, config.key_file)
        headers = {"Accept": "application/json"}
        token = bearer_token(config)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        connector = aiohttp.TCPConnector(ssl=context, limit=CONCURRENCY * 2)
        session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=30)
        )
        return cls(host=config.host, session=session, headers=headers)

    async def close(self) -> None:
        await self._session.close()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        content_type: str = "application/json",
        ok_statuses: Iterable[int] = (),
    ) -> dict[str, Any] | None:
        headers = dict(self._headers)
        data = None
        if body is not None:
            headers["Content-Type"] = content_type
            data = json.dumps(body)
        try:
            async with (
                self._limit,
                self._session.request(
                    method, self._host + path, params=params, data=data, headers=headers
                ) as response,
            ):
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            metrics.api_error(method, path)
            raise
        if response.status in tuple(ok_statuses):
            return None
        if response.status >= 300:
            metrics.api_error(method, path)
            raise ApiError(response.status, method, path, text)
        return json.loads(text) if text else {}

    # TrainingJobs: get, patch (status), delete.
    @staticmethod
    def _job_path(namespace: str, name: str) -> str:
        return f"/apis/{naming.API_VERSION}/namespaces/{namespace}/trainingjobs/{name}"

    async def get_job(self, *, namespace: str, name: str) -> dict[str, Any] | None:
        """The TrainingJob, or None when it is gone."""
        return await self._call("GET", self._job_path(namespace, name), ok_statuses=(404,))

    async def patch_job_status(
        self, *, namespace: str, name: str, status: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Merge ``status`` into the status subresource; None when the job is gone."""
        return await self._call(
            "PATCH",
            self._job_path(namespace, name) + "/status",
            body={"status": status},
            content_type=MERGE_PATCH,
            ok_statuses=(404,),
        )

    async def delete_job(self, *, namespace: str, name: str) -> None:
        await self._call(
            "DELETE",
            self._job_path(namespace, name),
            body={"propagationPolicy": "Background"},
            ok_statuses=(404,),
        )

    # Pods: list, create, patch (gates), delete.
    async def list_pods(
        self, *, namespace: str | None, selector: str | None = None, live_only: bool = False
    ) -> list[dict[str, Any]]:
        """Pods of a namespace (or of every namespace), optionally by label; ``live_only`` drops finished pods."""
        path = f"/api/v1/namespaces/{namespace}/pods" if namespace else "/api/v1/pods"
        params: dict[str, str] = {}
        if selector:
            params["labelSelector"] = selector
        if live_only:
            params["fieldSelector"] = "status.phase!=Succeeded,status.phase!=Failed"
        answer = await self._call("GET", path, params=params)
        return list((answer or {}).get("items") or [])

    @staticmethod
    def _collection_path(manifest: dict[str, Any]) -> str:
        plural = {"Pod": "pods", "Service": "services", "ConfigMap": "configmaps"}[manifest["kind"]]
        return f"/api/v1/namespaces/{manifest['metadata']['namespace']}/{plural}"

    async def create(self, *, manifest: dict[str, Any]) -> dict[str, Any] | None:
        """Create a namespaced core/v1 object (Pod, Service, ConfigMap); None when it already exists."""
        return await self._call(
            "POST", self._collection_path(manifest), body=manifest, ok_statuses=(409,)
        )

    async def create_or_patch(self, *, manifest: dict[str, Any]) -> None:
        """Create a Service or ConfigMap, or merge ``manifest`` into the existing one (a rebuilt gang's new spec)."""
        if await self.create(manifest=manifest) is None:
            path = f"{self._collection_path(manifest)}/{manifest['metadata']['name']}"
            await self._call("PATCH", path, body=manifest, content_type=MERGE_PATCH)

    async def create_many(self, *, manifests: list[dict[str, Any]]) -> None:
        """Create objects concurrently (bounded); existing ones are left as they are."""
        await asyncio.gather(*(self.create(manifest=m) for m in manifests))

    async def lift_gates(self, *, namespace: str, names: Iterable[str]) -> None:
        """Remove the gang gate, and only it, from these pods (gone pods are skipped).

        A strategic merge patch deletes one entry of the list by its merge key
        (``name``), so another controller's gate (e.g. Kueue's) stays.
        """
        patch = {"spec": {"schedulingGates": [{"name": naming.GANG_GATE, "$patch": "delete"}]}}
        await asyncio.gather(
            *(
                self._call(
                    "PATCH",
                    f"/api/v1/namespaces/{namespace}/pods/{name}",
                    body=patch,
                    content_type=STRATEGIC_MERGE_PATCH,
                    ok_statuses=(404,),
                )
                for name in names
            )
        )

    async def delete_pods(
        self, *, namespace: str, names: Iterable[str], grace_seconds: int | None = None
    ) -> None:
        """Delete pods (gone ones are fine); ``grace_seconds`` overrides their terminationGracePeriodSeconds."""
        body = {"gracePeriodSeconds": grace_seconds} if grace_seconds is not None else None
        await asyncio.gather(
            *(
                self._call(
                    "DELETE",
                    f"/api/v1/namespaces/{namespace}/pods/{name}",
                    body=body,
                    ok_statuses=(404,),
                )
                for name in names
            )
        )

    # Services and ConfigMaps: delete (create is ``create_or_patch``).
    async def delete_service(self, *, namespace: str, name: str) -> None:
        await self._call(
            "DELETE", f"/api/v1/namespaces/{namespace}/services/{name}", ok_statuses=(404,)
        )

    async def delete_configmap(self, *, namespace: str, name: str) -> None:
        await self._call(
            "DELETE", f"/api/v1/namespaces/{namespace}/configmaps/{name}", ok_statuses=(404,)
        )

    # Nodes: list.
    async def list_nodes(self) -> list[dict[str, Any]]:
        answer = await self._call("GET", "/api/v1/nodes")
        return list((answer or {}).get("items") or [])

    # Pods and nodes: watch (lightweight wake-up streams; kopf watches only TrainingJobs).
    async def watch(
        self, *, path: str, selector: str | None = None, resource_version: str | None = None
    ) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        """Yield (type, object) of a watch on ``path`` (``/api/v1/pods``, ``/api/v1/nodes``, ...).

        Without ``resource_version`` the server first replays every existing object as
        ADDED.  Ends when the server closes the stream (after ``WATCH_SECONDS``); an
        ``ERROR`` event (e.g. 410 Gone: the version is too old) raises :class:`ApiError`.
        """
        params = {
            "watch": "true",
            "allowWatchBookmarks": "true",
            "timeoutSeconds": str(WATCH_SECONDS),
        }
        if selector:
            params["labelSelector"] = selector
        if resource_version:
            params["resourceVersion"] = resource_version
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=WATCH_SECONDS + 30)
        async with self._session.get(
            self._host + path, params=params, headers=self._headers, timeout=timeout
        ) as response:
            if response.status >= 300:
                metrics.api_error("WATCH", path)
                raise ApiError(response.status, "WATCH", path, await response.text())
            async for line in response.content:
                if not line.strip():
                    continue
                event = json.loads(line)
                if event.get("type") == "ERROR":
                    status = event.get("object") or {}
                    raise ApiError(
                        int(status.get("code") or 500), "WATCH", path, str(status.get("message"))
                    )
                yield event.get("type", ""), event.get("object") or {}

    # Events: create.
    async def create_event(
        self, *, job: dict[str, Any], type_: str, reason: str, message: str, now: str
    ) -> None:
        """A core/v1 Event about ``job`` (best effort: the caller ignores failures)."""
        metadata = job.get("metadata") or {}
        namespace = metadata.get("namespace")
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{metadata.get('name')}.", "namespace": namespace},
            "involvedObject": {
                "apiVersion": naming.API_VERSION,
                "kind": "TrainingJob",
                "name": metadata.get("name"),
                "namespace": namespace,
                "uid": metadata.get("uid"),
                "resourceVersion": metadata.get("resourceVersion"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": naming.MANAGED_BY},
            "firstTimestamp": now,
            "lastTimestamp": now,
            "count": 1,
        }
        await self._call("POST", f"/api/v1/namespaces/{namespace}/events", body=event)

    # Trainer progress: plain HTTP to the rank-0 pod.
    async def get_progress(self, *, ip: str, port: int, timeout: float = 2.0) -> dict[str, Any]:
        """GET http://ip:port/progress of the trainer's exporter (not the API server)."""
        url = f"http://{ip}:{port}/progress"
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as response,
        ):
            response.raise_for_status()
            return dict(await response.json(content_type=None))
