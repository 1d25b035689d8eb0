"""Describe the machine a benchmark ran on and write its results file."""

from __future__ import annotations

import json
import os
import platform
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

RESULTS_ENV = "MESHTRAIN_BENCH_RESULTS"
"""Directory for results files instead of benchmarks/results (a device machine's $OUT, a test's tmp dir)."""
RESULTS = Path(__file__).resolve().parent / "results"


def describe() -> dict[str, Any]:
    """Host, CPU, core count, memory, Python/torch versions and any GPU."""
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
    }
    try:
        with open("/proc/meminfo") as meminfo:
            info["memory_kib"] = int(meminfo.readline().split()[1])
        with open("/proc/cpuinfo") as cpuinfo:
            info["cpu_model"] = next(
                (
                    line.split(":", 1)[1].strip()
                    for line in cpuinfo
                    if line.startswith("model name")
                ),
                None,
            )
    except OSError:
        pass
    try:
        import torch  # noqa: PLC0415 - optional: the machine record works without torch

        info["torch"] = torch.__version__
        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpu_count"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def code() -> dict[str, Any] | None:
    """The commit of the checkout the benchmark runs from and whether files differ from it
    (None outside a git checkout): take it when a long run starts, as commits may land during it."""
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=30
        )
        changed = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if commit.returncode != 0:
        return None
    return {"commit": commit.stdout.strip(), "dirty": bool(changed.stdout.strip())}


def write_results(name: str, results: Any, ran: dict[str, Any] | None = None) -> Path:
    """Write ``results`` with the machine description and the code that ran (``ran``, as
    :func:`code` said when the run started; else as it says now) to results/<name>-<host>.json
    (or under $MESHTRAIN_BENCH_RESULTS)."""
    directory = Path(os.environ.get(RESULTS_ENV) or RESULTS)
    directory.mkdir(parents=True, exist_ok=True)
    machine = describe()
    path = directory / f"{name}-{machine['host']}.json"
    path.write_text(
        json.dumps(
            {
                "benchmark": name,
                "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "machine": machine,
                "code": ran if ran is not None else code(),
                "results": results,
            },
            indent=2,
        )
        + "\n"
    )
    return path
