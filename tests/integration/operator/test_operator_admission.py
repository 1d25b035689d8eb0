"""Admission by plan against a real API server: a job that won't fit its GPUs fails with WontFit and gets no pods.

Nodes name their GPU with NVIDIA GPU feature discovery's ``nvidia.com/gpu.product``
label; the operator of the session runs with the default ``--gpu-profile``.
"""

from __future__ import annotations

import pathlib
import subprocess
import time

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.planner import admission, profiles
from tests.builders import JobBuilder
from tests.integration.operator.cluster import OperatorProcess, wait_for

pytestmark = pytest.mark.integration

H100 = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
H200 = {"nvidia.com/gpu.product": "NVIDIA-H200"}


def _h100_capacity() -> str:
    """How the refusal states an H100's memory, from its profile: the total less the reserve."""
    h100 = profiles.get("h100-sxm")
    usable, total = h100.tensor_memory_bytes / 2**30, h100.memory_bytes / 2**30
    return f"the GPU has {usable:.2f} GiB for tensors ({total:.2f} GiB less {h100.reserved_bytes / 2**30:.2f} GiB"


def _seven_b(name: str, namespace: str, pool: str) -> JobBuilder:
    """7B parameters, dp1·pp1·tp1: every rank holds the whole model (16 bytes/parameter = 102 GiB of state)."""
    return JobBuilder(name, namespace, pool).layout(data=1).gpus(1).model(preset="7b")


def test_seven_b_on_one_80gb_gpu_wont_fit_and_gets_no_pods(cluster, operator, namespace, pool):
    for _ in range(2):
        cluster.add_node(pool, gpus=8, labels=H100)
    cluster.apply(_seven_b("toobig", namespace, pool))
    status = cluster.wait_phase(namespace, "toobig", "Failed")
    wont_fit = cluster.condition(namespace, "toobig", "WontFit")
    assert (wont_fit["status"], wont_fit["reason"]) == ("True", "WontFit")
    message = wont_fit["message"]
    assert "dp1·pp1·tp1 on h100-sxm" in message and _h100_capacity() in message, message
    assert "GiB per GPU" in message and "nvidia.com/gpu.product" in message, message
    assert cluster.condition(namespace, "toobig", "Failed")["reason"] == "WontFit"
    assert status["completionTime"] and status["plan"]["fits"] is False
    assert (
        status["plan"]["memoryPerGpuBytes"] > 80 * 2**30
        and status["plan"]["memoryHeadroomBytes"] < 0
    )
    events = wait_for(
        "WontFit event",
        lambda: [
            e for e in cluster.core.list_namespaced_event(namespace).items if e.reason == "WontFit"
        ],
    )
    assert events[0].involved_object.name == "toobig" and events[0].type == "Warning"
    assert _h100_capacity() in events[0].message
    time.sleep(3)  # a resync or two of the operator later: still no pods, still Failed
    assert cluster.pods(namespace, "toobig") == []
    assert cluster.status(namespace, "toobig")["phase"] == "Failed"
    assert not cluster.core.list_namespaced_config_map(
        namespace, label_selector="meshtrain.io/job=toobig"
    ).items


def test_the_same_job_is_admitted_on_141gb_gpus_with_its_plan_in_the_status(
    cluster, operator, namespace, pool
):
    cluster.add_node(pool, gpus=8, labels=H200)
    cluster.apply(_seven_b("fits", namespace, pool))
    cluster.wait_gang(namespace, "fits", 1)
    plan = cluster.status(namespace, "fits")["plan"]
    assert plan["profile"] == "h200" and plan["fits"] is True and plan["memoryHeadroomBytes"] > 0
    assert plan["parameters"] > 6_000_000_000 and "nvidia.com/gpu.product" in plan["profileSource"]
    assert cluster.condition(namespace, "fits", "WontFit") == {}


def test_a_fitting_job_gets_status_plan(cluster, operator, namespace, pool):
    cluster.add_node(pool, gpus=8, labels=H100)
    cluster.apply(JobBuilder("small", namespace, pool).layout(data=2, pipeline=2).gpus(2))
    cluster.wait_gang(namespace, "small", 2)
    plan = cluster.status(namespace, "small")["plan"]
    assert plan["profile"] == "h100-sxm" and plan["fits"] is True
    for key in (
        "memoryPerGpuBytes",
        "stepSeconds",
        "tokensPerSecond",
        "bubbleRatio",
        "globalBatchTokens",
    ):
        assert plan[key] > 0, key
    assert plan["memoryHeadroomBytes"] < 80 * 2**30 and plan["warnings"] == []
    result = cluster.kubectl(
        "get", "tj", "small", "-n", namespace, "-o", "jsonpath={.status.plan.profile}"
    )
    assert result.stdout == "h100-sxm", result.stderr


def test_unlabelled_nodes_are_judged_by_the_default_profile(cluster, operator, namespace, pool):
    cluster.add_node(
        pool, gpus=8
    )  # no product label: the operator's --gpu-profile (h100-sxm) judges
    cluster.apply(_seven_b("nolabel", namespace, pool))
    cluster.wait_phase(namespace, "nolabel", "Failed")
    message = cluster.condition(namespace, "nolabel", "WontFit")["message"]
    assert "--gpu-profile h100-sxm" in message, message
    assert cluster.pods(namespace, "nolabel") == []


CHART = pathlib.Path(__file__).resolve().parents[3] / "charts" / "meshtrain"


def _rendered(helm: str, values: dict) -> dict[tuple[str, str], dict]:
    """The chart's objects as ``helm template`` renders them with ``values``, by kind and name."""
    out = subprocess.run(
        [helm, "template", "t", str(CHART), "-f", "-"],
        input=yaml.safe_dump(values),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {(doc["kind"], doc["metadata"]["name"]): doc for doc in yaml.safe_load_all(out) if doc}


def test_a_calibrated_profile_given_to_the_chart_is_what_admission_judges_by(
    cluster, operator, namespace, pool, control_plane, control_plane_binaries, tmp_path
):
    """operator.profiles -> the chart's ConfigMap, mounted where the Deployment's env points
    -> the operator judges H100 nodes by the calibrated profile, not the built-in one."""
    calibrated = {
        **yaml.safe_load((profiles.BUILTIN_DIR / "h100-sxm.yaml").read_text()),
        "source": "measured by meshtrain plan --calibrate on gpu-7",
        "memory_bytes": 40 * 2**30,
        "reserved_bytes": 3 * 2**30,
        # what a calibration adds; Helm prints 2e-05 without a dot (a string to YAML 1.1)
        "op_overhead": 2e-05,
        "calibration": {"host": "gpu-7", "device": "NVIDIA H100 80GB HBM3"},
    }
    job = (
        JobBuilder("calibrated", namespace, pool)
        .layout(data=1)
        .gpus(1)
        .model(preset="1.3b")
        .training(microBatch=8)
    )
    spec = loading.parse_spec(job.raw())
    mounted = profiles.from_mapping(calibrated)
    # the planner's own verdicts: the built-in H100 takes the job, the calibrated one does not
    assert admission.check(spec, profiles.get("h100-sxm")) is None
    assert admission.check(spec, mounted) is not None

    rendered = _rendered(
        str(control_plane_binaries.helm), {"operator": {"profiles": {"h100-sxm": calibrated}}}
    )
    [deployment] = [doc for (kind, _), doc in rendered.items() if kind == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    mount = next(m for m in container["volumeMounts"] if m["name"] == "profiles")
    volume = next(v for v in pod["volumes"] if v["name"] == "profiles")
    # the ConfigMap the volume names is one the chart renders
    config_map = rendered[("ConfigMap", volume["configMap"]["name"])]
    directory = tmp_path / "profiles"  # what the kubelet projects at the mount path
    directory.mkdir()
    for file, text in config_map["data"].items():
        (directory / file).write_text(text)
    env = {e["name"]: e["value"] for e in container["env"] if e.get("value") == mount["mountPath"]}
    assert list(env) == [profiles.ENV_VAR]

    cluster.add_node(pool, gpus=8, labels=H100)
    operator.stop()  # one operator at a time acts on a namespace
    judged = OperatorProcess(
        str(control_plane.kubeconfig_path),
        str(tmp_path / "operator.log"),
        scope=("--namespace", namespace),
        lease=f"profiles-{namespace}",
        env={profiles.ENV_VAR: str(directory)},
    )
    try:
        judged.start()
        cluster.apply(job)
        cluster.wait_phase(namespace, "calibrated", "Failed")
    finally:
        judged.stop()
        operator.start()
    message = cluster.condition(namespace, "calibrated", "WontFit")["message"]
    usable = f"{mounted.tensor_memory_bytes / 2**30:.2f} GiB for tensors"
    assert f"the GPU has {usable}" in message, message
    assert f"read from {directory / 'h100-sxm.yaml'}" in message, message
    assert cluster.pods(namespace, "calibrated") == []
