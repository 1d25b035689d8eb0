"""spec.podTemplateOverride on the real API server, with the operator: what the gang's pods carry
as the API server stored them, the job's node affinity honoured by placement, an owned field
refused naming it, and a merged pod the API server refuses reported with the server's words."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.operator.cluster import children
from meshtrain.operator.policy import builders, conditions, naming
from tests.builders import JobBuilder
from tests.unit.test_pod_template import EVERY_SOURCE
from tests.unit.test_pod_template_docs import REF as DOCS_REF
from tests.unit.test_pod_template_docs import docs_pods

pytestmark = pytest.mark.integration

REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
H100 = {"matchExpressions": [{"key": "gpu-class", "operator": "In", "values": ["h100"]}]}
SIDECAR = {
    "name": "ship-logs",
    "image": "fluent-bit:3",
    "restartPolicy": "Always",
    "volumeMounts": [{"name": "tokenizer", "mountPath": "/etc/ship"}],
}
INIT = {"name": "warm-cache", "image": "busybox:1", "command": ["true"]}
OVERRIDE = {
    "volumes": [
        {"name": "datasets", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "tokenizer", "configMap": {"name": "tokenizer"}},
    ],
    "initContainers": [INIT, SIDECAR],
    "containers": [
        {
            "name": naming.CONTAINER,
            "volumeMounts": [
                {"name": "datasets", "mountPath": "/data", "readOnly": True},
                {"name": "tokenizer", "mountPath": "/etc/tokenizer", "readOnly": True},
            ],
            "env": [{"name": "HF_HOME", "value": "/data/hf"}],
        }
    ],
    "affinity": {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [H100]}}},
}


def _stored(cluster, pod: Any) -> dict[str, Any]:
    return cluster.core.api_client.sanitize_for_serialization(pod)


def test_every_pod_carries_the_override_and_runs_where_its_affinity_allows(
    cluster, operator, namespace, pool
):
    cluster.core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            "metadata": {"name": "datasets"},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    cluster.core.create_namespaced_config_map(
        namespace, {"metadata": {"name": "tokenizer"}, "data": {"vocab": "x"}}
    )
    # by GPUs alone the gang fits on the a100 node and placement keeps a gang on one node; the
    # job's affinity allows only the two h100 nodes, one pod each
    cluster.add_node(pool, gpus=8, labels={"gpu-class": "a100"})
    h100 = {cluster.add_node(pool, gpus=2, labels={"gpu-class": "h100"}) for _ in range(2)}
    job = (
        JobBuilder("shaped", namespace, pool)
        .layout(data=4)
        .gpus(2)
        .pod_template(OVERRIDE, labels={"team": "nlp"}, annotations={"example.com/owner": "nlp"})
    )
    cluster.apply(job)
    pods = [_stored(cluster, p) for p in cluster.wait_gang(namespace, "shaped", 2)]
    assert {p["metadata"]["annotations"][naming.ANNOTATION_NODE] for p in pods} == h100
    for pod in pods:
        spec = pod["spec"]
        assert pod["metadata"]["labels"]["team"] == "nlp"
        assert pod["metadata"]["annotations"]["example.com/owner"] == "nlp"
        planned = pod["metadata"]["annotations"][naming.ANNOTATION_NODE]
        assert planned in h100
        volumes = {v["name"]: v for v in spec["volumes"]}
        assert volumes["datasets"]["persistentVolumeClaim"] == {
            "claimName": "datasets",
            "readOnly": True,
        }
        assert volumes["tokenizer"]["configMap"]["name"] == "tokenizer"
        assert {"shm", "checkpoints", "spec", "tmp"} <= set(volumes)
        [trainer] = spec["containers"]
        mounts = {m["mountPath"]: m for m in trainer["volumeMounts"]}
        assert mounts["/data"] == {"name": "datasets", "mountPath": "/data", "readOnly": True}
        assert mounts["/etc/tokenizer"]["readOnly"] is True
        env = {e["name"]: e.get("value") for e in trainer["env"]}
        assert env["HF_HOME"] == "/data/hf" and env["MESHTRAIN_JOB_NAME"] == "shaped"
        assert [c["name"] for c in spec["initContainers"]] == ["warm-cache", "ship-logs"]
        assert spec["initContainers"][1]["restartPolicy"] == "Always"
        terms = spec["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
        pin = {"key": "metadata.name", "operator": "In", "values": [planned]}
        assert terms == [{**H100, "matchFields": [pin]}]
        # what the operator owns is the operator's
        assert not spec.get("schedulingGates")  # lifted once the whole gang existed
        assert spec["restartPolicy"] == "Never" and spec["subdomain"] == "shaped"


def test_an_owned_field_fails_the_job_naming_the_field(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8)
    job = JobBuilder("owned", namespace, pool).layout(data=2).pod_template({"hostname": "mine"})
    cluster.apply(job)
    cluster.wait_phase(namespace, "owned", "Failed")
    failed = cluster.condition(namespace, "owned", "Failed")
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "spec.podTemplateOverride.spec.hostname" in failed["message"]
    assert "headless Service" in failed["message"]
    events = cluster.events(namespace, "owned", conditions.INVALID_SPEC)
    assert "spec.podTemplateOverride.spec.hostname" in events[0].message
    assert cluster.pods(namespace, "owned") == []
    assert operator.alive()


def test_a_badly_shaped_override_fails_the_job_and_the_operator_lives_on(
    cluster, operator, namespace, pool
):
    """Once a crash of placement (AttributeError in feasibility), retried by kopf for ever."""
    cluster.add_node(pool, gpus=8)
    required = {"nodeSelectorTerms": [{"matchExpressions": "abc"}]}
    shaped = {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    }
    job = JobBuilder("shaped-badly", namespace, pool).layout(data=2).pod_template(shaped)
    cluster.apply(job)
    cluster.wait_phase(namespace, "shaped-badly", "Failed")
    failed = cluster.condition(namespace, "shaped-badly", "Failed")
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "nodeSelectorTerms[0].matchExpressions must be a list" in failed["message"]
    assert cluster.pods(namespace, "shaped-badly") == []
    assert operator.alive()


def test_a_merged_pod_the_api_server_refuses_is_reported_in_its_words_with_backoff(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8)
    broken = {
        "containers": [
            {
                "name": naming.CONTAINER,
                "volumeMounts": [{"name": "nowhere", "mountPath": "/data"}],
            }
        ]
    }
    cluster.apply(JobBuilder("refused", namespace, pool).layout(data=2).pod_template(broken))
    placed = cluster.wait_reason(
        namespace, "refused", conditions.PLACED, conditions.CREATE_REJECTED
    )
    # the API server's own validation of the merged pod, field path and all
    assert "volumeMounts" in placed["message"] and "nowhere" in placed["message"]
    events = cluster.events(namespace, "refused", conditions.CREATE_REJECTED)
    assert "nowhere" in events[0].message
    assert cluster.pods(namespace, "refused") == []
    assert operator.alive()
    assert cluster.status(namespace, "refused").get("phase") != "Failed"


def test_a_merged_pod_refused_as_invalid_again_and_again_fails_the_job(
    cluster, operator, namespace, pool
):
    """422 Invalid is the spec's fault: after children.INVALID_TRIES refusals of one generation
    (2 s, then 4 s apart) the job fails with InvalidSpec and the server's message."""
    cluster.add_node(pool, gpus=8)
    broken = {"containers": [{"name": "exporter", "image": "x", "ports": [{"containerPort": 0}]}]}
    cluster.apply(JobBuilder("invalid", namespace, pool).layout(data=2).pod_template(broken))
    cluster.wait_phase(namespace, "invalid", "Failed")
    failed = cluster.condition(namespace, "invalid", "Failed")
    assert failed["reason"] == conditions.INVALID_SPEC
    assert "containerPort" in failed["message"], failed["message"]
    assert f"try {children.INVALID_TRIES};" in failed["message"], failed["message"]
    assert cluster.pods(namespace, "invalid") == []
    assert operator.alive()


def test_the_documented_overrides_and_every_volume_source_pass_the_api_servers_validation(
    cluster, namespace
):
    """Server-side dry-run creates of the pods the builders make: the API server's own validation
    of the merged pod (a field it does not know is refused, not dropped)."""
    every = loading.parse_spec(JobBuilder().layout(data=2).gpus(1).pod_template(EVERY_SOURCE).raw())
    pods = [*docs_pods(), builders.build_pod(DOCS_REF, every, 0, 0, "node-a")]
    for pod in pods:
        pod["metadata"]["namespace"] = namespace
        stored = cluster.core.api_client.sanitize_for_serialization(
            cluster.core.create_namespaced_pod(
                namespace, pod, dry_run="All", field_validation="Strict"
            )
        )
        assert [v["name"] for v in stored["spec"]["volumes"]] == [
            v["name"] for v in pod["spec"]["volumes"]
        ]
        assert len(stored["spec"].get("initContainers") or []) == len(
            pod["spec"].get("initContainers") or []
        )
    stored_volumes = {v["name"]: v for v in stored["spec"]["volumes"]}
    for volume in EVERY_SOURCE["volumes"]:
        source = next(k for k in volume if k != "name")
        assert source in stored_volumes[volume["name"]], volume


@pytest.mark.parametrize(
    ("labels", "annotations", "words"),
    [
        ({"meshtrain.io/job": "other"}, None, "podTemplateOverride.metadata.labels may not use"),
        (None, {"meshtrain.io/planned-node": "n"}, "podTemplateOverride.metadata.annotations"),
        ({"bad key!": "x"}, None, "must be Kubernetes qualified names"),
    ],
)
def test_the_operators_labels_are_refused_by_kubectl_apply(
    cluster, namespace, labels, annotations, words
):
    job = JobBuilder("labelled", namespace).layout(data=2)
    job.pod_template(labels=labels, annotations=annotations)
    result = cluster.kubectl(
        "apply", "--server-side", "-f", "-", stdin=yaml.safe_dump(job.manifest())
    )
    assert result.returncode != 0 and words in result.stderr, result.stderr
