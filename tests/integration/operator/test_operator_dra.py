"""GPUs through DRA claims (``resources.dra``) on a real API server: the claim template the
operator creates and owns, the pods that claim from it, and the API server's refusals.

The session's control plane (no controller-manager) shows what the API server accepts and refuses;
a private one with kube-controller-manager shows its ResourceClaim controller creating each pod's
claim from the template and its garbage collector deleting the template with the job.  No DRA
driver runs: no device is allocated, and no pod is bound (the scheduler waits for devices).
"""

from __future__ import annotations

import pathlib
import re
import time
from collections.abc import Iterator

import kubernetes
import pytest
import yaml

from meshtrain.api import loading
from meshtrain.operator.cluster import children
from meshtrain.operator.policy import builders, conditions, identity
from tests.builders import JobBuilder
from tests.integration.operator.cluster import (
    Cluster,
    ensure_children,
    reconcile_passes,
    wait_for,
)

pytestmark = pytest.mark.integration

RESOURCE = ("resource.k8s.io", "v1")
H200 = "device.attributes['gpu.sim.meshtrain.io'].productName == 'NVIDIA H200'"
MEMORY = "device.capacity['gpu.sim.meshtrain.io'].memory.compareTo(quantity('80Gi')) >= 0"


def _dra_job(name: str, namespace: str, pool: str | None, *selectors: str) -> JobBuilder:
    """Two pods of four GPUs each, claimed from DeviceClass gpu.sim.meshtrain.io."""
    return (
        JobBuilder(name, namespace, pool)
        .layout(data=4, tensor=2, gpus_per_node=4)
        .dra(
            "gpu.sim.meshtrain.io",
            *selectors,
            match_attribute="resource.kubernetes.io/pcieRoot",
        )
    )


def _templates(cluster: Cluster, namespace: str, job: str) -> list[dict]:
    """The job's GPU claim templates (``<job>-gpus-<hash10>``), oldest first."""
    found = cluster.custom.list_namespaced_custom_object(
        *RESOURCE, namespace, "resourceclaimtemplates"
    )["items"]
    mine = [t for t in found if t["metadata"]["name"].startswith(f"{job}-gpus-")]
    return sorted(mine, key=lambda t: int(t["metadata"]["resourceVersion"]))


def _template(cluster: Cluster, namespace: str, job: str) -> dict | None:
    """The job's one GPU claim template (None: none)."""
    found = _templates(cluster, namespace, job)
    assert len(found) <= 1, [t["metadata"]["name"] for t in found]
    return found[0] if found else None


def test_a_dra_gang_claims_its_gpus_from_one_owned_template_kept_across_restarts(
    cluster, operator, namespace, pool
):
    for _ in range(2):
        cluster.publish_gpus(cluster.add_node(pool, gpus=4), 4, pool)  # placement sees devices
    cluster.apply(_dra_job("claims", namespace, pool, H200, MEMORY))
    pods = cluster.wait_gang(namespace, "claims", 2)
    job = cluster.job(namespace, "claims")
    template = _template(cluster, namespace, "claims")
    assert template is not None, "the API server holds no claims-gpus-<hash> template"
    name = template["metadata"]["name"]
    [owner] = template["metadata"]["ownerReferences"]
    assert owner["uid"] == job["metadata"]["uid"] and owner["controller"] is True
    assert template["metadata"]["labels"]["meshtrain.io/job"] == "claims"
    [request] = template["spec"]["spec"]["devices"]["requests"]
    assert request["name"] == "gpus"
    assert request["exactly"]["count"] == 4 and request["exactly"]["allocationMode"] == "ExactCount"
    assert [s["cel"]["expression"] for s in request["exactly"]["selectors"]] == [H200, MEMORY]
    assert template["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]
    for pod in pods:  # as the API server stored them
        [claim] = pod.spec.resource_claims
        assert (claim.name, claim.resource_claim_template_name) == ("gpus", name)
        trainer = pod.spec.containers[0]
        assert [c.name for c in trainer.resources.claims] == ["gpus"]
        assert "nvidia.com/gpu" not in (trainer.resources.limits or {})
    # A failed pod restarts the gang: the new pods claim from the very same template.
    cluster.set_pod_phase(namespace, "claims-r0-1", "Failed", exit_code=1)
    pods = cluster.wait_gang(namespace, "claims", 2, attempt=1)
    assert {p.spec.resource_claims[0].resource_claim_template_name for p in pods} == {name}
    kept = _template(cluster, namespace, "claims")
    assert kept is not None and kept["metadata"]["uid"] == template["metadata"]["uid"]


def _tries(cluster: Cluster, namespace: str, name: str) -> int:
    message = cluster.condition(namespace, name, conditions.PLACED).get("message", "")
    found = re.search(r"try (\d+)", message)
    return int(found.group(1)) if found else 0


def test_a_selector_the_api_server_cannot_compile_is_told_by_its_field_and_fails_the_job(
    cluster, operator, namespace, pool
):
    """A CEL selector is compiled by the API server when the template is created: its refusal
    names resources.dra.selectors[i], retries back off, and the job fails as InvalidSpec after
    children.INVALID_TRIES refusals — never a hot loop, and never a pod."""
    for _ in range(2):
        cluster.publish_gpus(cluster.add_node(pool, gpus=4), 4, pool)  # placement sees devices
    broken = "device.attributes['gpu.sim.meshtrain.io'].productName =="  # no right-hand side
    cluster.apply(_dra_job("uncompiled", namespace, pool, H200, broken))
    placed = cluster.wait_reason(
        namespace, "uncompiled", conditions.PLACED, conditions.CREATE_REJECTED
    )
    assert "resources.dra.selectors[1]" in placed["message"], placed["message"]
    assert "spec.spec.devices" not in placed["message"]
    started = time.monotonic()
    cluster.wait_phase(namespace, "uncompiled", "Failed", timeout=60)
    elapsed = time.monotonic() - started
    failed = cluster.condition(namespace, "uncompiled", "Failed")
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "resources.dra.selectors[1]" in failed["message"], failed["message"]
    assert f"try {children.INVALID_TRIES};" in failed["message"], failed["message"]
    assert elapsed >= 2 + 4 - 1, elapsed  # the backoff between the tries (2 s, then 4 s)
    assert cluster.pods(namespace, "uncompiled") == []
    assert _template(cluster, namespace, "uncompiled") is None


def test_a_compute_domain_on_a_cluster_without_nvidia_s_driver_is_told_and_retried_slowly(
    cluster, operator, namespace, pool
):
    cluster.publish_gpus(cluster.add_node(pool, gpus=4), 4, pool)  # placement sees devices
    job = JobBuilder("imex", namespace, pool).layout(data=4, gpus_per_node=4)
    cluster.apply(job.dra("gpu.sim.meshtrain.io", compute_domain=True))
    placed = cluster.wait_reason(namespace, "imex", conditions.PLACED, conditions.CREATE_REJECTED)
    assert "computedomains.resource.nvidia.com" in placed["message"], placed["message"]
    assert "resources.dra.computeDomain" in placed["message"]
    started = time.monotonic()
    wait_for("a second try", lambda: _tries(cluster, namespace, "imex") >= 2, timeout=30)
    time.sleep(6)
    elapsed = time.monotonic() - started
    assert _tries(cluster, namespace, "imex") <= 2 + elapsed / 2
    assert cluster.pods(namespace, "imex") == []
    assert (
        cluster.status(namespace, "imex").get("phase") != "Failed"
    )  # the cluster's, not the spec's


def test_a_changed_claim_spec_gets_a_new_template_never_a_same_named_replacement(
    cluster, namespace
):
    """A claim template's spec is immutable, and kube-controller-manager makes each pod's claim
    from its own cached copy of the template: one deleted and re-created under the same name could
    give new pods claims of the old spec.  The name carries the spec's hash instead."""
    job = cluster.apply(_dra_job("changed", namespace, None, H200))
    ref = identity.JobRef(name="changed", namespace=namespace, uid=job["metadata"]["uid"])

    def template_of(*selectors: str) -> dict:
        spec = loading.parse_spec(_dra_job("changed", namespace, None, *selectors).raw())
        [template] = builders.build_device_claims(ref, spec)
        return template

    assert ensure_children(cluster, ref.uid, [template_of(H200)]) is None
    first = _template(cluster, namespace, "changed")
    assert first is not None
    assert ensure_children(cluster, ref.uid, [template_of(H200)]) is None  # the same spec: kept
    assert _template(cluster, namespace, "changed")["metadata"]["uid"] == first["metadata"]["uid"]
    # The API server refuses to change a claim template in place ...
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.custom.patch_namespaced_custom_object(
            *RESOURCE,
            namespace,
            "resourceclaimtemplates",
            first["metadata"]["name"],
            {"spec": template_of(MEMORY)["spec"]},
        )
    assert refused.value.status == 422 and "immutable" in refused.value.body
    # ... so a job whose resources.dra changed gets a new one, of another name, next to the old
    # (which pods of the running gang may still claim from; it goes with the job)
    assert ensure_children(cluster, ref.uid, [template_of(MEMORY)]) is None
    old, new = _templates(cluster, namespace, "changed")
    assert old["metadata"]["uid"] == first["metadata"]["uid"]
    assert new["metadata"]["name"] != old["metadata"]["name"]
    [request] = new["spec"]["spec"]["devices"]["requests"]
    assert [s["cel"]["expression"] for s in request["exactly"]["selectors"]] == [MEMORY]


EXAMPLE = pathlib.Path(__file__).parents[3] / "manifests" / "examples" / "gpt-1.3b-dra-h200.yaml"


def test_the_dra_example_and_its_claim_template_pass_the_api_server_s_validation(
    cluster, namespace
):
    document = yaml.safe_load(EXAMPLE.read_text())
    applied = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", str(EXAMPLE))
    assert applied.returncode == 0, applied.stderr
    spec = loading.parse_spec(document["spec"])
    ref = identity.JobRef(name=document["metadata"]["name"], namespace=namespace, uid="dry-run")
    [template] = builders.build_device_claims(ref, spec)
    template["metadata"].pop("ownerReferences")  # no such job: a dry run of the template alone
    created = cluster.custom.create_namespaced_custom_object(  # its CEL compiled by the server
        *RESOURCE, namespace, "resourceclaimtemplates", template, dry_run="All"
    )
    assert created["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] == 8


NAMESPACE = "dra"


@pytest.fixture(scope="module")
def with_controllers(control_plane_binaries) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries, controller_manager=True) as found:
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        wait_for(  # the ServiceAccount admission plugin wants it before any pod
            "the default ServiceAccount",
            lambda: found.core.list_namespaced_service_account(NAMESPACE).items,
            timeout=60,
        )
        yield found


def test_the_claim_controller_claims_from_the_template_and_the_collector_deletes_it(
    with_controllers,
):
    cluster = with_controllers
    for _ in range(2):
        cluster.publish_gpus(cluster.add_node("dra", gpus=4), 4, "dra")  # placement sees devices
    cluster.apply(_dra_job("collected", NAMESPACE, "dra", H200))
    reconcile_passes(cluster, NAMESPACE, "collected")
    template = _template(cluster, NAMESPACE, "collected")
    assert template is not None
    pods = cluster.pods(NAMESPACE, "collected")
    assert len(pods) == 2

    def claims() -> list[dict] | None:
        found = cluster.custom.list_namespaced_custom_object(
            *RESOURCE, NAMESPACE, "resourceclaims"
        )["items"]
        return found if len(found) == 2 else None

    # kube-controller-manager's ResourceClaim controller makes one claim per pod from the template
    made = wait_for("a ResourceClaim per pod", claims, timeout=60)
    assert {c["metadata"]["ownerReferences"][0]["name"] for c in made} == {
        p.metadata.name for p in pods
    }
    for claim in made:
        assert claim["spec"] == template["spec"]["spec"]
    uid = cluster.job(NAMESPACE, "collected")["metadata"]["uid"]
    cluster.delete_job(NAMESPACE, "collected")
    wait_for(  # the garbage collector deletes what the job owned
        "the template gone with its job",
        lambda: _template(cluster, NAMESPACE, "collected") is None,
        timeout=90,
    )
    assert cluster.job(NAMESPACE, "collected") is None and uid
