"""Prometheus for the sandbox: Debian's ``prometheus`` binary on a loopback port.

It scrapes the trainer's and the operator's exporters from file_sd target lists that
:func:`targets` makes from the API server's pods, as Kubernetes service discovery would: Debian
builds Prometheus without it.
"""

from __future__ import annotations

import pathlib
import re
import shutil
from typing import Any

SCRAPE_INTERVAL = "2s"
"""Short, so a run of a few dozen steps leaves enough samples to query."""


def find_binary() -> pathlib.Path:
    """The prometheus binary (Debian package: /usr/bin/prometheus)."""
    found = shutil.which("prometheus") or (
        "/usr/bin/prometheus" if pathlib.Path("/usr/bin/prometheus").exists() else None
    )
    if not found:
        raise FileNotFoundError(
            "prometheus not found: run `make bootstrap` (installs Debian's prometheus package)"
        )
    return pathlib.Path(found)


TRAINER_PORTS = r"metrics-[0-9]+"
"""Names of the trainer's per-rank exporter ports (``metrics-<local rank>``)."""
OPERATOR_PORTS = r"metrics"
"""Name of the operator's exporter port."""


TRAINER_METRIC_RELABEL: list[dict[str, Any]] = [
    {"source_labels": ["__name__"], "regex": "meshtrain_operator_.*", "action": "drop"},
    {"action": "labeldrop", "regex": "exported_(namespace|pod|node)"},
]
"""A trainer scrape's metric relabelling, the chart's PodMonitor's (tests/integration/
test_chart_rendered.py holds them equal): a pod cannot pass series off as the operator's, and an
exporter's own namespace, pod and node (a run without Kubernetes) give way to the target's."""
OPERATOR_METRIC_RELABEL: list[dict[str, Any]] = [
    {"source_labels": ["exported_namespace"], "regex": "(.+)", "target_label": "namespace"},
    {"action": "labeldrop", "regex": "exported_namespace"},
]
"""The operator scrape's, the chart's ServiceMonitor's: a per-job series' namespace is its
TrainingJob's (moved to exported_namespace by the scrape); the operator's own keep its pod's."""


def build_config(*, targets_dir: pathlib.Path, rule_files: list[pathlib.Path]) -> dict[str, Any]:
    """The prometheus.yml of the sandbox: one file_sd job per target file :func:`targets` fills.

    No ``honor_labels``: the target's job, namespace and pod win, as with the chart's monitors
    (docs/telemetry.md, "Labels"); ``rule_files`` are meshtrain's rules (``dashboards/rules.yaml``)
    when present.
    """

    def job(name: str, relabel: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "job_name": name,
            "file_sd_configs": [
                {"files": [str(targets_dir / f"{name}.json")], "refresh_interval": "2s"}
            ],
            "metric_relabel_configs": relabel,
        }

    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "5s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            job("meshtrain-trainer", TRAINER_METRIC_RELABEL),
            job("meshtrain-operator", OPERATOR_METRIC_RELABEL),
        ],
    }


def targets(pods: list[dict[str, Any]], port_names: str) -> list[dict[str, Any]]:
    """file_sd groups: each Running pod's container ports named like ``port_names``, at the pod IP.

    What Prometheus's Kubernetes pod discovery does (Debian's Prometheus is
    built without it): one target per named container port, labelled with the
    pod, its namespace and node.
    """
    groups = []
    for pod in pods:
        status, meta = pod.get("status") or {}, pod.get("metadata") or {}
        if status.get("phase") != "Running" or not status.get("podIP"):
            continue
        addresses = [
            f"{status['podIP']}:{port['containerPort']}"
            for container in (pod.get("spec") or {}).get("containers", [])
            for port in container.get("ports", [])
            if re.fullmatch(port_names, port.get("name", ""))
        ]
        if addresses:
            labels = {
                "pod": meta.get("name", ""),
                "namespace": meta.get("namespace", ""),
                "node": (pod.get("spec") or {}).get("nodeName", ""),
            }
            groups.append({"targets": addresses, "labels": labels})
    return groups


def command(
    binary: pathlib.Path, *, config_file: pathlib.Path, data_dir: pathlib.Path, port: int
) -> list[str]:
    """Command line of the sandbox's Prometheus (loopback only)."""
    return [
        str(binary),
        f"--config.file={config_file}",
        f"--storage.tsdb.path={data_dir}",
        f"--web.listen-address=127.0.0.1:{port}",
        "--storage.tsdb.retention.time=1d",
        "--web.enable-lifecycle",
    ]
