"""A DRA job's claim objects and pods (``resources.dra``): what the operator builds from the spec."""

from __future__ import annotations

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import builders, device_claims, identity, naming
from tests.builders import JobBuilder

REF = identity.JobRef(name="llm", namespace="research", uid="1234")
H200 = "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H200'"
MEMORY = "device.capacity['gpu.nvidia.com'].memory.compareTo(quantity('80Gi')) >= 0"


def spec_of(builder: JobBuilder) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(builder.raw())


def _dra(**options) -> JobBuilder:
    return (
        JobBuilder()
        .layout(data=4, tensor=2, gpus_per_node=4)
        .dra("gpu.nvidia.com", H200, MEMORY, **options)
    )


def test_an_extended_resource_job_claims_nothing_and_asks_its_gpus_as_before():
    spec = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    assert builders.build_device_claims(REF, spec) == []
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    assert "resourceClaims" not in pod["spec"]
    assert pod["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "claims" not in pod["spec"]["containers"][0]["resources"]


def test_a_dra_job_gets_one_owned_claim_template_of_gpus_per_node_devices():
    spec = spec_of(_dra())
    [template] = builders.build_device_claims(REF, spec)
    assert template["apiVersion"] == "resource.k8s.io/v1"
    assert template["kind"] == "ResourceClaimTemplate"
    metadata = template["metadata"]
    hashed = metadata["labels"][naming.LABEL_SPEC_HASH][: naming.CLAIM_TEMPLATE_HASH_CHARS]
    assert (metadata["name"], metadata["namespace"]) == (f"llm-gpus-{hashed}", "research")
    assert metadata["labels"][naming.LABEL_JOB] == "llm"
    [owner] = metadata["ownerReferences"]
    assert owner["uid"] == "1234" and owner["controller"] and owner["kind"] == "TrainingJob"
    assert template["spec"] == {
        "spec": {
            "devices": {
                "requests": [
                    {
                        "name": "gpus",
                        "exactly": {
                            "deviceClassName": "gpu.nvidia.com",
                            "allocationMode": "ExactCount",
                            "count": 4,
                            "selectors": [
                                {"cel": {"expression": H200}},
                                {"cel": {"expression": MEMORY}},
                            ],
                        },
                    }
                ]
            }
        }
    }


def test_a_dra_pod_claims_its_gpus_from_the_template_and_asks_no_extended_resource():
    spec = spec_of(_dra().resources(extraResources={"rdma/ib": "1"}))
    pods = builders.build_pods(REF, spec, 3, ["n-a", "n-b"])
    [template] = builders.build_device_claims(REF, spec)
    for pod in pods:
        assert pod["spec"]["resourceClaims"] == [
            {"name": "gpus", "resourceClaimTemplateName": template["metadata"]["name"]}
        ]
        resources = pod["spec"]["containers"][0]["resources"]
        assert resources["claims"] == [{"name": "gpus"}]
        assert resources["limits"] == {"rdma/ib": "1"} == resources["requests"]


def test_a_spare_pod_holds_its_node_s_gpus_through_a_claim_too():
    spare = builders.build_spare_pod(REF, spec_of(_dra()), 0, 0, "n-c")
    [template] = builders.build_device_claims(REF, spec_of(_dra()))
    claimed = spare["spec"]["resourceClaims"][0]["resourceClaimTemplateName"]
    assert claimed == template["metadata"]["name"]
    assert spare["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpus"}]


def test_match_attribute_constrains_the_devices_of_one_pod():
    spec = spec_of(_dra(match_attribute="resource.kubernetes.io/pcieRoot"))
    [template] = builders.build_device_claims(REF, spec)
    assert template["spec"]["spec"]["devices"]["constraints"] == [
        {"requests": ["gpus"], "matchAttribute": "resource.kubernetes.io/pcieRoot"}
    ]


def test_a_compute_domain_spans_the_gang_and_each_pod_claims_its_channel():
    spec = spec_of(_dra(compute_domain=True))
    template, domain = builders.build_device_claims(REF, spec)
    assert template["metadata"]["name"].startswith("llm-gpus-")
    assert (domain["apiVersion"], domain["kind"]) == (
        "resource.nvidia.com/v1beta1",
        "ComputeDomain",
    )
    assert domain["metadata"]["name"] == "llm"
    assert domain["metadata"]["ownerReferences"][0]["uid"] == "1234"
    assert domain["spec"] == {
        "numNodes": 0,  # IMEX daemons where the channel claims land: the same spec at any size
        "channel": {"resourceClaimTemplate": {"name": "llm-channel"}},
    }
    assert spec.pods == 2
    pod = builders.build_pod(REF, spec, 0, 1, "n-b")
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpus", "resourceClaimTemplateName": template["metadata"]["name"]},
        {"name": "channel", "resourceClaimTemplateName": "llm-channel"},
    ]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "gpus"},
        {"name": "channel"},
    ]


def _stamps(builder: JobBuilder) -> dict[str, str]:
    return {
        o["kind"]: o["metadata"]["labels"][naming.LABEL_SPEC_HASH]
        for o in builders.build_device_claims(REF, spec_of(builder))
    }


def _names(builder: JobBuilder) -> dict[str, str]:
    return {
        o["kind"]: o["metadata"]["name"]
        for o in builders.build_device_claims(REF, spec_of(builder))
    }


def test_the_stamp_follows_each_object_s_spec_and_nothing_else():
    base = _stamps(_dra(compute_domain=True))
    assert base == _stamps(_dra(compute_domain=True).training(steps=7))  # same objects
    wider = _stamps(_dra(compute_domain=True).parallelism(data=8))  # 4 pods, same devices per pod
    assert wider == base  # a resized gang keeps its template and its domain (numNodes 0)
    other = _stamps(
        JobBuilder()
        .layout(data=4, tensor=2, gpus_per_node=4)
        .dra("gpu.nvidia.com", H200, compute_domain=True)
    )
    assert other["ResourceClaimTemplate"] != base["ResourceClaimTemplate"]


def test_a_changed_claim_spec_is_a_new_template_name_never_the_same_name_replaced():
    """A template's spec is immutable: a same-named one replaced would race the claim controller's
    copy of it; the name carries the spec's hash instead."""
    base = _names(_dra(compute_domain=True))
    assert base == _names(_dra(compute_domain=True).parallelism(data=8))
    other = _names(
        JobBuilder()
        .layout(data=4, tensor=2, gpus_per_node=4)
        .dra("gpu.nvidia.com", H200, compute_domain=True)
    )
    assert other["ResourceClaimTemplate"] != base["ResourceClaimTemplate"]
    assert other["ComputeDomain"] == base["ComputeDomain"] == "llm"
    assert base["ResourceClaimTemplate"].startswith("llm-gpus-")


def test_an_invalid_selector_is_told_by_its_spec_field():
    server = (
        'ResourceClaimTemplate.resource.k8s.io "llm-gpus" is invalid: '
        "spec.spec.devices.requests[0].exactly.selectors[1].cel.expression: Invalid value: "
        "\"device.attributes['gpu.nvidia.com'].productName == 1\": compilation failed: "
        "ERROR: <input>:1:48: found no matching overload for '_==_'"
    )
    said = device_claims.refusal("ResourceClaimTemplate", 422, server)
    assert said is not None
    assert "resources.dra.selectors[1]: Invalid value" in said
    assert "found no matching overload" in said and "spec.spec.devices" not in said
    assert device_claims.refusal("Pod", 422, server) is None
    assert device_claims.refusal("ResourceClaimTemplate", 403, server) is None


def test_an_unserved_api_is_told_with_what_to_do():
    said = device_claims.refusal(
        "ComputeDomain", 404, "the server could not find the requested resource"
    )
    assert said is not None and "resources.dra.computeDomain" in said and "NVIDIA" in said
    said = device_claims.refusal("ResourceClaimTemplate", 404, "not found")
    assert said is not None and "resource.k8s.io/v1" in said and "drop resources.dra" in said


def test_an_override_s_own_claims_are_added_to_the_gpus_never_instead_of_them():
    nic = {"name": "nic", "resourceClaimTemplateName": "rdma-nic"}
    override = {
        "resourceClaims": [nic],
        "containers": [{"name": naming.CONTAINER, "resources": {"claims": [{"name": "nic"}]}}],
    }
    pod = builders.build_pod(REF, spec_of(_dra().pod_template(override)), 0, 0, "n-a")
    [template] = builders.build_device_claims(REF, spec_of(_dra().pod_template(override)))
    assert pod["spec"]["resourceClaims"] == [
        {"name": "gpus", "resourceClaimTemplateName": template["metadata"]["name"]},
        nic,
    ]
    assert pod["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "gpus"},
        {"name": "nic"},
    ]


def test_a_refusal_quotes_a_bounded_part_of_the_server_s_message():
    long = "spec.spec.devices.requests[0].exactly.selectors[0].cel.expression: " + "x" * 400_000
    said = device_claims.refusal("ResourceClaimTemplate", 422, long)
    assert said is not None and len(said) < device_claims.SERVER_MESSAGE_CHARS + 400
    assert said.startswith(
        "the API server refused the job's ResourceClaimTemplate, built from resources.dra: "
        "resources.dra.selectors[0]: xxx"
    )
    assert f"... ({len('resources.dra.selectors[0]: ') + 400_000} characters)" in said
