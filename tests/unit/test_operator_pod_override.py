"""spec.podTemplateOverride merged into the gang's pods (policy.pod_override), the AND of the job's
required node terms with the pin to the planned node (policy.node_affinity), and feasibility's
reading of them.  Which node kube-scheduler accepts is the differential test's
(tests/integration/operator/test_feasibility_vs_scheduler.py)."""

from __future__ import annotations

import copy
import random
from typing import Any

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.operator.policy import (
    builders,
    feasibility,
    identity,
    kueue_workload,
    memory_admission,
    naming,
    node_affinity,
)
from tests.builders import JobBuilder

REF = identity.JobRef(name="llm", namespace="research", uid="1234")
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
GPU_H100 = {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
ZONE_B = {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["b"]}]}


def pod(override: dict[str, Any] | None = None, node: str = "node-a", **metadata: Any) -> dict:
    raw = JobBuilder().layout(data=4, gpus_per_node=2).resources(cpu="4", memory="8Gi")
    spec = loading.parse_spec(raw.pod_template(override, **metadata).raw())
    return builders.build_pod(REF, spec, 0, 0, node)


def trainer(built: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in built["spec"]["containers"] if c["name"] == naming.CONTAINER)


def node(name: str, **labels: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels}}


def test_no_override_builds_the_pod_of_before():
    assert pod() == pod({})


def test_trainer_container_merges_by_name_and_other_containers_are_added():
    plain = trainer(pod())
    built = pod(
        {
            "containers": [
                {
                    "name": naming.CONTAINER,
                    "env": [{"name": "HF_HOME", "value": "/models"}],
                    "envFrom": [{"secretRef": {"name": "tracker"}}],
                    "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
                    "resources": {"requests": {"example.com/nic": "1", "memory": "16Gi"}},
                    "securityContext": {"runAsUser": 1000},
                    "livenessProbe": {"exec": {"command": ["true"]}},
                },
                {"name": "exporter", "image": "exporter:1"},
            ],
            "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "datasets"}}],
        }
    )
    merged = trainer(built)
    assert [c["name"] for c in built["spec"]["containers"]] == [naming.CONTAINER, "exporter"]
    assert merged["env"] == [*plain["env"], {"name": "HF_HOME", "value": "/models"}]
    assert merged["envFrom"] == [{"secretRef": {"name": "tracker"}}]
    assert merged["volumeMounts"][: len(plain["volumeMounts"])] == plain["volumeMounts"]
    assert merged["volumeMounts"][-1]["name"] == "data"
    requests = merged["resources"]["requests"]
    assert requests == {**plain["resources"]["requests"], "example.com/nic": "1", "memory": "16Gi"}
    assert merged["resources"]["limits"] == plain["resources"]["limits"]
    assert merged["securityContext"] == {**plain["securityContext"], "runAsUser": 1000}
    assert merged["livenessProbe"] == {"exec": {"command": ["true"]}}
    assert merged["image"] == plain["image"] and merged["command"] == plain["command"]
    assert built["spec"]["volumes"][-1]["name"] == "data"
    assert [v["name"] for v in built["spec"]["volumes"][:-1]] == [
        v["name"] for v in pod()["spec"]["volumes"]
    ]


def test_sidecars_tolerations_security_and_metadata_add_to_the_operators():
    plain = pod()
    sidecar = {"name": "ship-logs", "image": "fluent-bit", "restartPolicy": "Always"}
    built = pod(
        {
            "initContainers": [sidecar],
            "tolerations": [{"key": "spot", "operator": "Exists"}],
            "securityContext": {"supplementalGroups": [4000]},
            "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
        },
        labels={"team": "nlp"},
        annotations={"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    )
    # the restricted container defaults under the sidecar's own settings
    restricted = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}
    assert built["spec"]["initContainers"] == [{**sidecar, "securityContext": restricted}]
    assert built["spec"]["tolerations"][-1] == {"key": "spot", "operator": "Exists"}
    assert built["spec"]["securityContext"] == {
        **builders.POD_SECURITY,
        "supplementalGroups": [4000],
    }
    assert built["spec"]["dnsConfig"] == {"options": [{"name": "ndots", "value": "2"}]}
    # the override is part of the spec: its gang is another gang (another spec hash)
    assert built["metadata"]["labels"] == {
        **plain["metadata"]["labels"],
        "team": "nlp",
        naming.LABEL_SPEC_HASH: built["metadata"]["labels"][naming.LABEL_SPEC_HASH],
    }
    assert (
        built["metadata"]["labels"][naming.LABEL_SPEC_HASH]
        != plain["metadata"]["labels"][naming.LABEL_SPEC_HASH]
    )
    assert built["metadata"]["annotations"][naming.ANNOTATION_NODE] == "node-a"
    assert built["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "rdma-net"
    for key in ("schedulingGates", "hostname", "subdomain", "restartPolicy"):
        assert built["spec"][key] == plain["spec"][key]


def test_pods_of_one_gang_share_nothing_mutable():
    spec = loading.parse_spec(
        JobBuilder()
        .layout(data=2, gpus_per_node=1)
        .pod_template({"volumes": [{"name": "d", "emptyDir": {}}]})
        .raw()
    )
    first, second = builders.build_pods(REF, spec, 0, ["a", "b"])
    first["spec"]["volumes"][-1]["emptyDir"]["medium"] = "Memory"
    assert second["spec"]["volumes"][-1] == {"name": "d", "emptyDir": {}}
    assert spec.pod_template_override.spec["volumes"] == [{"name": "d", "emptyDir": {}}]


def test_required_node_terms_are_each_anded_with_the_pin():
    preferred = [{"weight": 1, "preference": ZONE_B}]
    anti = {"requiredDuringSchedulingIgnoredDuringExecution": []}
    built = pod(
        {
            "affinity": {
                "nodeAffinity": {
                    REQUIRED: {"nodeSelectorTerms": [GPU_H100, ZONE_B]},
                    "preferredDuringSchedulingIgnoredDuringExecution": preferred,
                },
                "podAntiAffinity": anti,
            }
        }
    )
    affinity = built["spec"]["affinity"]
    pin = node_affinity.pin("node-a")
    assert affinity["nodeAffinity"][REQUIRED]["nodeSelectorTerms"] == [
        {**GPU_H100, "matchFields": [pin]},
        {**ZONE_B, "matchFields": [pin]},
    ]
    assert affinity["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"] == preferred
    assert affinity["podAntiAffinity"] == anti
    # the pod goes to the pinned node only, and only when a term of the job's holds there
    terms = affinity["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    assert node_affinity.any_term_matches(terms, node("node-a", gpu="h100"))
    assert node_affinity.any_term_matches(terms, node("node-a", zone="b"))
    assert not node_affinity.any_term_matches(terms, node("node-a", gpu="a100"))
    assert not node_affinity.any_term_matches(terms, node("node-b", gpu="h100"))


def test_demand_carries_the_jobs_terms_without_the_pin():
    for planned in ("node-a", ""):  # a gang pod, and the template placement plans with
        demand = feasibility.demand_of(
            pod(
                {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [GPU_H100]}}}},
                planned,
            )
        )
        assert demand.node_affinity == (GPU_H100,)
        assert feasibility.refusal(demand, ready(node("other", gpu="h100"))) is None
        assert (
            feasibility.refusal(demand, ready(node("other", gpu="a100")))
            == feasibility.SELECTOR_MISMATCH
        )
    assert feasibility.demand_of(pod()).node_affinity == ()
    assert feasibility.demand_of(pod(node="")).node_affinity == ()


def test_a_users_own_match_fields_stay_in_the_demand():
    by_name = {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["bad"]}]}
    demand = feasibility.demand_of(
        pod({"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [by_name]}}}})
    )
    assert demand.node_affinity == (by_name,)
    assert feasibility.refusal(demand, ready(node("bad"))) == feasibility.SELECTOR_MISMATCH
    assert feasibility.refusal(demand, ready(node("good"))) is None


def ready(manifest: dict[str, Any]) -> dict[str, Any]:
    return {**manifest, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}


def test_numbers_compare_as_kubernetes_parses_them():
    gt = {"key": "gen", "operator": "Gt", "values": ["3"]}
    assert node_affinity.expression_matches(gt, "4")
    assert node_affinity.expression_matches(gt, "+4")
    assert not node_affinity.expression_matches(gt, "3")
    assert not node_affinity.expression_matches(gt, "4_0")  # Go's ParseInt refuses underscores
    assert not node_affinity.expression_matches(gt, str(2**63))  # and anything past int64
    assert not node_affinity.expression_matches(gt, None)


def test_kueue_counts_the_overrides_containers_and_sidecars():
    built = pod(
        {
            "initContainers": [
                {
                    "name": "ship-logs",
                    "image": "x",
                    "restartPolicy": "Always",
                    "resources": {"requests": {"cpu": "500m"}},
                },
            ],
            "containers": [
                {"name": "bare", "image": "x"},
                {"name": "capped", "image": "x", "resources": {"limits": {"memory": "1Gi"}}},
            ],
        },
        node="",
    )
    spec = loading.parse_spec(JobBuilder().layout(data=4, gpus_per_node=2).raw())
    body = kueue_workload.build_workload(
        REF, spec, kueue_workload.Queue("q", None), built, kueue_workload.Priority(0)
    )
    template = body["spec"]["podSets"][0]["template"]["spec"]
    assert [c["name"] for c in template["containers"]] == [naming.CONTAINER, "bare", "capped"]
    assert template["containers"][1]["resources"] == {"requests": {}}
    assert template["containers"][2]["resources"] == {"requests": {"memory": "1Gi"}}
    assert template["initContainers"] == [
        {"name": "ship-logs", "resources": {"requests": {"cpu": "500m"}}, "restartPolicy": "Always"}
    ]


def test_memory_admission_judges_by_the_nodes_the_jobs_affinity_allows():
    """A job that asks for h100 nodes is not judged by a smaller GPU it can never run on."""
    nodes = [
        placement.Node(name="small", allocatable_gpus=8, labels={"gpu": "a100"}),
        placement.Node(name="big", allocatable_gpus=8, labels={"gpu": "h100"}),
    ]
    required = {"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [GPU_H100]}}}}
    spec = loading.parse_spec(JobBuilder().pod_template(required).raw())
    assert [n.name for n in memory_admission.candidates(spec, nodes)] == ["big"]
    everywhere = loading.parse_spec(JobBuilder().raw())
    assert [n.name for n in memory_admission.candidates(everywhere, nodes)] == ["small", "big"]


def test_a_users_own_pin_to_the_planned_node_stays_in_the_demand():
    """A job's own ``matchFields: metadata.name In [x]`` term keeps its meaning once pinned."""
    own = {"matchFields": [node_affinity.pin("node-a")]}
    built = pod({"affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [own]}}}})
    terms = built["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    assert terms == [{"matchFields": [node_affinity.pin("node-a"), node_affinity.pin("node-a")]}]
    demand = feasibility.demand_of(built)
    assert demand.node_affinity == (own,)
    assert feasibility.refusal(demand, ready(node("node-b"))) == feasibility.SELECTOR_MISMATCH


def test_capabilities_merge_deep_keeping_drop_all_and_ipc_lock():
    raw = JobBuilder().layout(data=4, gpus_per_node=2).pod(rdma=True)
    added = {
        "containers": [
            {"name": "trainer", "securityContext": {"capabilities": {"add": ["SYS_PTRACE"]}}}
        ]
    }
    spec = loading.parse_spec(raw.pod_template(added).raw())
    security = trainer(builders.build_pod(REF, spec, 0, 0, "node-a"))["securityContext"]
    assert security["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK", "SYS_PTRACE"]}
    assert security["allowPrivilegeEscalation"] is False


def test_added_containers_get_the_restricted_defaults_under_their_own():
    built = pod(
        {
            "initContainers": [{"name": "warm", "image": "x", "securityContext": {"runAsUser": 7}}],
            "containers": [
                {"name": "exporter", "image": "x"},
                {
                    "name": "probe",
                    "image": "x",
                    "securityContext": {"capabilities": {"add": ["NET_RAW"]}},
                },
            ],
        }
    )
    [warm] = built["spec"]["initContainers"]
    exporter, probe = built["spec"]["containers"][1:]
    assert warm["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "runAsUser": 7,
    }
    assert exporter["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert probe["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["NET_RAW"]}


def test_kueue_sees_the_jobs_required_terms_pod_resources_and_overhead():
    built = pod(
        {
            "affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [GPU_H100, ZONE_B]}}},
            "resources": {"requests": {"cpu": "8"}},
            "overhead": {"memory": "1Gi"},
        },
        node="",
    )
    spec = loading.parse_spec(JobBuilder().layout(data=4, gpus_per_node=2).raw())
    body = kueue_workload.build_workload(
        REF, spec, kueue_workload.Queue("q", None), built, kueue_workload.Priority(0)
    )
    template = body["spec"]["podSets"][0]["template"]["spec"]
    assert template["affinity"] == {
        "nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [GPU_H100, ZONE_B]}}
    }
    assert template["resources"] == {"requests": {"cpu": "8"}}
    assert template["overhead"] == {"memory": "1Gi"}
    plain = kueue_workload.build_workload(
        REF, spec, kueue_workload.Queue("q", None), pod(node=""), kueue_workload.Priority(0)
    )
    assert "affinity" not in plain["spec"]["podSets"][0]["template"]["spec"]


POD_KEYS = (
    "containers",
    "initContainers",
    "volumes",
    "tolerations",
    "securityContext",
    "affinity",
    "resources",
    "overhead",
    "hostAliases",
    "dnsConfig",
    "enableServiceLinks",
)
CONTAINER_KEYS = ("env", "envFrom", "volumeMounts", "ports", "securityContext", "resources", "args")
VALUES: tuple[Any, ...] = (
    None,
    "x",
    7,
    True,
    [],
    ["x"],
    [{}],
    [{"name": "extra", "value": "1"}],
    {},
    {"requests": "x"},
    {"requests": {"cpu": "1"}, "limits": {"memory": "bad"}},
    {"capabilities": {"add": ["NET_ADMIN"]}},
    {"capabilities": None},
    {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": "abc"}]}}},
    {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [GPU_H100]}}},
    {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}},
    {"nodeAffinity": None},
    [{"key": "k", "operator": "Exists"}],
)


def _random_override(rng: random.Random) -> dict[str, Any]:
    override: dict[str, Any] = {
        key: rng.choice(VALUES) for key in rng.sample(POD_KEYS, rng.randint(1, 3))
    }
    if rng.random() < 0.6:
        name = rng.choice(("trainer", "sidecar"))
        container = {
            key: rng.choice(VALUES) for key in rng.sample(CONTAINER_KEYS, rng.randint(1, 3))
        }
        override[rng.choice(("containers", "initContainers"))] = [{"name": name, **container}]
    return override


def test_any_accepted_override_builds_and_keeps_the_operators_env_and_mounts():
    """Random overrides, nulls and wrong types among them: what validation accepts never
    crashes the builder, placement or Kueue, and never drops the operator's env or mounts."""
    rng = random.Random(33)
    base = JobBuilder().layout(data=4, gpus_per_node=2).resources(cpu="4", memory="8Gi")
    plain = trainer(builders.build_pod(REF, loading.parse_spec(base.raw()), 0, 0, "node-a"))
    accepted = 0
    for _ in range(3000):
        override = _random_override(rng)
        try:
            spec = loading.parse_spec(copy.deepcopy(base).pod_template(override).raw())
        except loading.SpecError:
            continue
        accepted += 1
        built = builders.build_pod(REF, spec, 0, 0, "node-a")
        feasibility.demand_of(builders.build_pod(REF, spec, 0, 0, ""))
        kueue_workload.build_workload(
            REF, spec, kueue_workload.Queue("q", None), built, kueue_workload.Priority(0)
        )
        merged = trainer(built)
        assert all(var in merged["env"] for var in plain["env"]), override
        assert all(mount in merged["volumeMounts"] for mount in plain["volumeMounts"]), override
        assert merged["securityContext"]["capabilities"]["drop"] == ["ALL"], override
        assert merged["securityContext"]["allowPrivilegeEscalation"] is False, override
    assert accepted > 100
