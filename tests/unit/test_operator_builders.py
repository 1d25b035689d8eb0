"""Manifests of a TrainingJob's children: pods, headless Service, ConfigMap."""

from __future__ import annotations

import argparse
import asyncio
import calendar

import pytest
import yaml
from torch.distributed import run as torchrun
from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from meshtrain.api import exitcodes, loading, release
from meshtrain.api import spec as api_spec
from meshtrain.operator import command, reconciler
from meshtrain.operator.cluster import informer
from meshtrain.operator.policy import (
    builders,
    identity,
    job_state,
    kubelet_tier,
    naming,
    placement_outcome,
    replacement,
    torchrun_tier,
)
from meshtrain.trainer.telemetry import goodput
from tests.builders import JobBuilder

REF = identity.JobRef(name="llm", namespace="research", uid="1234")


def spec_of(builder: JobBuilder) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(builder.raw())


def env_of(pod):
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


def test_one_gated_pod_per_node_slot_pinned_to_its_planned_node():
    spec = spec_of(JobBuilder().layout(data=2, pipeline=2, tensor=2, gpus_per_node=4))
    pods = builders.build_pods(REF, spec, 0, ["n-a", "n-b"])
    assert [p["metadata"]["name"] for p in pods] == ["llm-r0-0", "llm-r0-1"]
    for index, pod in enumerate(pods):
        assert pod["spec"]["schedulingGates"] == [{"name": "meshtrain.io/gang"}]
        term = pod["spec"]["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"
        ]["nodeSelectorTerms"][0]
        assert term == {
            "matchFields": [
                {"key": "metadata.name", "operator": "In", "values": [["n-a", "n-b"][index]]}
            ]
        }
        assert pod["spec"]["restartPolicy"] == "Never"
        assert (
            pod["spec"]["hostname"] == pod["metadata"]["name"] and pod["spec"]["subdomain"] == "llm"
        )
        assert pod["metadata"]["labels"][naming.LABEL_NODE_RANK] == str(index)
        assert pod["metadata"]["ownerReferences"][0] == {
            "apiVersion": "meshtrain.io/v1alpha1",
            "kind": "TrainingJob",
            "name": "llm",
            "uid": "1234",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    # pp outermost: pod 0 holds ranks 0-3 (stage 0), pod 1 ranks 4-7 (stage 1)
    assert [p["metadata"]["labels"][naming.LABEL_PIPELINE_STAGES] for p in pods] == ["0", "1"]


def test_empty_image_runs_the_clusters_default_trainer_image():
    spec = spec_of(JobBuilder())
    assert spec.image == ""
    [pod] = builders.build_pods(REF, spec, 0, ["n-a"], default_image="registry.local/trainer:9")
    assert pod["spec"]["containers"][0]["image"] == "registry.local/trainer:9"
    [pod] = builders.build_pods(REF, spec, 0, ["n-a"])
    assert pod["spec"]["containers"][0]["image"] == naming.DEFAULT_TRAINER_IMAGE
    assert naming.DEFAULT_TRAINER_IMAGE.endswith(":" + release.VERSION)
    named = spec_of(JobBuilder()).model_copy(update={"image": "mine/trainer:1"})
    [pod] = builders.build_pods(REF, named, 0, ["n-a"], default_image="registry.local/trainer:9")
    assert pod["spec"]["containers"][0]["image"] == "mine/trainer:1"


def test_pod_settings_reach_every_pod_without_replacing_the_operators_own():
    builder = JobBuilder().layout(data=2, gpus_per_node=1)
    spec = spec_of(
        builder.pod(
            env=[
                {"name": "NCCL_IB_HCA", "value": "mlx5_0,mlx5_1"},
                {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
            ],
            imagePullSecrets=["corp-registry"],
            serviceAccountName="trainer",
            priorityClassName="research-high",
            labels={"team": "llm"},
            annotations={"k8s.v1.cni.cncf.io/networks": "ib-sriov"},
        )
    )
    for pod in builders.build_pods(REF, spec, 0, ["n-a", "n-b"]):
        env = env_of(pod)
        assert env["NCCL_IB_HCA"] == "mlx5_0,mlx5_1"
        assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
        assert env["MESHTRAIN_JOB_NAME"] == "llm"  # the operator's variables stay
        assert pod["spec"]["imagePullSecrets"] == [{"name": "corp-registry"}]
        assert pod["spec"]["serviceAccountName"] == "trainer"
        assert pod["spec"]["priorityClassName"] == "research-high"
        assert pod["metadata"]["labels"]["team"] == "llm"
        assert pod["metadata"]["labels"][naming.LABEL_JOB] == "llm"
        annotations = pod["metadata"]["annotations"]
        assert annotations["k8s.v1.cni.cncf.io/networks"] == "ib-sriov"
        assert naming.ANNOTATION_NODE in annotations


def test_a_custom_program_runs_its_own_command_with_the_gangs_torchrun_environment():
    spec = spec_of(
        JobBuilder()
        .layout(data=4, gpus_per_node=2)
        .trainer(
            type="custom",
            command=["torchrun", "/app/train.py"],
            args=["--epochs", "3"],
            workingDir="/app",
        )
    )
    pods = builders.build_pods(REF, spec, 0, ["n-a", "n-b"])
    for index, pod in enumerate(pods):
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["torchrun", "/app/train.py"]
        assert container["args"] == ["--epochs", "3"]
        assert container["workingDir"] == "/app"
        env = env_of(pod)
        # torchrun's own variables: a plain `torchrun train.py` joins the 2-pod gang.
        assert env["PET_NNODES"] == "2" and env["PET_NPROC_PER_NODE"] == "2"
        assert env["PET_NODE_RANK"] == str(index)
        assert (
            env["PET_MASTER_ADDR"] == env["MASTER_ADDR"] == naming.master_addr("llm", "research", 0)
        )
        assert env["PET_MASTER_PORT"] == str(naming.MASTER_PORT)


def test_pod_spanning_two_stages_is_labelled_with_the_range():
    spec = spec_of(JobBuilder().layout(data=1, pipeline=2, tensor=1, gpus_per_node=2))
    assert builders.pipeline_stages(spec, 0) == "0-1"


def test_deleted_pods_get_the_grace_period_to_checkpoint_and_torchrun_a_little_less():
    spec = spec_of(
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(terminationGracePeriodSeconds=120)
    )
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    assert pod["spec"]["terminationGracePeriodSeconds"] == 120
    # the supervisor reads torchrun's variable (its workers get that long after SIGTERM)
    assert pod["spec"]["containers"][0]["command"] == list(kubelet_tier.SUPERVISOR_COMMAND)
    assert env_of(pod)["PET_SHUTDOWN_TIMEOUT"] == "115"
    default = builders.build_pod(
        REF, spec_of(JobBuilder().layout(data=2, gpus_per_node=1)), 0, 0, "n-a"
    )
    assert (
        default["spec"]["terminationGracePeriodSeconds"] == 60
        and env_of(default)["PET_SHUTDOWN_TIMEOUT"] == "55"
    )


def test_supervisor_command_and_torchruns_env():
    spec = spec_of(JobBuilder().layout(data=2, pipeline=2, tensor=2, gpus_per_node=4))
    pod = builders.build_pod(REF, spec, 3, 1, "n-b")
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", "meshtrain.trainer.supervise"]
    assert container["args"] == []
    env = env_of(pod)
    assert (
        env["PET_NNODES"] == "2"
        and env["PET_NPROC_PER_NODE"] == "4"
        and env["PET_NODE_RANK"] == "1"
    )
    assert env["WORLD_SIZE"] == "8"
    assert env["MASTER_ADDR"] == "llm-r3-0.llm.research.svc" and env["MASTER_PORT"] == "29500"
    assert (env["MESHTRAIN_TP"], env["MESHTRAIN_PP"], env["MESHTRAIN_DP"]) == ("2", "2", "2")
    assert env["MESHTRAIN_SPEC_FILE"] == "/etc/meshtrain/job.yaml"
    assert env["MESHTRAIN_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert (
        env["MESHTRAIN_CHECKPOINT_DIR"] == "/checkpoints"
        and env["MESHTRAIN_METRICS_PORT"] == "9400"
    )
    assert (env["MESHTRAIN_JOB_NAME"], env["MESHTRAIN_NAMESPACE"]) == ("llm", "research")
    # a custom program's own directory is the one meshtrain's trainer derives (docs/checkpoints.md)
    assert env["MESHTRAIN_JOB_CHECKPOINT_DIR"] == "/checkpoints/research/llm"


def test_a_context_parallel_gang_counts_its_fourth_degree_in_pods_and_env():
    """world = data x pipeline x context x tensor; MESHTRAIN_CP only where context > 1."""
    builder = JobBuilder().layout(data=2, pipeline=1, tensor=2, gpus_per_node=4)
    spec = spec_of(builder.clone().parallelism(context=2))
    env = env_of(builders.build_pod(REF, spec, 0, 1, "n-b"))
    assert (env["WORLD_SIZE"], env["PET_NNODES"], env["MESHTRAIN_CP"]) == ("8", "2", "2")
    assert placement_outcome.most_pods(spec) == 2
    assert "MESHTRAIN_CP" not in env_of(builders.build_pod(REF, spec_of(builder), 0, 0, "n-a"))


def test_every_local_rank_exporter_is_a_named_container_port():
    spec = loading.parse_spec(
        JobBuilder().layout(data=2, pipeline=2, tensor=2, gpus_per_node=4).raw()
        | {"metrics": {"port": 9500}}
    )
    ports = builders.build_pod(REF, spec, 0, 1, "n-b")["spec"]["containers"][0]["ports"]
    assert ports == [
        {"name": "metrics-0", "containerPort": 9500},
        {"name": "metrics-1", "containerPort": 9501},
        {"name": "metrics-2", "containerPort": 9502},
        {"name": "metrics-3", "containerPort": 9503},
        {"name": "rendezvous", "containerPort": 29500},
    ]
    names = [p["name"] for p in ports]
    assert len(set(names)) == len(names) and all(
        len(n) <= 15 for n in names
    )  # IANA_SVC_NAME limits


def test_logs_on_the_checkpoint_volume_and_final_progress_in_the_termination_message():
    spec = loading.parse_spec(
        JobBuilder().layout(data=2, gpus_per_node=1).raw()
        | {"checkpoint": {"path": "/ckpt/run1/", "claimName": "c"}}
    )
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    container, env = pod["spec"]["containers"][0], env_of(pod)
    assert env["MESHTRAIN_LOG_DIR"] == "/ckpt/run1/research/llm/logs"  # the job's own directory
    mount = next(m for m in container["volumeMounts"] if m["name"] == "checkpoints")
    assert env["MESHTRAIN_LOG_DIR"].startswith(
        mount["mountPath"].rstrip("/") + "/"
    )  # persists with the claim
    assert (
        env["MESHTRAIN_TERMINATION_LOG"]
        == container["terminationMessagePath"]
        == "/dev/termination-log"
    )
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    # downward API and identity for the exporter's labels
    assert env["MESHTRAIN_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert (env["MESHTRAIN_JOB_NAME"], env["MESHTRAIN_NAMESPACE"]) == ("llm", "research")


def test_resources_volumes_selector_tolerations():
    raw = (
        JobBuilder()
        .layout(data=8, gpus_per_node=8)
        .resources(
            extraResources={"rdma/ib": "1"},
            shmSize="32Gi",
            nodeSelector={"pool": "h100"},
            tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        )
        .raw()
    )
    spec = loading.parse_spec(raw | {"checkpoint": {"claimName": "ckpt", "path": "/ckpt"}})
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources["limits"] == {"nvidia.com/gpu": "8", "rdma/ib": "1"} == resources["requests"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "32Gi"}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt"}
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == {
        "shm": "/dev/shm",
        "checkpoints": "/ckpt",
        "spec": "/etc/meshtrain",
        "tmp": "/tmp",
    }
    assert pod["spec"]["nodeSelector"] == {"pool": "h100"}
    assert pod["spec"]["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        # A gang that rejoins sees a lost node within its rejoin window (pod_loss, finding 2).
        *replacement.node_loss_tolerations(spec_of(JobBuilder())),
    ]


def test_checkpoint_without_claim_is_an_empty_dir():
    pod = builders.build_pod(REF, spec_of(JobBuilder()), 0, 0, "n")
    assert {v["name"]: v for v in pod["spec"]["volumes"]}["checkpoints"] == {
        "name": "checkpoints",
        "emptyDir": {},
    }


def test_headless_service_and_spec_configmap():
    spec = spec_of(JobBuilder())
    service = builders.build_service(REF, spec)
    assert (
        service["spec"]["clusterIP"] == "None"
        and service["spec"]["publishNotReadyAddresses"] is True
    )
    assert service["spec"]["selector"] == {naming.LABEL_JOB: "llm"}
    configmap = builders.build_configmap(REF, spec)
    document = yaml.safe_load(configmap["data"]["job.yaml"])
    assert loading.parse_manifest(document)[1] == spec
    assert configmap["metadata"]["ownerReferences"][0]["uid"] == "1234"


def test_planned_node_from_binding_annotation_or_affinity():
    spec = spec_of(JobBuilder())
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    assert identity.planned_node(pod) == "n-a"
    del pod["metadata"]["annotations"]
    assert identity.planned_node(pod) == "n-a"
    pod["spec"]["nodeName"] = "n-z"
    assert identity.planned_node(pod) == "n-z"
    assert identity.planned_node({"spec": {}}) is None


def test_the_rdma_switch_adds_ipc_lock_and_one_rdma_device_per_pod():
    pods = builders.build_pods(
        REF, spec_of(JobBuilder().layout(data=2, gpus_per_node=1).pod(rdma=True)), 0, ["a", "b"]
    )
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert container["securityContext"]["capabilities"]["add"] == ["IPC_LOCK"]
        assert container["resources"]["requests"]["rdma/ib"] == "1"
        assert container["resources"]["limits"]["rdma/ib"] == "1"
    shared = JobBuilder().pod(rdma=True, rdmaResource="rdma/hca_shared_devices_a")
    [pod] = builders.build_pods(
        REF, spec_of(shared.resources(extraResources={"rdma/hca_shared_devices_a": "2"})), 0, ["a"]
    )
    assert pod["spec"]["containers"][0]["resources"]["requests"]["rdma/hca_shared_devices_a"] == "2"
    [pod] = builders.build_pods(REF, spec_of(JobBuilder()), 0, ["a"])
    assert not any(
        k.startswith("rdma/") for k in pod["spec"]["containers"][0]["resources"]["requests"]
    )


def _selects(selector: dict, labels: dict[str, str]) -> bool:
    """A LabelSelector of matchLabels only (what the builder writes) against a pod's labels."""
    assert set(selector) == {"matchLabels"}, selector
    return all(labels.get(key) == value for key, value in selector["matchLabels"].items())


def test_the_gang_network_policy_admits_the_jobs_own_pods_on_any_port_and_no_other_job():
    spec = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    policy = builders.build_network_policy(REF, spec)
    assert policy["apiVersion"] == "networking.k8s.io/v1" and policy["kind"] == "NetworkPolicy"
    assert policy["metadata"]["name"] == "llm-gang"
    assert policy["metadata"]["namespace"] == "research"
    [owner] = policy["metadata"]["ownerReferences"]
    assert owner["uid"] == "1234" and owner["controller"] is True
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = policy["spec"]["ingress"]  # no peers named: no rule besides the gang's own
    assert "ports" not in rule, "rendezvous and collectives use ports chosen at run time"
    [peer] = rule["from"]
    assert set(peer) == {"podSelector"}, "a podSelector alone: the policy's own namespace only"
    own = [p["metadata"]["labels"] for p in builders.build_pods(REF, spec, 3, ["a", "b"])]
    other = identity.JobRef(name="llm2", namespace="research", uid="5678")
    theirs = [p["metadata"]["labels"] for p in builders.build_pods(other, spec, 0, ["a", "b"])]
    for selector in (policy["spec"]["podSelector"], peer["podSelector"]):
        assert all(_selects(selector, labels) for labels in own)
        assert not any(_selects(selector, labels) for labels in theirs)


OPERATOR_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "meshtrain-system"}},
    "podSelector": {"matchLabels": {"app.kubernetes.io/name": "meshtrain"}},
}
PROMETHEUS_PEERS = (
    {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}},
    {"ipBlock": {"cidr": "10.0.0.0/8"}},
)
PEERS = builders.GangPeers(operator=(OPERATOR_PEER,), metrics=PROMETHEUS_PEERS)


def _covers(port: dict, number: int) -> bool:
    """Whether a NetworkPolicyPort (a number, with or without endPort) admits ``number``."""
    return port["port"] <= number <= port.get("endPort", port["port"])


def _container_ports(spec: api_spec.TrainingJobSpec) -> dict[str, int]:
    [container] = builders.build_pods(REF, spec, 0, ["a", "b"])[0]["spec"]["containers"]
    return {p["name"]: p["containerPort"] for p in container["ports"]}


def test_the_gang_policy_admits_the_operator_on_the_progress_port_and_prometheus_on_the_exporters():
    spec = spec_of(JobBuilder().layout(data=8, gpus_per_node=4).metrics(port=9400))
    policy = builders.build_network_policy(REF, spec, PEERS)
    own, operator, prometheus = policy["spec"]["ingress"]
    assert "ports" not in own and own["from"][0]["podSelector"] == policy["spec"]["podSelector"]
    assert operator["from"] == [OPERATOR_PEER]
    assert [p["port"] for p in operator["ports"]] == [9400], "where rank 0 serves /progress"
    assert prometheus["from"] == list(PROMETHEUS_PEERS)
    ports = _container_ports(spec)
    exporters = {n for name, n in ports.items() if name.startswith(naming.METRICS_PORT_PREFIX)}
    assert len(exporters) == 4
    for rule in (operator, prometheus):
        assert all(p["protocol"] == "TCP" for p in rule["ports"])
        assert not any(_covers(p, ports["rendezvous"]) for p in rule["ports"]), "TCPStore"
    admitted = {n for n in range(1, 65536) if any(_covers(p, n) for p in prometheus["ports"])}
    assert admitted == exporters


def test_the_gang_policy_admits_a_custom_programs_declared_progress_port_or_no_operator():
    custom = JobBuilder().layout(data=2, gpus_per_node=1).trainer(type="custom", command=["t"])
    declared = builders.build_network_policy(
        REF, spec_of(custom.clone().trainer(progressPort=9500)), PEERS
    )
    assert declared["spec"]["ingress"][1]["ports"] == [{"protocol": "TCP", "port": 9500}]
    silent = builders.build_network_policy(REF, spec_of(custom), PEERS)
    assert [r["from"] for r in silent["spec"]["ingress"][1:]] == [list(PROMETHEUS_PEERS)]


def test_a_gang_policy_rule_without_peers_is_left_out_never_an_empty_from():
    spec = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    only_operator = builders.GangPeers(operator=(OPERATOR_PEER,))
    rules = builders.build_network_policy(REF, spec, only_operator)["spec"]["ingress"]
    assert len(rules) == 2 and all(rule["from"] for rule in rules)


def test_the_built_in_trainer_is_restarted_in_place_by_the_kubelet_when_it_dies():
    spec = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    container = builders.build_pod(REF, spec, 0, 1, "n-b")["spec"]["containers"][0]
    assert container["restartPolicy"] == "Never"
    [rule] = container["restartPolicyRules"]
    assert rule["action"] == "Restart" and rule["exitCodes"]["operator"] == "In"
    codes = set(rule["exitCodes"]["values"])
    assert {1, 134, 137, 139} <= codes
    never = {0, exitcodes.GANG_RESTART, exitcodes.STOPPED, exitcodes.INTERRUPTED}
    never |= {exitcodes.FENCED, exitcodes.DEVICE_SUSPECT}  # superseded; a bad GPU's node
    assert not codes & (never | set(exitcodes.PERMANENT))
    env = env_of(builders.build_pod(REF, spec, 0, 0, "n-a"))
    assert env[kubelet_tier.ENV_IN_PLACE] == "1" and env[kubelet_tier.ENV_IN_PLACE_LIMIT] == "10"
    assert env[kubelet_tier.ENV_WARM_SPARES] == "1"
    assert env[kubelet_tier.ENV_REJOIN_TIMEOUT] == "120"


def test_no_restart_rules_for_a_custom_trainer_or_without_in_place_recovery():
    custom = JobBuilder().layout(data=2, gpus_per_node=1).trainer(type="custom", command=["train"])
    for builder in (
        custom,
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(recovery={"inPlace": False}),
        JobBuilder().layout(data=2, gpus_per_node=1).run_policy(recovery={"inPlaceLimit": 0}),
    ):
        pod = builders.build_pod(REF, spec_of(builder), 0, 0, "n-a")
        container = pod["spec"]["containers"][0]
        assert "restartPolicy" not in container and "restartPolicyRules" not in container
        assert pod["spec"]["restartPolicy"] == "Never"
        assert env_of(pod)[kubelet_tier.ENV_IN_PLACE] == "0"


def test_the_pods_tell_the_trainer_when_the_job_was_created():
    """The goodput account's wall time starts at the TrainingJob's creationTimestamp, read back
    by the trainer's own parser (``goodput.job_started``) as the same instant."""
    created = "2026-11-29T15:04:05Z"
    body = {
        "metadata": {
            "name": "llm",
            "namespace": "research",
            "uid": "1234",
            "creationTimestamp": created,
        },
        "spec": JobBuilder().raw(),
    }
    job = job_state.read(body)
    assert job.ref == REF  # the creation time is not part of the identity
    env = env_of(builders.build_pod(job.ref, spec_of(JobBuilder()), 0, 0, "node-a"))
    expected = calendar.timegm((2026, 11, 29, 15, 4, 5, 0, 0, 0))
    assert goodput.job_started(env) == expected
    assert "MESHTRAIN_JOB_STARTED_AT" not in env_of(
        builders.build_pod(REF, spec_of(JobBuilder()), 0, 0, "node-a")
    )


def test_pod_0_hosts_the_store_and_carries_no_restart_rules_its_death_rebuilds_the_gang():
    spec = spec_of(JobBuilder().layout(data=4, gpus_per_node=1))
    pods = builders.build_pods(REF, spec, 0, ["a", "b", "c", "d"])
    ruled = ["restartPolicyRules" in p["spec"]["containers"][0] for p in pods]
    assert ruled == [False, True, True, True]
    assert "restartPolicy" not in pods[0]["spec"]["containers"][0]
    assert env_of(pods[0])[kubelet_tier.ENV_IN_PLACE] == "1", "its processes still restart in place"


def test_where_the_api_server_serves_no_restart_rules_no_pod_carries_them():
    spec = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    for pod in builders.build_pods(REF, spec, 0, ["a", "b"], restart_rules=False):
        container = pod["spec"]["containers"][0]
        assert "restartPolicy" not in container and "restartPolicyRules" not in container
        assert container["command"] == list(kubelet_tier.SUPERVISOR_COMMAND)
        assert env_of(pod)[kubelet_tier.ENV_IN_PLACE] == "1", "the process tier stays"
    served = builders.build_pod(REF, spec, 0, 1, "b", restart_rules=True)
    assert served["spec"]["containers"][0]["restartPolicyRules"]


@pytest.mark.parametrize(
    ("version", "served"),
    [
        ({"major": "1", "minor": "35", "gitVersion": "v1.35.0"}, True),
        ({"major": "1", "minor": "36"}, True),
        ({"major": "1", "minor": "35+", "gitVersion": "v1.35.2-eks-1"}, True),
        ({"major": "2", "minor": "0"}, True),
        ({"major": "1", "minor": "34"}, False),
        ({"major": "1", "minor": "30+"}, False),
        ({"major": "", "minor": ""}, False),
        ({"major": "one", "minor": "35"}, False),
        ({}, False),
    ],
)
def test_restart_rules_are_used_from_kubernetes_1_35_on(version, served):
    assert kubelet_tier.rules_served(version) is served


def _torchrun_reads(pod, monkeypatch):
    """What torchrun's own parser makes of the pod's environment and command."""
    for name, value in env_of(pod).items():
        if isinstance(value, str):
            monkeypatch.setenv(name, value)
    container = pod["spec"]["containers"][0]
    return torchrun.get_args_parser().parse_args([*container["command"][1:], *container["args"]])


def test_a_custom_trainers_torchrun_restarts_its_workers_in_place_through_its_own_flags(
    monkeypatch,
):
    spec = spec_of(
        JobBuilder()
        .layout(data=4, gpus_per_node=2)
        .trainer(type="custom", command=["torchrun", "/app/train.py"], args=["--epochs", "3"])
        .run_policy(recovery={"inPlaceLimit": 3, "torchrunElastic": True})
    )
    pods = builders.build_pods(REF, spec, 2, ["n-a", "n-b"])
    hosts = []
    for pod in pods:
        container = pod["spec"]["containers"][0]
        assert container["command"] == ["torchrun", "/app/train.py"]  # the user's, untouched
        assert container["args"] == ["--epochs", "3"]
        args = _torchrun_reads(pod, monkeypatch)
        assert args.rdzv_backend == "c10d" and args.max_restarts == 3
        assert (
            args.rdzv_endpoint == f"{naming.master_addr('llm', 'research', 2)}:{naming.MASTER_PORT}"
        )
        assert args.rdzv_id == "1234-2"  # the job's UID and the gang attempt
        assert args.training_script == "/app/train.py"
        conf = dict(kv.split("=") for kv in args.rdzv_conf.split(","))
        hosts.append(conf["is_host"])
    assert hosts == ["1", "0"]  # pod 0's agent hosts the store MASTER_ADDR names


def test_a_custom_trainers_torchrun_stays_static_without_in_place_recovery(monkeypatch):
    custom = (
        JobBuilder()
        .layout(data=2, gpus_per_node=1)
        .trainer(type="custom", command=["torchrun", "t.py"])
    )
    elastic = {"torchrunElastic": True}
    for builder in (
        custom.clone(),  # not opted in: the default
        custom.clone().run_policy(recovery={"inPlace": False, **elastic}),
        custom.clone().run_policy(recovery={"inPlaceLimit": 0, **elastic}),
        custom.clone()
        .trainer(type="custom", command=["python", "t.py"])
        .run_policy(recovery=elastic),  # not torchrun
    ):
        pod = builders.build_pod(REF, spec_of(builder), 0, 0, "n-a")
        assert not any(name.startswith("PET_RDZV") for name in env_of(pod))
        args = _torchrun_reads(pod, monkeypatch)
        assert args.rdzv_backend == "static" and args.max_restarts == 0
    builtin = builders.build_pod(
        REF, spec_of(JobBuilder().layout(data=2, gpus_per_node=1)), 0, 0, "n-a"
    )
    assert not any(name.startswith("PET_RDZV") for name in env_of(builtin))


def test_a_custom_trainers_pods_but_pod_0_restart_whole_when_torchruns_agent_is_killed():
    custom = (
        JobBuilder()
        .layout(data=3, gpus_per_node=1)
        .trainer(type="custom", command=["torchrun"])
        .run_policy(recovery={"torchrunElastic": True})
    )
    first, *others = builders.build_pods(REF, spec_of(custom), 0, ["a", "b", "c"], restart_all=True)
    assert "restartPolicyRules" not in first["spec"]["containers"][0]  # its agent hosts the store
    for pod in others:
        [rule] = pod["spec"]["containers"][0]["restartPolicyRules"]
        assert rule["action"] == "RestartAllContainers"
        codes = rule["exitCodes"]["values"]
        assert 134 in codes and 1 not in codes  # SIGABRT; not torchrun's "workers failed"
        assert 137 not in codes  # an OOM kill: reported as RestartingAllContainers, never counted
        assert all(code > 128 for code in codes)
    builtin = spec_of(JobBuilder().layout(data=2, gpus_per_node=1))
    rules = builders.build_pod(REF, builtin, 0, 1, "a", restart_all=True)["spec"]["containers"][0]
    assert rules["restartPolicyRules"][0]["action"] == "Restart"  # the supervisor's container
    for builder in (custom, custom.clone().run_policy(recovery={"inPlace": False})):
        pods = builders.build_pods(REF, spec_of(builder), 0, ["a", "b", "c"], restart_all=False)
        assert not any("restartPolicyRules" in p["spec"]["containers"][0] for p in pods)
    off = custom.clone().run_policy(recovery={"inPlace": False, "torchrunElastic": True})
    pods = builders.build_pods(REF, spec_of(off), 0, ["a", "b", "c"], restart_all=True)
    assert not any("restartPolicyRules" in p["spec"]["containers"][0] for p in pods)


@pytest.mark.parametrize(
    ("major", "minor", "served"),
    [("1", "35", False), ("1", "36", True), ("1", "36+", True), ("1", "", False), ("2", "0", True)],
)
def test_restart_all_containers_is_used_from_kubernetes_1_36(major, minor, served):
    assert kubelet_tier.all_containers_served({"major": major, "minor": minor}) is served


def _node(*features: object) -> dict[str, object]:
    return {"metadata": {"name": "n"}, "status": {"declaredFeatures": list(features)}}


def test_restart_all_containers_needs_every_node_of_the_gang_to_declare_it():
    """A 1.33-1.35 kubelet under a 1.36 server declares nothing: the scheduler's
    NodeDeclaredFeatures filter and its admission would refuse a pod with the rule there."""
    declaring = _node("InPlacePodVerticalScaling", kubelet_tier.NODE_FEATURE)
    old = {"metadata": {"name": "old"}, "status": {}}  # no status.declaredFeatures at all
    assert kubelet_tier.declares(declaring)
    assert kubelet_tier.declares(informer.trim_node(declaring)), "the operator's cache keeps them"
    assert not kubelet_tier.declares(informer.trim_node(old))
    for node in (old, _node(), _node("InPlacePodVerticalScaling"), None, _node(7), {"status": 3}):
        assert not kubelet_tier.declares(node)
    assert kubelet_tier.declares_all("auto", [declaring, declaring])
    assert not kubelet_tier.declares_all("auto", [declaring, old]), "none of the gang"
    assert kubelet_tier.declares_all("on", [old]), "forced: --restart-all-containers=on"
    assert not kubelet_tier.declares_all("off", [declaring])


class _Server:
    """An API client whose ``/version`` is ``minor`` of 1."""

    def __init__(self, minor: str) -> None:
        self.minor = minor

    async def server_version(self) -> dict[str, str]:
        return {"major": "1", "minor": self.minor}


@pytest.mark.parametrize(
    ("minor", "flag", "expected"),
    [
        ("36", "auto", "auto"),  # the nodes decide
        ("35", "auto", "off"),
        ("34", "on", "on"),  # forced, whatever the server
        ("36", "off", "off"),
    ],
)
def test_restart_all_containers_has_its_own_flag_apart_from_the_restart_rules(
    minor, flag, expected
):
    parser = argparse.ArgumentParser()
    command.configure(parser)
    args = parser.parse_args(["--restart-all-containers", flag])
    assert args.restart_all_containers == flag
    for rules in (None, True, False):  # --container-restart-rules never forces it
        settings = reconciler.Settings(container_restart_rules=rules, restart_all_containers=flag)
        got = asyncio.run(reconciler.resolved(_Server(minor), settings))  # type: ignore[arg-type]
        assert got.restart_all_containers == expected
        assert got.container_restart_rules is (
            kubelet_tier.rules_served({"major": "1", "minor": minor}) if rules is None else rules
        )


def _torchrun_sorted(fqdns: list[str]) -> list[str]:
    """The order torchrun's c10d rendezvous gives node ranks in (its own ``_NodeDesc``)."""
    nodes = [dynamic_rendezvous._NodeDesc(fqdn, 1, 0) for fqdn in fqdns]
    return [node.addr for node in sorted(nodes)]


@pytest.mark.parametrize("pods", [2, 10, 12])
def test_torchruns_node_ranks_are_the_pod_indexes_or_the_tier_stays_off(pods):
    spec = spec_of(
        JobBuilder()
        .layout(data=pods, gpus_per_node=1)
        .trainer(type="custom", command=["torchrun", "t.py"])
        .run_policy(recovery={"torchrunElastic": True})
    )
    built = builders.build_pods(REF, spec, 3, [f"n{i}" for i in range(pods)])
    fqdns = [
        f"{p['spec']['hostname']}.{p['spec']['subdomain']}.research.svc.cluster.local"
        for p in built
    ]
    in_order = _torchrun_sorted(fqdns) == fqdns
    assert in_order is (pods <= 10)  # 12 pods: 0, 1, 10, 11, 2, ...
    elastic = [env_of(p).get("PET_RDZV_BACKEND") for p in built]
    assert elastic == [("c10d" if in_order else None)] * pods
    if in_order:
        assert [env_of(p)["PET_NODE_RANK"] for p in built] == [str(i) for i in range(pods)]


@pytest.mark.parametrize(
    ("command", "torchrun"),
    [
        (["torchrun", "t.py"], True),
        (["/usr/local/bin/torchrun"], True),
        (["python", "-m", "torch.distributed.run", "t.py"], True),
        (["python3.11", "-m", "torch.distributed.run"], True),
        (["python", "t.py"], False),
        (["bash", "-c", "torchrun t.py"], False),
        (["python", "-m", "torch.distributed.launch"], False),
        ([], False),
    ],
)
def test_the_torchrun_tier_is_for_torchrun_commands_only(command, torchrun):
    assert torchrun_tier.is_torchrun(command) is torchrun


def test_opting_out_of_torchruns_restarts_needs_max_restarts_0_too(monkeypatch):
    """docs/recovery.md's precedence, as torchrun's own parser reads the flags: a user flag wins
    over its ``PET_*`` default, and only that flag."""
    spec = spec_of(
        JobBuilder()
        .layout(data=2, gpus_per_node=1)
        .trainer(type="custom", command=["torchrun", "t.py"])
        .run_policy(recovery={"torchrunElastic": True, "inPlaceLimit": 4})
    )
    pod = builders.build_pod(REF, spec, 0, 1, "n-b")
    container = pod["spec"]["containers"][0]
    static = ["--rdzv-backend=static"]
    container["command"] = ["torchrun", *static, "t.py"]
    args = _torchrun_reads(pod, monkeypatch)
    assert args.rdzv_backend == "static" and args.max_restarts == 4, "static alone still restarts"
    container["command"] = ["torchrun", *static, "--max-restarts=0", "t.py"]
    args = _torchrun_reads(pod, monkeypatch)
    assert args.rdzv_backend == "static" and args.max_restarts == 0
    container["command"] = ["torchrun", "--rdzv-conf=timeout=900", "t.py"]
    args = _torchrun_reads(pod, monkeypatch)
    assert args.rdzv_conf == "timeout=900", "a user --rdzv-conf replaces is_host and read_timeout"
    container["command"] = ["torchrun", "--node-rank=5", "t.py"]
    args = _torchrun_reads(pod, monkeypatch)
    config, _, _ = torchrun.config_from_args(args)
    assert config.rdzv_backend == "c10d" and "rank" not in config.rdzv_configs  # ignored
    container["command"] = ["torchrun", *static, "--node-rank=5", "t.py"]
    config, _, _ = torchrun.config_from_args(_torchrun_reads(pod, monkeypatch))
    assert config.rdzv_configs["rank"] == 5  # static's only


def test_a_job_whose_torchrun_elastic_cannot_apply_is_told_why():
    custom = (
        JobBuilder()
        .layout(data=2, gpus_per_node=1)
        .trainer(type="custom", command=["torchrun", "t.py"])
    )
    opted = {"torchrunElastic": True}
    assert torchrun_tier.ignored(spec_of(custom.clone().run_policy(recovery=opted))) is None
    assert torchrun_tier.ignored(spec_of(custom)) is None, "not asked for"
    off = custom.clone().run_policy(recovery={**opted, "inPlace": False})
    assert torchrun_tier.ignored(spec_of(off)) is None, "in-place restarts turned off: its choice"
    wrapped = custom.clone().trainer(command=["bash", "-c", "torchrun t.py"])
    said = torchrun_tier.ignored(spec_of(wrapped.run_policy(recovery=opted)))
    assert said and "does not start torchrun" in said and "'bash'" in said
    large = custom.clone().layout(data=12, gpus_per_node=1).run_policy(recovery=opted)
    said = torchrun_tier.ignored(spec_of(large))
    assert said and "12 pods, more than 10" in said
    builtin = JobBuilder().layout(data=2, gpus_per_node=1).run_policy(recovery=opted)
    said = torchrun_tier.ignored(spec_of(builtin))
    assert said and "trainer.type custom" in said
