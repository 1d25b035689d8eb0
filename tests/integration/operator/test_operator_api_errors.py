"""Reconcile passes failing on API server errors back off exponentially and say so on the job.

The 5xx is real: a validating webhook that cannot be reached, with failurePolicy
Fail, makes the API server answer every pod create of the test's namespace with 500.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import kubernetes
import pytest

from meshtrain.operator.policy import conditions
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

BROKEN = "meshtrain.test/broken-webhook"


@pytest.fixture
def broken_pod_creates(cluster, namespace) -> Iterator[str]:
    """Pod creates in ``namespace`` (and only there) answered 500 until the fixture ends."""
    cluster.core.patch_namespace(namespace, {"metadata": {"labels": {BROKEN: namespace}}})
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster.core.api_client)
    name = f"broken-{namespace}"
    admission.create_validating_webhook_configuration(
        {
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "broken.meshtrain.test",
                    "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                    "rules": [
                        {
                            "operations": ["CREATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["pods"],
                        }
                    ],
                    "namespaceSelector": {"matchLabels": {BROKEN: namespace}},
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 1,
                }
            ],
        }
    )
    try:
        yield name
    finally:
        try:
            admission.delete_validating_webhook_configuration(name)
        except kubernetes.client.ApiException as err:
            if err.status != 404:
                raise


def test_api_server_errors_back_off_and_are_reported(
    cluster, operator, namespace, pool, broken_pod_creates
):
    cluster.add_node(pool, gpus=1)
    started = time.monotonic()
    cluster.apply(JobBuilder("broken", namespace, pool))
    reported = wait_for(
        "ApiErrors=True",
        lambda: (
            (c := cluster.condition(namespace, "broken", conditions.API_ERRORS)).get("status")
            == "True"
            and c
        ),
        timeout=40,
    )
    elapsed = time.monotonic() - started
    assert reported["reason"] == conditions.RECONCILE_FAILING
    assert "500" in reported["message"] and "webhook" in reported["message"]
    # three failed passes, 2 s then 4 s apart (a fixed 2 s retry reports after about 4 s)
    assert elapsed >= 6, elapsed
    failures = int(re.match(r"(\d+) reconcile passes", reported["message"]).group(1))
    assert failures <= 3 + 1, reported["message"]
    wait_for(
        "ReconcileFailing Event",
        lambda: [
            e
            for e in cluster.core.list_namespaced_event(namespace).items
            if e.reason == conditions.RECONCILE_FAILING
        ],
    )
    admission = kubernetes.client.AdmissionregistrationV1Api(cluster.core.api_client)
    admission.delete_validating_webhook_configuration(broken_pod_creates)
    cluster.wait_gang(namespace, "broken", 1, timeout=40)  # the next try, at most 16 s later
    recovered = wait_for(
        "ApiErrors=False",
        lambda: (
            (c := cluster.condition(namespace, "broken", conditions.API_ERRORS)).get("status")
            == "False"
            and c
        ),
    )
    assert recovered["reason"] == conditions.RECONCILE_RECOVERED
