"""Prometheus for the sandbox: Debian's ``prometheus`` binary on a loopback port.

:func:`build_config` (pure) writes the scrape configuration: the
trainer pods through a ``file_sd`` list the node agent rewrites as pods come
and go (``honor_labels`` so the exporters' job/namespace/pod labels win), the
operator's own exporter, and meshtrain's rules (``dashboards/rules.yaml``)
when present.  :func:`command` is the command line.  Not the
process management (see :mod:`.supervisor`) or a production setup.
"""

from __future__ import annotations

import pathlib
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


def build_config(
    *, targets_file: pathlib.Path, operator_target: str | None, rule_files: list[pathlib.Path]
) -> dict[str, Any]:
    """The prometheus.yml of the sandbox."""
    scrape: list[dict[str, Any]] = [
        {
            "job_name": "meshtrain-trainer",
            "honor_labels": True,
            "file_sd_configs": [{"files": [str(targets_file)], "refresh_interval": "2s"}],
        }
    ]
    if operator_target:
        scrape.append(
            {
                "job_name": "meshtrain-operator",
                "honor_labels": True,
                "static_configs": [{"targets": [operator_target]}],
            }
        )
    return {
        "global": {"scrape_interval": SCRAPE_INTERVAL, "evaluation_interval": "5s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": scrape,
    }


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
