"""A job's ConfigMap re-created by another tenant between the operator's read and its patch is not patched.

Real API server; the other tenant's delete and create run right after the
operator's read returns, the moment the race needs.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import kubernetes
import pytest

from meshtrain.operator.cluster import children, kube

pytestmark = pytest.mark.integration


def _config_map(name: str, namespace: str, data: dict[str, str], owner: str | None) -> dict:
    metadata: dict[str, Any] = {"name": name, "namespace": namespace}
    if owner:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "name": "racy",
                "uid": owner,
                "controller": True,
            }
        ]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}


def test_a_config_map_recreated_by_a_tenant_after_the_read_is_not_patched(
    control_plane, kube_api, namespace
):
    core = kubernetes.client.CoreV1Api(kube_api)
    job = str(uuid.uuid4())
    name = "racy-spec"
    core.create_namespaced_config_map(namespace, _config_map(name, namespace, {"v": "1"}, job))
    tenant = _config_map(name, namespace, {"tenant": "theirs"}, None)

    async def ensure_while_the_tenant_replaces_it() -> None:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        read = client.read

        async def read_then_race(**kwargs: Any) -> Any:
            found = await read(**kwargs)
            core.delete_namespaced_config_map(name, namespace)
            core.create_namespaced_config_map(namespace, tenant)
            return found

        client.read = read_then_race  # type: ignore[method-assign]
        try:
            with pytest.raises(kube.Conflict):
                await children.ensure(
                    client, job, [_config_map(name, namespace, {"v": "2"}, job)], []
                )
            client.read = read
            refused = await children.ensure(
                client, job, [_config_map(name, namespace, {"v": "2"}, job)], []
            )
            assert refused is not None and refused.reason == "NameConflict"
        finally:
            await client.close()

    asyncio.run(ensure_while_the_tenant_replaces_it())
    after = core.read_namespaced_config_map(name, namespace)
    assert after.data == {"tenant": "theirs"}, "the operator patched another tenant's ConfigMap"
    assert not after.metadata.owner_references
