"""spec.podTemplateOverride's bounds and refusals (meshtrain.api.spec.pod_template): each owned field
is refused with its path and the fix, and what the builders own is exactly what is refused."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from meshtrain.api import limits, loading
from meshtrain.api.spec import pod_template
from meshtrain.cli import main
from meshtrain.operator.policy import builders, identity
from tests.builders import JobBuilder

REF = identity.JobRef(name="llm", namespace="research", uid="1234")
TRAINER = pod_template.TRAINER_CONTAINER


def problems(builder: JobBuilder) -> list[str]:
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(builder.raw())
    return [str(p) for p in err.value.problems]


def job(spec: dict[str, Any] | None = None, **metadata: Any) -> JobBuilder:
    return JobBuilder().layout(data=2).pod_template(spec, **metadata)


EVERY_SOURCE = {
    "volumes": [
        {"name": "data", "persistentVolumeClaim": {"claimName": "datasets", "readOnly": True}},
        {"name": "conf", "configMap": {"name": "tokenizer"}},
        {"name": "creds", "secret": {"secretName": "tracker"}},
        {"name": "store", "csi": {"driver": "s3.csi.example.com", "readOnly": True}},
        {
            "name": "scratch",
            "ephemeral": {
                "volumeClaimTemplate": {
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": "1Gi"}},
                    }
                }
            },
        },
        {"name": "weights", "image": {"reference": "registry.local/llama:8b"}},
    ],
    "initContainers": [
        {"name": "warm", "image": "busybox", "command": ["true"]},
        {"name": "ship-logs", "image": "fluent-bit", "restartPolicy": "Always"},
    ],
    "containers": [
        {
            "name": TRAINER,
            "env": [{"name": "HF_HOME", "value": "/data/hf"}],
            "envFrom": [{"configMapRef": {"name": "nccl"}}],
            "volumeMounts": [{"name": "data", "mountPath": "/data", "readOnly": True}],
            "resources": {"limits": {"example.com/nic": "1"}},
            "securityContext": {"runAsUser": 1000},
        },
        {"name": "exporter", "image": "exporter:1"},
    ],
    "affinity": {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        },
        "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
    },
    "tolerations": [{"key": "spot", "operator": "Exists"}],
    "securityContext": {"supplementalGroups": [4000]},
    "hostAliases": [{"ip": "10.0.0.5", "hostnames": ["store.local"]}],
    "dnsConfig": {"options": [{"name": "ndots", "value": "2"}]},
}


def test_every_kind_of_addition_the_issue_names_is_accepted():
    raw = job(
        EVERY_SOURCE,
        labels={"team": "nlp"},
        annotations={"k8s.v1.cni.cncf.io/networks": "rdma-net"},
    ).raw()
    spec = loading.parse_spec(raw)
    assert spec.pod_template_override.spec == EVERY_SOURCE
    assert spec.pod_template_override.metadata.labels == {"team": "nlp"}


REFUSED = [
    ("gate", {"schedulingGates": [{"name": "x"}]}, "spec.podTemplateOverride.spec.schedulingGates"),
    ("hostname", {"hostname": "a"}, "spec.podTemplateOverride.spec.hostname"),
    ("subdomain", {"subdomain": "a"}, "headless Service"),
    ("restart policy", {"restartPolicy": "Always"}, "spec.runPolicy.backoffLimit"),
    ("node name", {"nodeName": "n"}, "spec.podTemplateOverride.spec.nodeName"),
    ("node selector", {"nodeSelector": {"a": "b"}}, "spec.resources.nodeSelector"),
    ("grace", {"terminationGracePeriodSeconds": 1}, "spec.runPolicy.terminationGracePeriodSeconds"),
    ("service account", {"serviceAccountName": "x"}, "spec.pod.serviceAccountName"),
    ("priority", {"priorityClassName": "x"}, "spec.pod.priorityClassName"),
    (
        "checkpoint volume",
        {"volumes": [{"name": "checkpoints", "emptyDir": {}}]},
        "spec.podTemplateOverride.spec.volumes[0].name 'checkpoints'",
    ),
    (
        "rank env",
        {"containers": [{"name": TRAINER, "env": [{"name": "MASTER_ADDR", "value": "x"}]}]},
        "spec.podTemplateOverride.spec.containers[0].env[0] MASTER_ADDR",
    ),
    (
        "meshtrain env",
        {"containers": [{"name": TRAINER, "env": [{"name": "MESHTRAIN_TP", "value": "2"}]}]},
        "MESHTRAIN_TP is set by the operator",
    ),
    (
        "trainer image",
        {"containers": [{"name": TRAINER, "image": "x"}]},
        "spec.podTemplateOverride.spec.containers[0].image is set by the operator: set spec.image",
    ),
    (
        "trainer command",
        {"containers": [{"name": TRAINER, "command": ["x"]}]},
        "spec.trainer.command",
    ),
    (
        "trainer as init",
        {"initContainers": [{"name": TRAINER, "image": "x"}]},
        "spec.podTemplateOverride.spec.initContainers[0].name 'trainer'",
    ),
    (
        "gpus",
        {"containers": [{"name": TRAINER, "resources": {"limits": {"nvidia.com/gpu": "8"}}}]},
        "containers[0].resources.limits['nvidia.com/gpu'] is set by the operator",
    ),
    (
        "gpus on a sidecar",
        {
            "initContainers": [
                {"name": "s", "image": "x", "resources": {"requests": {"nvidia.com/gpu": "1"}}}
            ]
        },
        "initContainers[0].resources.requests['nvidia.com/gpu'] is set by the operator",
    ),
    (
        "empty node term",
        {
            "affinity": {
                "nodeAffinity": {
                    "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}
                }
            }
        },
        "nodeSelectorTerms[0] has no matchExpressions nor matchFields",
    ),
    ("unnamed container", {"containers": [{"image": "x"}]}, "containers[0] needs a name"),
    ("volumes not a list", {"volumes": {"a": 1}}, "spec.podTemplateOverride.spec.volumes must be"),
    ("tolerations not a list", {"tolerations": {}}, "tolerations must be a list"),
]


def _trainer(**fields: Any) -> dict[str, Any]:
    return {"containers": [{"name": TRAINER, **fields}]}


def _required(*terms: Any) -> dict[str, Any]:
    required = {"nodeSelectorTerms": list(terms)}
    return {
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}}
    }


def _expression(**requirement: Any) -> dict[str, Any]:
    return {"matchExpressions": [requirement]}


C0 = "spec.podTemplateOverride.spec.containers[0]"
TERM0 = (
    "spec.podTemplateOverride.spec.affinity.nodeAffinity."
    "requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0]"
)
REFUSED_SHAPES = [
    ("null env", _trainer(env=None), f"{C0}.env is null"),
    ("null mounts", _trainer(volumeMounts=None), f"{C0}.volumeMounts is null"),
    ("null container security", _trainer(securityContext=None), f"{C0}.securityContext is null"),
    ("null containers", {"containers": None}, "spec.podTemplateOverride.spec.containers is null"),
    ("null pod security", {"securityContext": None}, "spec.securityContext is null"),
    ("null volumes", {"volumes": None}, "spec.podTemplateOverride.spec.volumes is null"),
    ("env not a list", _trainer(env="A=1"), f"{C0}.env must be a list of mappings"),
    ("ports of strings", _trainer(ports=["80"]), f"{C0}.ports must be a list of mappings"),
    ("args of numbers", _trainer(args=[1]), f"{C0}.args must be a list of strings"),
    ("resources a string", _trainer(resources="x"), f"{C0}.resources must be a mapping"),
    ("requests a string", _trainer(resources={"requests": "x"}), f"{C0}.resources.requests must"),
    ("bad quantity", _trainer(resources={"limits": {"cpu": "lots"}}), "['cpu'] must be a quantity"),
    ("pod requests", {"resources": {"requests": {"cpu": []}}}, "spec.resources.requests['cpu']"),
    ("overhead", {"overhead": {"cpu": "x"}}, "spec.overhead['cpu'] must be a quantity"),
    ("toleration a string", {"tolerations": ["x"]}, "tolerations must be a list of mappings"),
    ("toleration key", {"tolerations": [{"key": 1}]}, "spec.tolerations[0].key must be a string"),
    (
        "expressions a string",
        _required({"matchExpressions": "abc"}),
        f"{TERM0}.matchExpressions must",
    ),
    (
        "expression a string",
        _required({"matchExpressions": ["abc"]}),
        f"{TERM0}.matchExpressions[0]",
    ),
    ("In without values", _required(_expression(key="a", operator="In")), "must be non-empty"),
    ("bad operator", _required(_expression(key="a", operator="Is")), ".operator must be one of"),
    ("no key", _required(_expression(operator="Exists")), ".key must be a label key"),
    ("bad key", _required(_expression(key="a b", operator="Exists")), ".key must be a label key"),
    (
        "Exists with values",
        _required(_expression(key="a", operator="Exists", values=["b"])),
        "empty",
    ),
    ("Gt word", _required(_expression(key="a", operator="Gt", values=["big"])), "one integer"),
    ("Lt two", _required(_expression(key="a", operator="Lt", values=["1", "2"])), "one integer"),
    (
        "matchFields two values",
        _required(
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["a", "b"]}]}
        ),
        f"{TERM0}.matchFields[0]: matchFields takes key metadata.name",
    ),
    (
        "matchFields on a label",
        _required({"matchFields": [{"key": "zone", "operator": "In", "values": ["a"]}]}),
        "matchFields takes key metadata.name",
    ),
    ("no terms", _required(), "nodeSelectorTerms must be a non-empty list"),
    ("host network", {"hostNetwork": True}, "spec.hostNetwork shares the node's namespaces"),
    ("host pid", {"hostPID": True}, "spec.hostPID shares"),
    ("host ipc", {"hostIPC": False}, "spec.hostIPC shares"),
    (
        "privileged",
        _trainer(securityContext={"privileged": True}),
        f"{C0}.securityContext.privileged",
    ),
    (
        "escalation",
        {"initContainers": [{"name": "s", "securityContext": {"allowPrivilegeEscalation": True}}]},
        "initContainers[0].securityContext.allowPrivilegeEscalation must stay false",
    ),
    ("capabilities", _trainer(securityContext={"capabilities": {"add": "X"}}), "capabilities must"),
    (
        "host path",
        {"volumes": [{"name": "root", "hostPath": {"path": "/"}}]},
        "spec.volumes[0].hostPath mounts the node's files",
    ),
    ("scheduler", {"schedulerName": "other"}, "spec.schedulerName is set by the operator"),
    ("dns policy", {"dnsPolicy": "Default"}, "spec.dnsPolicy must be one of ClusterFirst"),
    ("trainer restart", _trainer(restartPolicy="Always"), f"{C0}.restartPolicy is set by"),
    ("trainer rules", _trainer(restartPolicyRules=[]), f"{C0}.restartPolicyRules is set by"),
    (
        "sidecar in containers",
        {"containers": [{"name": "s", "image": "x", "restartPolicy": "Always"}]},
        f"{C0}.restartPolicy is for init containers",
    ),
]


REFUSED_ENV = [
    *(
        (f"{name} on {where}", {where: [{"name": who, "env": [{"name": name, "value": "0"}]}]})
        for name in ("NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES", "CUDA_VISIBLE_DEVICES")
        for where, who in (("containers", TRAINER), ("containers", "s"), ("initContainers", "i"))
    ),
    *(
        (
            f"plain secret on {where}",
            {where: [{"name": who, "env": [{"name": "HF_TOKEN", "value": "x"}]}]},
        )
        for where, who in (("containers", TRAINER), ("containers", "s"), ("initContainers", "i"))
    ),
]


@pytest.mark.parametrize("case,spec", REFUSED_ENV, ids=[c[0] for c in REFUSED_ENV])
def test_no_container_sees_other_gpus_or_holds_a_plain_secret(case, spec):
    [entries] = spec.values()
    found = problems(job(spec))
    assert any(f"env[0] {entries[0]['env'][0]['name']}" in p for p in found), (case, found)


def test_spec_pod_env_may_not_choose_the_gpus():
    found = problems(job().pod(env=[{"name": "CUDA_VISIBLE_DEVICES", "value": "0"}]))
    assert any("CUDA_VISIBLE_DEVICES: the device plugin sets" in p for p in found), found


def test_the_object_stores_env_is_free_without_an_object_store():
    env = [{"name": "AWS_REGION", "value": "eu"}]
    assert loading.parse_spec(job(_trainer(env=env)).pod(env=env).raw())


@pytest.mark.parametrize("case,spec,words", REFUSED_SHAPES, ids=[c[0] for c in REFUSED_SHAPES])
def test_what_the_operator_merges_or_reads_is_shaped_as_the_api_server_wants(case, spec, words):
    found = problems(job(spec))
    assert any(words in p for p in found), (case, found)


ACCEPTED_SHAPES = [
    ("dns with host net", {"dnsPolicy": "ClusterFirstWithHostNet"}),
    ("numeric quantities", _trainer(resources={"requests": {"cpu": 2, "memory": "1.5Gi"}})),
    ("Gt integer", _required(_expression(key="gen", operator="Gt", values=["3"]))),
    ("DoesNotExist", _required(_expression(key="spot", operator="DoesNotExist"))),
    (
        "own pin",
        _required(
            {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["a"]}]}
        ),
    ),
    ("capabilities added", _trainer(securityContext={"capabilities": {"add": ["SYS_PTRACE"]}})),
]


@pytest.mark.parametrize("case,spec", ACCEPTED_SHAPES, ids=[c[0] for c in ACCEPTED_SHAPES])
def test_well_shaped_overrides_are_accepted(case, spec):
    assert loading.parse_spec(job(spec).raw()).pod_template_override.spec == spec, case


@pytest.mark.parametrize("case,spec,words", REFUSED, ids=[c[0] for c in REFUSED])
def test_owned_fields_are_refused_naming_the_field_and_the_fix(case, spec, words):
    found = problems(job(spec))
    assert any(words in p for p in found), (case, found)


def test_the_operators_labels_and_annotations_are_refused():
    found = problems(job(labels={"meshtrain.io/job": "x"}))
    assert any("spec.podTemplateOverride.metadata.labels" in p for p in found), found
    found = problems(job(annotations={"meshtrain.io/planned-node": "n"}))
    assert any("spec.podTemplateOverride.metadata.annotations" in p for p in found), found


def test_kueues_labels_and_annotations_are_refused_on_the_pods():
    queue = {"kueue.x-k8s.io/queue-name": "other"}
    for where, built in (
        ("spec.podTemplateOverride.metadata.labels", job(labels=queue)),
        ("spec.podTemplateOverride.metadata.annotations", job(annotations=queue)),
        ("spec.pod.labels", job().pod(labels=queue)),
        ("spec.pod.annotations", job().pod(annotations=queue)),
    ):
        found = problems(built)
        assert any(where in p and "kueue.x-k8s.io/queue-name" in p for p in found), found


def test_the_pods_annotations_are_bounded_together():
    count = limits.MAX_POD_ANNOTATION_BYTES // 2 // 4000
    within = {f"example.com/a{i}": "x" * 4000 for i in range(count)}
    assert loading.parse_spec(job(annotations=within).pod(annotations=within).raw())
    over = {**within, "example.com/b": "x" * 4000}
    found = problems(job(annotations=over).pod(annotations=over))
    assert any(f"at most {limits.MAX_POD_ANNOTATION_BYTES}" in p for p in found), found


def test_sizes_are_bounded_by_limits():
    sidecars = [
        {"name": f"s{i}", "image": "x"} for i in range(limits.MAX_POD_OVERRIDE_CONTAINERS + 1)
    ]
    assert any("at most" in p for p in problems(job({"initContainers": sidecars})))
    volumes = [
        {"name": f"v{i}", "emptyDir": {}} for i in range(limits.MAX_POD_OVERRIDE_VOLUMES + 1)
    ]
    assert any("more than" in p for p in problems(job({"volumes": volumes})))
    huge = {"containers": [{"name": "big", "args": ["x" * 4000] * 20}]}
    assert any("larger than" in p for p in problems(job(huge)))
    deep: dict[str, Any] = {}
    node = deep
    for _ in range(limits.MAX_DOCUMENT_DEPTH + 5):
        node["a"] = {}
        node = node["a"]
    assert any("nests deeper" in p for p in problems(job({"overhead": deep})))


STORAGE = {
    "endpoint": "https://minio.storage:9000",
    "region": "eu",
    "credentialsSecret": "s3",
    "caConfigMap": "store-ca",
}


def _built(spec: dict[str, Any] | None = None) -> dict[str, Any]:
    """A pod with everything optional the builder adds to the trainer: a checkpoint claim, the
    object store with its credentials and CA, RDMA."""
    parsed = loading.parse_spec(
        JobBuilder()
        .layout(data=2)
        .checkpoint(claimName="ckpt")
        .object_storage(**STORAGE)
        .pod(rdma=True)
        .pod_template(spec)
        .raw()
    )
    return builders.build_pod(REF, parsed, 0, 0, "node-a")


def test_every_volume_env_and_label_the_builder_sets_is_refused():
    pod = _built()
    for volume in pod["spec"]["volumes"]:
        found = problems(job({"volumes": [{"name": volume["name"], "emptyDir": {}}]}))
        assert any(f"{volume['name']!r} is a volume of the operator" in p for p in found)
    [trainer] = pod["spec"]["containers"]
    for var in trainer["env"]:
        taken = {"name": var["name"], "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
        override = {"containers": [{"name": TRAINER, "env": [taken]}]}
        stored = job(override).object_storage(**STORAGE)
        assert any(f"{var['name']} is set by the operator" in p for p in problems(stored)), var
        in_pod = job().object_storage(**STORAGE).pod(env=[taken])
        assert problems(in_pod), var
    for mount in trainer["volumeMounts"]:
        if mount["name"] == "object-storage-ca":
            moved = {"volumeMounts": [{"name": "x", "mountPath": mount["mountPath"]}]}
            found = problems(job(_trainer(**moved)))
            assert any(f"mountPath {mount['mountPath']} is the operator's" in p for p in found)
    for key in pod["metadata"]["labels"]:
        assert problems(job(labels={key: "x"})), key


MERGED_POD_FIELDS = {"containers", "volumes", "affinity", "securityContext", "tolerations"}
"""Pod fields the builder sets that an override adds to, never replaces."""
OPEN_POD_FIELDS = {"enableServiceLinks", "automountServiceAccountToken"}
"""Pod fields the builder sets that an override may set (nothing of the gang depends on them)."""


GANG_FIELDS: dict[str, Any] = {
    "schedulerName": "other-scheduler",
    "schedulingGates": [],
    "schedulingGroup": {"podGroupName": "other"},
    "nodeName": "n",
    "nodeSelector": {},
    "hostname": "h",
    "subdomain": "s",
    "restartPolicy": "Always",
    "dnsPolicy": "None",
    "hostNetwork": True,
    "activeDeadlineSeconds": 1,
    "terminationGracePeriodSeconds": 0,
}
"""PodSpec fields the gang depends on (its scheduler and gate, its pin, rank 0's DNS name, one
restart for all), with a value that would break it: none may be open."""


def test_the_fields_the_gang_depends_on_are_refused():
    for key, value in GANG_FIELDS.items():
        assert key not in MERGED_POD_FIELDS | OPEN_POD_FIELDS, key
        found = problems(job({key: value}))
        assert any(f"spec.podTemplateOverride.spec.{key}" in p for p in found), (key, found)


def test_every_field_the_builder_sets_is_owned_merged_or_open():
    spec = _built()["spec"]
    # and a pod with every optional field: a node selector, tolerations, a group, a ServiceAccount
    raw = (
        JobBuilder()
        .layout(data=2)
        .resources(nodeSelector={"a": "b"}, tolerations=[{"key": "k", "operator": "Exists"}])
        .pod(serviceAccountName="sa", priorityClassName="p", imagePullSecrets=["s"])
        .raw()
    )
    full = builders.build_pod(REF, loading.parse_spec(raw), 0, 0, "n", pod_group="g")["spec"]
    for key in {*spec, *full}:
        assert key in pod_template.OWNED_POD_FIELDS or key in MERGED_POD_FIELDS | OPEN_POD_FIELDS, (
            key
        )
    [trainer] = full["containers"]
    for key in trainer:
        assert key in pod_template.OWNED_TRAINER_FIELDS or key in (
            "name",
            "resources",
            "env",
            "volumeMounts",
            "ports",
            "securityContext",
        ), key


def test_validate_warns_that_preferences_choose_nothing(tmp_path, capsys):
    preferred = {
        "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 1,
                    "preference": {"matchExpressions": [{"key": "z", "operator": "Exists"}]},
                }
            ]
        }
    }
    spread = {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "ScheduleAnyway"}
    path = tmp_path / "job.yaml"
    for override in ({"affinity": preferred}, {"topologySpreadConstraints": [spread]}):
        path.write_text(yaml.safe_dump(job(override).checkpoint(claimName="c").manifest()))
        assert main.main(["validate", str(path)]) == 0
        assert (
            "warning: spec.podTemplateOverride.spec: preferred node affinity"
            in capsys.readouterr().err
        )
    path.write_text(yaml.safe_dump(job({"affinity": {}}).checkpoint(claimName="c").manifest()))
    assert main.main(["validate", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err
