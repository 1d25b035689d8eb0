"""No write of the operator outlives its Lease: none is sent without time left, and one still
unanswered when the time runs out is abandoned and never lands.

The API server is made slow for real: a validating webhook (served here over TLS)
answers ConfigMap creates in the test's namespace only after :data:`WEBHOOK_SECONDS`.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import json
import math
import ssl
import threading
import time
from collections.abc import Iterator

import kubernetes
import pytest
from kubernetes_asyncio.leaderelection import electionconfig, leaderelection

from meshtrain.operator.cluster import kube, leadership
from meshtrain.sandbox.controlplane import pki
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

WEBHOOK_SECONDS = 3.0
LEASE_LEFT_SECONDS = 1.0
SLOW = "meshtrain.test/slow-webhook"


class _SlowWebhook(http.server.BaseHTTPRequestHandler):
    answered: dict[str, float]  # ConfigMap name -> time.monotonic() of the answer

    def do_POST(self) -> None:
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        request = review["request"]
        time.sleep(WEBHOOK_SECONDS)
        body = json.dumps(
            {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {"uid": request["uid"], "allowed": True},
            }
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except OSError:
            pass  # the API server gave up on the request
        type(self).answered[request["name"]] = time.monotonic()

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def slow_configmap_creates(kube_api, namespace, tmp_path) -> Iterator[dict[str, float]]:
    """ConfigMap creates in ``namespace`` wait WEBHOOK_SECONDS for a webhook; yields what it answered."""
    certs = pki.generate(tmp_path / "pki")
    handler = type("Handler", (_SlowWebhook,), {"answered": {}})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certs.serving.cert, certs.serving.key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    core = kubernetes.client.CoreV1Api(kube_api)
    core.patch_namespace(namespace, {"metadata": {"labels": {SLOW: namespace}}})
    admission = kubernetes.client.AdmissionregistrationV1Api(kube_api)
    name = f"slow-{namespace}"
    admission.create_validating_webhook_configuration(
        {
            "metadata": {"name": name},
            "webhooks": [
                {
                    "name": "slow.meshtrain.test",
                    "clientConfig": {
                        "url": f"https://127.0.0.1:{server.server_address[1]}/validate",
                        "caBundle": base64.b64encode(certs.ca.cert.read_bytes()).decode(),
                    },
                    "rules": [
                        {
                            "operations": ["CREATE"],
                            "apiGroups": [""],
                            "apiVersions": ["v1"],
                            "resources": ["configmaps"],
                        }
                    ],
                    "namespaceSelector": {"matchLabels": {SLOW: namespace}},
                    "failurePolicy": "Fail",
                    "sideEffects": "None",
                    "admissionReviewVersions": ["v1"],
                    "timeoutSeconds": 10,
                }
            ],
        }
    )
    try:
        yield handler.answered
    finally:
        admission.delete_validating_webhook_configuration(name)
        server.shutdown()
        server.server_close()


def _configmap(namespace: str, name: str) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": namespace},
    }


def test_a_write_is_bounded_by_the_time_left_on_the_lease(
    control_plane, kube_api, namespace, slow_configmap_creates
):
    answered = slow_configmap_creates

    async def scenario() -> tuple[BaseException | None, BaseException | None]:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        try:
            client.lease_left = lambda: 0.0  # the Lease is gone: nothing is sent
            try:
                await client.create(manifest=_configmap(namespace, "unsent"))
                unsent = None
            except kube.NotLeading as err:
                unsent = err
            ends = time.monotonic() + LEASE_LEFT_SECONDS
            client.lease_left = lambda: ends - time.monotonic()
            try:
                await client.create(manifest=_configmap(namespace, "abandoned"))
                abandoned = None
            except kube.NotLeading as err:
                abandoned = err
            client.lease_left = lambda: math.inf  # the same slow write, with time to land
            await client.create(manifest=_configmap(namespace, "landed"))
            return unsent, abandoned
        finally:
            await client.close()

    unsent, abandoned = asyncio.run(scenario())
    assert isinstance(unsent, kube.NotLeading) and "not sent" in str(unsent)
    assert isinstance(abandoned, kube.NotLeading) and "abandoned" in str(abandoned)
    assert "unsent" not in answered, "a write was sent with no time left on the Lease"
    # The abandoned create reached the webhook; once the webhook has answered, it would have landed.
    wait_for("the webhook's answer to the abandoned create", lambda: "abandoned" in answered)
    core = kubernetes.client.CoreV1Api(kube_api)
    names = {c.metadata.name for c in core.list_namespaced_config_map(namespace).items}
    assert "landed" in names, "the slow write without a bound did not land: the test proves nothing"
    assert "abandoned" not in names, "a write abandoned when the Lease ran out landed afterwards"


def test_a_lease_read_that_timed_out_is_a_failed_try_not_the_end_of_the_election(
    control_plane, kube_api, namespace
):
    """The library reads the ``code`` of a failed read's Status body (and asserts there is one):
    the timed-out read must look like an API server's answer, or the election task dies."""

    async def attempt() -> bool:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        try:
            lock = leadership._TimedLeaseLock(
                "timed-out",
                namespace,
                "candidate",
                client.api_client,
                timeout=0,  # the read never answers in time
                tenure=leadership.Tenure(-math.inf),
                renew_deadline=10,
            )

            async def nothing() -> None:
                pass

            config = electionconfig.Config(
                lock,
                lease_duration=15,
                renew_deadline=10,
                retry_period=2,
                onstarted_leading=nothing,
                onstopped_leading=nothing,
            )
            return await leaderelection.LeaderElection(config).try_acquire_or_renew()
        finally:
            await client.close()

    assert asyncio.run(attempt()) is False
    leases = kubernetes.client.CoordinationV1Api(kube_api).list_namespaced_lease(namespace).items
    assert "timed-out" not in [lease.metadata.name for lease in leases]  # no create after it
