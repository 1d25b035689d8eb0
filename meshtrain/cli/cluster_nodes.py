"""Reading the nodes of a live cluster for ``meshtrain plan --from-cluster``.

The planner's only Kubernetes I/O, with the official ``kubernetes`` client.  Each Node becomes a
placement :class:`~meshtrain.placement.Node` through the converter the operator uses too
(:func:`meshtrain.placement.node_from_manifest`), so both see the same allocatable GPUs and labels.
"""

from __future__ import annotations

from typing import Any

import kubernetes

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.cli import cluster_objects
from meshtrain.operator.cluster.kubeconfig import kubeconfig_paths


class ClusterUnavailable(RuntimeError):
    """The cluster could not be reached or listed."""


def list_nodes(
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
    gpu_resource: str = "nvidia.com/gpu",
    job: api_spec.TrainingJobSpec | None = None,
) -> list[placement.Node]:
    """Every node of the cluster as the placement planner sees it.

    The kubeconfig is found as the operator finds it (:mod:`meshtrain.operator.cluster.kubeconfig`),
    else the in-cluster service account is used.  GPUs already used by running pods are not
    subtracted: the plan answers "where would this job go on an empty cluster of this shape".
    With ``job``, the ResourceSlices and DeviceClasses are read too (where resource.k8s.io/v1 is
    served) and a node's devices counted for it as ``plan --cluster`` counts them
    (:func:`cluster_objects.nodes_of`).
    """
    config_file = kubeconfig_paths(kubeconfig)
    try:
        if config_file is not None:
            api = kubernetes.config.new_client_from_config(config_file=config_file, context=context)
        else:  # running in a pod: the service account
            configuration = kubernetes.client.Configuration()
            kubernetes.config.load_incluster_config(client_configuration=configuration)
            api = kubernetes.client.ApiClient(configuration)
        with api:
            listed = kubernetes.client.CoreV1Api(api).list_node()
            manifests = [api.sanitize_for_serialization(item) for item in listed.items]
            found = _devices(api) if job is not None else []
    except Exception as err:  # noqa: BLE001 - any client failure becomes one clear message
        raise ClusterUnavailable(
            f"cannot list nodes of the cluster ({config_file or 'in-cluster'}): {err}"
        ) from None
    if job is not None and any(obj["kind"] == "ResourceSlice" for obj in found):
        nodes = [{**m, "kind": "Node"} for m in manifests]
        return cluster_objects.nodes_of([*nodes, *found], job, config_file or "in-cluster")
    return [placement.node_from_manifest(manifest, gpu_resource) for manifest in manifests]


def _devices(api: kubernetes.client.ApiClient) -> list[dict[str, Any]]:
    """The cluster's ResourceSlices and DeviceClasses (none where DRA is not served)."""
    resource = kubernetes.client.ResourceV1Api(api)
    try:
        slices = resource.list_resource_slice().items
        classes = resource.list_device_class().items
    except kubernetes.client.ApiException as err:
        if err.status == 404:
            return []
        raise
    return [
        {**api.sanitize_for_serialization(item), "kind": kind}
        for kind, items in (("ResourceSlice", slices), ("DeviceClass", classes))
        for item in items
    ]
