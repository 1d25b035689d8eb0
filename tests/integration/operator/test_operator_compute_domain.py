"""The operator's ComputeDomains against NVIDIA's own CRD (``resources.dra.computeDomain``).

A private API server serves ``computedomains.resource.nvidia.com`` from the CRD file of NVIDIA's
DRA driver that the full bootstrap fetches (``make test-nvidia-crd``): its schema and its CEL rule
(the spec is immutable) judge what the operator creates.  No IMEX daemon runs: the domain is
never Ready, and its channel template is not made (NVIDIA's controller would make it).
"""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import kubernetes
import pytest
import yaml

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity, naming
from meshtrain.sandbox.controlplane import binaries
from tests.builders import JobBuilder
from tests.integration.operator.cluster import (
    Cluster,
    ensure_children,
    reconcile_passes,
    wait_for,
)

pytestmark = [pytest.mark.integration, pytest.mark.nvidia_crd]

NAMESPACE = "imex"
DOMAINS = ("resource.nvidia.com", "v1beta1", NAMESPACE, "computedomains")


@pytest.fixture(scope="module")
def crd() -> pathlib.Path:
    """NVIDIA's CRD file; the test fails (never skips) naming the command that fetches it."""
    try:
        return binaries.nvidia_compute_domain_crd()
    except binaries.BinariesMissingError as missing:
        pytest.fail(str(missing), pytrace=False)


@pytest.fixture(scope="module")
def with_domains(control_plane_binaries, crd) -> Iterator[Cluster]:
    with Cluster.private(control_plane_binaries) as found:
        found.extensions.create_custom_resource_definition(yaml.safe_load(crd.read_text()))
        wait_for(
            "computedomains served",
            lambda: found.kubectl("get", "computedomains", "-A").returncode == 0,
            timeout=60,
        )
        found.core.create_namespace({"metadata": {"name": NAMESPACE}})
        yield found


def _job(name: str, data: int = 4) -> JobBuilder:
    return (
        JobBuilder(name, NAMESPACE, "imex")
        .layout(data=data, gpus_per_node=2)
        .dra("gpu.nvidia.com", compute_domain=True)
    )


def test_nvidia_s_crd_accepts_the_operator_s_domain_and_pods_claim_its_channel(with_domains):
    cluster = with_domains
    for _ in range(2):
        cluster.publish_gpus(cluster.add_node("imex", gpus=2), 2, "imex")  # placement sees devices
    cluster.apply(_job("nvl"))
    reconcile_passes(cluster, NAMESPACE, "nvl")
    domain = cluster.custom.get_namespaced_custom_object(
        *DOMAINS, "nvl"
    )  # as NVIDIA's CRD stored it
    assert domain["spec"]["numNodes"] == 0  # IMEX daemons where the channel claims land
    assert domain["spec"]["channel"]["resourceClaimTemplate"] == {"name": "nvl-channel"}
    assert domain["spec"]["channel"]["allocationMode"] == "Single"  # the CRD's default
    owner = domain["metadata"]["ownerReferences"][0]
    assert owner["uid"] == cluster.job(NAMESPACE, "nvl")["metadata"]["uid"]
    pods = cluster.pods(NAMESPACE, "nvl")
    assert len(pods) == 2
    for pod in pods:
        gpus, channel = pod.spec.resource_claims
        assert gpus.name == "gpus" and gpus.resource_claim_template_name.startswith("nvl-gpus-")
        assert (channel.name, channel.resource_claim_template_name) == ("channel", "nvl-channel")
        assert [c.name for c in pod.spec.containers[0].resources.claims] == ["gpus", "channel"]


def test_a_resized_gang_keeps_its_domain_and_an_outdated_one_is_replaced(with_domains):
    """numNodes 0 makes the domain's (immutable) spec the same at any gang size: a resized gang
    keeps it, and its channel template; one an earlier release made (numNodes the gang's size,
    another spec hash) is replaced, since NVIDIA's CRD refuses a change in place."""
    cluster = with_domains
    job = cluster.apply(_job("resized"))
    ref = identity.JobRef(name="resized", namespace=NAMESPACE, uid=job["metadata"]["uid"])

    def domain_of(data: int) -> dict:
        spec = loading.parse_spec(_job("resized", data).raw())
        return next(
            o for o in builders.build_device_claims(ref, spec) if o["kind"] == "ComputeDomain"
        )

    assert ensure_children(cluster, ref.uid, [domain_of(4)]) is None
    first = cluster.custom.get_namespaced_custom_object(*DOMAINS, "resized")
    assert ensure_children(cluster, ref.uid, [domain_of(8)]) is None  # four pods: kept
    kept = cluster.custom.get_namespaced_custom_object(*DOMAINS, "resized")
    assert kept["metadata"]["uid"] == first["metadata"]["uid"]
    # NVIDIA's CRD refuses to change a domain in place ...
    with pytest.raises(kubernetes.client.ApiException) as refused:
        cluster.custom.patch_namespaced_custom_object(
            *DOMAINS, "resized", {"spec": {"numNodes": 4}}
        )
    assert refused.value.status == 422 and "immutable" in refused.value.body
    # ... so one of an earlier release's spec is replaced by the job's
    cluster.custom.delete_namespaced_custom_object(*DOMAINS, "resized")
    wait_for(
        "the domain gone",
        lambda: (
            "resized"
            not in {
                d["metadata"]["name"]
                for d in cluster.custom.list_namespaced_custom_object(*DOMAINS)["items"]
            }
        ),
    )
    earlier = domain_of(4)
    earlier["spec"] = {**earlier["spec"], "numNodes": 2}
    earlier["metadata"]["labels"] = {**earlier["metadata"]["labels"], naming.LABEL_SPEC_HASH: "old"}
    cluster.custom.create_namespaced_custom_object(*DOMAINS, earlier)
    old = cluster.custom.get_namespaced_custom_object(*DOMAINS, "resized")
    assert ensure_children(cluster, ref.uid, [domain_of(4)]) is None
    replaced = cluster.custom.get_namespaced_custom_object(*DOMAINS, "resized")
    assert replaced["metadata"]["uid"] != old["metadata"]["uid"]
    assert replaced["spec"]["numNodes"] == 0
