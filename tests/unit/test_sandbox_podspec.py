"""Pod -> local process translation of the sandbox's node agent (pure, table-driven)."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from meshtrain.sandbox import podspec


def trainer_pod(name: str = "job-0-0", **overrides: Any) -> dict[str, Any]:
    """A pod shaped like the operator's gang pods (builder for these tests)."""
    pod = {
        "metadata": {
            "name": name,
            "namespace": "team",
            "uid": "u-1",
            "labels": {"meshtrain.io/job": "job"},
        },
        "spec": {
            "nodeName": "gpu-b0-l0-n0",
            "hostname": name,
            "subdomain": "job",
            "restartPolicy": "Never",
            "containers": [
                {
                    "name": "trainer",
                    "image": "ghcr.io/meshtrain/trainer:0.1.0",
                    "command": ["torchrun"],
                    "args": [
                        "--nnodes=$(PET_NNODES)",
                        "--master-addr=$(MASTER_ADDR)",
                        "--master-port=$(MASTER_PORT)",
                        "-m",
                        "meshtrain.trainer",
                    ],
                    "env": [
                        {"name": "PET_NNODES", "value": "2"},
                        {"name": "MASTER_ADDR", "value": "job-0-0.job.team.svc.cluster.local"},
                        {"name": "MASTER_PORT", "value": "29500"},
                        {"name": "MESHTRAIN_CHECKPOINT_DIR", "value": "/checkpoints"},
                        {"name": "MESHTRAIN_SPEC_FILE", "value": "/etc/meshtrain/job.yaml"},
                        {
                            "name": "MESHTRAIN_POD_NAME",
                            "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}},
                        },
                        {
                            "name": "MESHTRAIN_POD_IP",
                            "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}},
                        },
                        {
                            "name": "JOB_LABEL",
                            "valueFrom": {
                                "fieldRef": {"fieldPath": "metadata.labels['meshtrain.io/job']"}
                            },
                        },
                        {
                            "name": "ADDR_COPY",
                            "value": "port=$(MASTER_PORT) $$(MASTER_PORT) $(UNDEFINED)",
                        },
                    ],
                    "ports": [{"name": "metrics", "containerPort": 9400}],
                    "volumeMounts": [
                        {"name": "shm", "mountPath": "/dev/shm"},
                        {"name": "checkpoints", "mountPath": "/checkpoints"},
                        {"name": "spec", "mountPath": "/etc/meshtrain", "readOnly": True},
                    ],
                }
            ],
            "volumes": [
                {"name": "shm", "emptyDir": {"medium": "Memory"}},
                {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}},
                {"name": "spec", "configMap": {"name": "job-spec"}},
            ],
        },
    }
    pod["spec"].update(overrides)
    return pod


def cluster(ips: dict[str, str | None] | None = None) -> podspec.Cluster:
    ips = {"job-0-0": "127.0.1.1"} if ips is None else ips
    records = [
        podspec.PodRecord(
            namespace="team",
            name=n,
            hostname=n,
            subdomain="job",
            labels={"meshtrain.io/job": "job"},
            ip=ip,
        )
        for n, ip in ips.items()
    ]
    services = {("team", "job"): {"meshtrain.io/job": "job"}}
    return podspec.Cluster(
        config_maps={("team", "job-spec"): {"job.yaml": "checkpoint:\n  path: /checkpoints\n"}},
        resolve=lambda name, ns: podspec.resolve(name, ns, pods=records, services=services),
        claim_dir=lambda ns, claim: f"/state/volumes/{ns}/{claim}",
    )


def plan(pod: dict[str, Any] | None = None, c: podspec.Cluster | None = None) -> podspec.PodPlan:
    return podspec.translate(
        pod or trainer_pod(),
        ip="127.0.1.2",
        pod_dir="/state/pods/team/job-0-0",
        base_env={"PATH": "/venv/bin"},
        cluster=c or cluster(),
    )


def test_env_downward_api_and_expansion() -> None:
    env = plan().containers[0].env
    assert env["MESHTRAIN_POD_NAME"] == "job-0-0"
    assert env["MESHTRAIN_POD_IP"] == "127.0.1.2"
    assert env["JOB_LABEL"] == "job"
    assert env["PATH"] == "/venv/bin"
    assert env["ADDR_COPY"] == "port=29500 $(MASTER_PORT) $(UNDEFINED)", (
        "defined names expand, $$ escapes"
    )


def test_master_addr_is_rewritten_to_the_rank0_pod_ip_in_env_and_args() -> None:
    container = plan().containers[0]
    assert container.env["MASTER_ADDR"] == "127.0.1.1"
    assert "--master-addr=127.0.1.1" in container.argv
    assert container.argv[:1] == ("torchrun",) and container.argv[-2:] == (
        "-m",
        "meshtrain.trainer",
    )


def test_mount_paths_are_rewritten_to_host_directories() -> None:
    result = plan()
    env = result.containers[0].env
    assert env["MESHTRAIN_CHECKPOINT_DIR"] == "/state/volumes/team/ckpt"
    assert env["MESHTRAIN_SPEC_FILE"] == "/state/pods/team/job-0-0/volumes/spec/job.yaml"
    assert result.files == {
        "/state/pods/team/job-0-0/volumes/spec/job.yaml": "checkpoint:\n  path: /state/volumes/team/ckpt\n"
    }
    assert "/dev/shm" not in result.path_map, "memory emptyDir at /dev/shm stays the host's"
    assert "/state/volumes/team/ckpt" in result.directories


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("/checkpoints", "/host/ck"),
        ("/checkpoints/step-5", "/host/ck/step-5"),
        ("--dir=/checkpoints", "--dir=/host/ck"),
        ("/checkpoints2", "/checkpoints2"),
        ("/data/checkpoints", "/data/checkpoints"),
    ],
)
def test_path_rewrite_matches_whole_path_prefixes(text: str, expected: str) -> None:
    assert podspec._rewrite_paths(text, {"/checkpoints": "/host/ck"}) == expected


def test_a_host_path_put_in_by_one_mount_is_not_rewritten_by_another() -> None:
    """The pod's /tmp is a volume, and the sandbox itself lives under /tmp."""
    mounts = {
        "/etc/meshtrain": "/tmp/sandbox/pods/ns/p/volumes/spec",
        "/tmp": "/tmp/sandbox/pods/ns/p/volumes/tmp",
    }
    assert podspec._rewrite_paths("--spec=/etc/meshtrain/job.yaml", mounts) == (
        "--spec=/tmp/sandbox/pods/ns/p/volumes/spec/job.yaml"
    )
    assert podspec._rewrite_paths("/tmp/x /etc/meshtrain", mounts) == (
        "/tmp/sandbox/pods/ns/p/volumes/tmp/x /tmp/sandbox/pods/ns/p/volumes/spec"
    )


def test_unresolved_master_waits() -> None:
    with pytest.raises(podspec.Unresolved) as err:
        plan(c=cluster({"job-0-0": None}))
    assert "job-0-0.job.team.svc.cluster.local" in err.value.names


def test_missing_configmap_waits() -> None:
    pod = trainer_pod()
    pod["spec"]["volumes"][2]["configMap"]["name"] = "later"
    with pytest.raises(podspec.Unresolved):
        plan(pod)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("job-0-0.job", "127.0.1.1"),
        ("job-0-0.job.team", "127.0.1.1"),
        ("job-0-0.job.team.svc", "127.0.1.1"),
        ("job.team.svc.cluster.local", "127.0.1.1"),
    ],
)
def test_resolve_cluster_names(name: str, expected: str) -> None:
    assert cluster().resolve(name, "team") == expected


@pytest.mark.parametrize("name", ["meshtrain.trainer", "example.com", "job-0-0.other"])
def test_non_cluster_names_are_left_alone(name: str) -> None:
    with pytest.raises(KeyError):
        cluster().resolve(name, "team")


def test_secrets_are_unsupported() -> None:
    pod = trainer_pod()
    pod["spec"]["volumes"].append({"name": "s", "secret": {"secretName": "x"}})
    with pytest.raises(podspec.Unsupported, match="Secret"):
        plan(pod)


def test_container_without_command_is_unsupported() -> None:
    pod = copy.deepcopy(trainer_pod())
    del pod["spec"]["containers"][0]["command"]
    del pod["spec"]["containers"][0]["args"]
    with pytest.raises(podspec.Unsupported, match="entrypoint"):
        plan(pod)


def test_init_containers_come_first() -> None:
    pod = trainer_pod(initContainers=[{"name": "prep", "command": ["true"]}])
    assert [(c.name, c.init) for c in plan(pod).containers] == [("prep", True), ("trainer", False)]


def test_ports_are_reported() -> None:
    assert plan().containers[0].ports == (("metrics", 9400),)


def test_termination_message_path_becomes_a_file_of_the_pod_directory():
    pod = trainer_pod()
    container = pod["spec"]["containers"][0]
    container["terminationMessagePath"] = "/dev/termination-log"
    container["env"].append({"name": "MESHTRAIN_TERMINATION_LOG", "value": "/dev/termination-log"})
    process = plan(pod).containers[0]
    assert process.termination_log == "/state/pods/team/job-0-0/termination-log-trainer"
    assert (
        process.env["MESHTRAIN_TERMINATION_LOG"] == process.termination_log
    )  # never the host's /dev
    other = trainer_pod()  # no terminationMessagePath: the kubelet's default, mapped the same way
    other["spec"]["containers"][0]["env"].append({"name": "OUT", "value": "/dev/termination-log"})
    assert (
        plan(other).containers[0].env["OUT"] == "/state/pods/team/job-0-0/termination-log-trainer"
    )
