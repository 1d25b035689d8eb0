"""Fixtures for tests that talk to a real kube-apiserver backed by a real etcd.

- ``control_plane``: one :class:`ControlPlane` (etcd + kube-apiserver) for the
  whole session; tests isolate themselves by namespace.
- ``control_plane_full``: a second, separate instance that also runs
  kube-scheduler and kube-controller-manager. It starts lazily, only when a
  test asks for it, so sessions that need just the API pay ~1 s less per run
  and keep the scheduler's and controllers' side effects out of other tests.
- ``kube_api`` / ``kube_api_full``: a ``kubernetes`` ApiClient with the admin
  kubeconfig of the matching instance.

Missing binaries FAIL the tests (never skip) with a message that says to run
``make bootstrap``.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import binaries

logger = logging.getLogger(__name__)


@pytest.fixture(scope="session")
def control_plane_binaries() -> binaries.Binaries:
    """The pinned binaries; fails the test with how to build them when missing."""
    try:
        return binaries.locate()
    except binaries.BinariesMissingError as error:
        message = str(error)
    pytest.fail(message, pytrace=False)


def _started(found: binaries.Binaries, **options: bool) -> Iterator[controlplane.ControlPlane]:
    with controlplane.ControlPlane(binaries=found, **options) as plane:
        logger.info("control plane started in %.2fs", plane.startup_seconds)
        yield plane


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries: binaries.Binaries) -> Iterator[controlplane.ControlPlane]:
    """etcd + kube-apiserver, admin kubeconfig at ``control_plane.kubeconfig_path``."""
    yield from _started(control_plane_binaries)


@pytest.fixture(scope="session")
def control_plane_full(
    control_plane_binaries: binaries.Binaries,
) -> Iterator[controlplane.ControlPlane]:
    """A separate instance that also runs kube-scheduler and kube-controller-manager."""
    yield from _started(control_plane_binaries, with_scheduler=True, with_controller_manager=True)


def _api_client(plane: controlplane.ControlPlane) -> Iterator[kubernetes.client.ApiClient]:
    client = kubernetes.config.new_client_from_config(config_file=str(plane.kubeconfig_path))
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(scope="session")
def kube_api(control_plane: controlplane.ControlPlane) -> Iterator[kubernetes.client.ApiClient]:
    """ApiClient authenticated as the admin of ``control_plane``."""
    yield from _api_client(control_plane)


@pytest.fixture(scope="session")
def kube_api_full(
    control_plane_full: controlplane.ControlPlane,
) -> Iterator[kubernetes.client.ApiClient]:
    """ApiClient authenticated as the admin of ``control_plane_full``."""
    yield from _api_client(control_plane_full)


@pytest.fixture
def namespace(kube_api: kubernetes.client.ApiClient) -> Iterator[str]:
    """A fresh namespace on ``control_plane``, deleted after the test."""
    name = f"t-{uuid.uuid4().hex[:8]}"
    core = kubernetes.client.CoreV1Api(kube_api)
    core.create_namespace(
        kubernetes.client.V1Namespace(metadata=kubernetes.client.V1ObjectMeta(name=name))
    )
    yield name
    core.delete_namespace(name)
