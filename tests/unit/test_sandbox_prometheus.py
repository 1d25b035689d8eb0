"""The sandbox's Prometheus configuration: valid for promtool, and it keeps the ports the operator names."""

from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity
from meshtrain.sandbox import example, prometheus


def _config(tmp_path: pathlib.Path) -> dict:
    return prometheus.build_config(targets_dir=tmp_path, rule_files=[pathlib.Path("/r.yaml")])


def test_promtool_accepts_the_config(tmp_path: pathlib.Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool missing: run `make bootstrap` (installs Debian's prometheus)")
    config = _config(tmp_path)
    config["rule_files"] = []
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [promtool, "check", "config", str(tmp_path / "prometheus.yml")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert not any(
        job.get("honor_labels") for job in config["scrape_configs"]
    )  # targets' labels win
    jobs = [job["file_sd_configs"][0]["files"][0] for job in config["scrape_configs"]]
    assert jobs == [
        str(tmp_path / "meshtrain-trainer.json"),
        str(tmp_path / "meshtrain-operator.json"),
    ]


def test_targets_are_the_rank_ports_of_running_pods_at_their_pod_ip() -> None:
    spec = loading.parse_spec(yaml.safe_load(example.DEFAULT_EXAMPLE.read_text())["spec"])
    job = identity.JobRef(name="j", namespace="ns", uid="u")
    running, pending = builders.build_pods(job, spec, 0, ["node-a", "node-a"])
    running["spec"]["nodeName"] = "node-a"
    running["status"] = {"phase": "Running", "podIP": "10.202.0.7"}
    pending["status"] = {"phase": "Pending"}
    groups = prometheus.targets([running, pending], prometheus.TRAINER_PORTS)
    ranks = spec.resources.gpus_per_node
    assert groups == [
        {
            "targets": [f"10.202.0.7:{spec.metrics.port + r}" for r in range(ranks)],
            "labels": {"pod": running["metadata"]["name"], "namespace": "ns", "node": "node-a"},
        }
    ]
    assert prometheus.targets([running], prometheus.OPERATOR_PORTS) == []
