"""Simulated nodes, pod status and Prometheus config of the sandbox (pure builders)."""

from __future__ import annotations

import dataclasses
import pathlib

from meshtrain.sandbox import nodes, podstatus, prometheus


def test_default_topology_is_2_blocks_2_leaves_2_nodes_4_gpus() -> None:
    sim = nodes.topology()
    assert len(sim) == 8 and sum(n.gpus for n in sim) == 32
    assert len({n.block for n in sim}) == 2 and len({n.leaf for n in sim}) == 4
    assert len({n.name for n in sim}) == 8


def test_node_objects_carry_topology_labels_and_gpu_capacity() -> None:
    node = nodes.topology()[5]
    obj = nodes.build_node(node)
    assert obj["metadata"]["labels"][nodes.BLOCK_LABEL] == node.block
    assert obj["metadata"]["labels"][nodes.LEAF_LABEL] == node.leaf
    status = nodes.build_node_status(node, heartbeat="t", ready_since="t0")["status"]
    assert (
        status["allocatable"]["nvidia.com/gpu"] == "4"
        and status["capacity"]["nvidia.com/gpu"] == "4"
    )
    ready = [c for c in status["conditions"] if c["type"] == "Ready"]
    assert ready and ready[0]["status"] == "True"


def test_lease_is_owned_by_its_node() -> None:
    lease = nodes.build_lease("n", uid="u", renew_time="2026-01-01T00:00:00.000000Z")
    assert lease["metadata"]["namespace"] == "kube-node-lease"
    assert lease["metadata"]["ownerReferences"][0]["uid"] == "u"
    assert lease["spec"]["holderIdentity"] == "n"


def _state(exit_code: int | None = None, started: bool = True) -> podstatus.ContainerState:
    return podstatus.ContainerState(
        name="trainer",
        image="img",
        pid=42 if started else None,
        started_at="t" if started else None,
        exit_code=exit_code,
        finished_at="t2" if exit_code is not None else None,
    )


def test_phase_table() -> None:
    table = [
        ([_state(started=False)], "Never", "Pending"),
        ([_state()], "Never", "Running"),
        ([_state(0)], "Never", "Succeeded"),
        ([_state(1)], "Never", "Failed"),
        ([_state(1)], "OnFailure", "Running"),
        ([_state(0), _state()], "Never", "Running"),
    ]
    for containers, policy, expected in table:
        assert podstatus.phase(containers, policy) == expected, (containers, policy)


def test_status_reports_ip_ready_and_exit_code() -> None:
    running = podstatus.build_status(
        ip="127.0.1.3",
        started_at="t",
        now="t",
        init_done=True,
        init=[],
        containers=[_state()],
        restart_policy="Never",
    )
    assert running["podIP"] == "127.0.1.3" and running["phase"] == "Running"
    assert {c["type"]: c["status"] for c in running["conditions"]}["Ready"] == "True"
    failed = podstatus.build_status(
        ip="127.0.1.3",
        started_at="t",
        now="t",
        init_done=True,
        init=[],
        containers=[_state(podstatus.exit_code(-9))],
        restart_policy="Never",
    )
    assert failed["phase"] == "Failed"
    assert failed["containerStatuses"][0]["state"]["terminated"]["exitCode"] == 137


def test_terminated_state_carries_the_termination_message() -> None:
    done = dataclasses.replace(_state(0), message='{"step": 40}\n')
    status = podstatus.build_status(
        ip="127.0.1.3",
        started_at="t",
        now="t",
        init_done=True,
        init=[],
        containers=[done],
        restart_policy="Never",
    )
    assert status["containerStatuses"][0]["state"]["terminated"]["message"] == '{"step": 40}\n'
    plain = podstatus.build_status(
        ip="127.0.1.3",
        started_at="t",
        now="t",
        init_done=True,
        init=[],
        containers=[_state(0)],
        restart_policy="Never",
    )
    assert "message" not in plain["containerStatuses"][0]["state"]["terminated"]


def test_metrics_targets_cover_every_rank_port() -> None:
    pod = {
        "spec": {
            "containers": [
                {
                    "resources": {"limits": {"nvidia.com/gpu": "2"}},
                    "ports": [
                        {"name": "metrics", "containerPort": 9400},
                        {"name": "rendezvous", "containerPort": 29500},
                    ],
                }
            ]
        }
    }
    assert podstatus.metrics_targets(pod, "127.0.1.1") == [9400, 9401]
    named = {
        "spec": {
            "containers": [
                {
                    "resources": {
                        "limits": {"nvidia.com/gpu": "2"}
                    },  # the operator's per-rank names
                    "ports": [
                        {"name": "metrics-0", "containerPort": 9400},
                        {"name": "metrics-1", "containerPort": 9401},
                        {"name": "rendezvous", "containerPort": 29500},
                    ],
                }
            ]
        }
    }
    assert podstatus.metrics_targets(named, "127.0.1.1") == [9400, 9401]
    sd = podstatus.file_sd([("127.0.1.1", [9400, 9401], {"sandbox_pod": "p"})])
    assert sd == [{"targets": ["127.0.1.1:9400", "127.0.1.1:9401"], "labels": {"sandbox_pod": "p"}}]


def test_prometheus_config_honours_exporter_labels() -> None:
    config = prometheus.build_config(
        targets_file=pathlib.Path("/t.json"),
        operator_target="127.0.0.1:9090",
        rule_files=[pathlib.Path("/r.yaml")],
    )
    trainer = config["scrape_configs"][0]
    assert trainer["honor_labels"] is True and trainer["file_sd_configs"][0]["files"] == ["/t.json"]
    assert config["rule_files"] == ["/r.yaml"]
    cmd = prometheus.command(
        pathlib.Path("/usr/bin/prometheus"),
        config_file=pathlib.Path("/c"),
        data_dir=pathlib.Path("/d"),
        port=1,
    )
    assert "--web.listen-address=127.0.0.1:1" in cmd


def test_pod_processes_bind_their_exporters_to_the_pod_address(tmp_path: pathlib.Path) -> None:
    from meshtrain.sandbox import nodeagent  # noqa: PLC0415 - kubernetes client import, only this test needs it
    from meshtrain.trainer.telemetry import exporter  # noqa: PLC0415 - torch, only this test needs it

    pod = {
        "metadata": {
            "name": "job-a0-0",
            "namespace": "default",
            "labels": {"meshtrain.io/job": "job"},
        },
        "spec": {"hostname": "job-a0-0"},
    }
    env = nodeagent.base_env(tmp_path, pod, ip="127.0.1.7", directory=tmp_path / "pod")
    assert nodeagent.METRICS_HOST_ENV == exporter.HOST_ENV
    assert env[exporter.HOST_ENV] == "127.0.1.7" and env[nodeagent.POD_IP_ENV] == "127.0.1.7"
    assert "PYTHONPATH" not in env  # no sitecustomize shim rewriting binds any more
    assert env["MESHTRAIN_LOG_DIR"] == str(tmp_path / "runs" / "default" / "job")
