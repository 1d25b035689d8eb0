"""Fixtures of the operator's integration tests (real API server, operator subprocess).

- ``cluster``: typed helpers over the session control plane, with the TrainingJob
  and kopf peering CRDs installed and the ``meshtrain`` ClusterKopfPeering created.
- ``operator``: one ``meshtrain operator`` subprocess for the session (short timers);
  tests that kill it start it again before they end.
- ``pool``: a per-test node-pool name; nodes a test adds carry it as a label and its
  jobs select it, so tests never see each other's capacity. Nodes are deleted after.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from tests.integration.operator import cluster as helpers


@pytest.fixture(scope="session")
def cluster(control_plane, kube_api, control_plane_binaries) -> helpers.Cluster:
    found = helpers.Cluster(
        kube_api, str(control_plane.kubeconfig_path), str(control_plane_binaries.kubectl)
    )
    found.install_crds()
    return found


@pytest.fixture(scope="session")
def operator(cluster, control_plane, tmp_path_factory) -> Iterator[helpers.OperatorProcess]:
    log = tmp_path_factory.mktemp("operator") / "operator.log"
    process = helpers.OperatorProcess(str(control_plane.kubeconfig_path), str(log))
    process.start()
    yield process
    process.stop()


@pytest.fixture
def pool(cluster) -> Iterator[str]:
    name = f"p{uuid.uuid4().hex[:6]}"
    yield name
    cluster.delete_nodes(name)
