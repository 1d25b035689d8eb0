"""Pod Security on the real API server: a job's pods pass the restricted standard as enforced by admission."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.builders import JobBuilder

pytestmark = pytest.mark.integration


@pytest.fixture
def restricted(cluster) -> Iterator[str]:
    """A namespace whose PodSecurity admission enforces the restricted standard."""
    name = f"r-{uuid.uuid4().hex[:8]}"
    labels = {
        "pod-security.kubernetes.io/enforce": "restricted",
        "pod-security.kubernetes.io/enforce-version": "latest",
    }
    cluster.core.create_namespace({"metadata": {"name": name, "labels": labels}})
    yield name
    cluster.core.delete_namespace(name)


def test_pods_of_a_job_are_admitted_in_a_restricted_namespace(cluster, operator, restricted, pool):
    for _ in range(2):
        cluster.add_node(pool, gpus=2)
    cluster.apply(JobBuilder("locked", restricted, pool).layout(data=4).gpus(2))
    pods = cluster.wait_gang(restricted, "locked", 2)
    for pod in pods:
        assert pod.spec.automount_service_account_token is False
        assert pod.spec.security_context.run_as_non_root is True
        container = pod.spec.containers[0].security_context
        assert container.read_only_root_filesystem is True
        assert container.capabilities.drop == ["ALL"] and not container.capabilities.add
