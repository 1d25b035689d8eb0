"""The profile a job is planned on when none is named, chosen once (:mod:`meshtrain.planner.default_plan`)
for ``meshtrain plan`` and the MLflow run's ``plan.txt``: a CPU run's artifact must predict what
``meshtrain plan`` predicts on this machine, not the uncalibrated CPU profile's per-device figure."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import yaml

from meshtrain.api import loading
from meshtrain.planner import default_plan, profiles
from meshtrain.trainer.telemetry.tracking import backend, mlflow_run
from tests.builders import JobBuilder

PREDICTED = re.compile(r"predicted step [^,\n]+")


def test_a_device_name_picks_its_profile_and_unknown_ones_fall_back():
    fp32 = loading.parse_spec(JobBuilder.cpu_run().raw())
    bf16 = loading.parse_spec(JobBuilder.cpu_run().training(precision="bf16").raw())
    assert default_plan.profile_name(fp32) == "cpu"
    assert default_plan.profile_name(bf16) == "h100-sxm"
    for device, name in (
        ("NVIDIA H200", "h200"),
        ("NVIDIA H100 80GB HBM3", "h100-sxm"),
        ("NVIDIA A100-SXM4-40GB", "a100-40g"),
        ("NVIDIA A100-SXM4-80GB", "a100-80g"),
        ("NVIDIA L40S", "l40s"),
    ):
        assert default_plan.profile_name(bf16, device) == name
        profiles.get(name)  # every name it gives is a built-in profile
    assert default_plan.profile_name(bf16, "NVIDIA GeForce RTX 4090") == "h100-sxm"


def test_the_mlflow_plan_predicts_what_meshtrain_plan_does_on_this_host(tmp_path: Path):
    raw = JobBuilder.cpu_run().raw()
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JobBuilder.cpu_run().manifest()))
    cli = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "plan", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    job = loading.parse_spec(raw)
    context = backend.Context(job, "local", "job", None, 1, None, device_name=None, local=True)
    artifact = mlflow_run.plan_text(context)
    predicted = PREDICTED.search(cli.stdout)
    assert predicted is not None, cli.stdout
    assert PREDICTED.findall(artifact) == [predicted.group(0)], artifact
