"""The planner's edges: the JSON schema, the text report, profiles, cluster files, the CLI, admission."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.cli import main
from meshtrain.planner import admission, cluster, estimate, profiles, report
from tests.builders import JobBuilder

GOLDEN_KEYS = {
    "": [
        "batch",
        "communication",
        "confidence",
        "failures",
        "job",
        "memory",
        "model",
        "placement",
        "profile",
        "schema",
        "time",
        "warnings",
    ],
    "job": [
        "activation_checkpointing",
        "gpus_per_node",
        "layout",
        "micro_batch",
        "micro_batches",
        "pods",
        "precision",
        "recipe",
        "schedule",
        "sequence_parallel",
        "virtual_stages",
        "world_size",
        "zero_stage",
    ],
    "failures": [
        "failure_rate_per_gpu_hour",
        "failure_rate_source",
        "gpus",
        "memory",
        "memory_share",
        "mtbf_seconds",
        "step_seconds",
        "storage",
        "storage_interval_steps_beside_memory",
    ],
    "failures.storage": [
        "configured_goodput",
        "configured_interval_steps",
        "daly_interval_seconds",
        "expected_goodput",
        "interval_steps",
        "reload_seconds",
        "restart_seconds",
        "save_seconds",
        "save_source",
        "young_interval_seconds",
    ],
    "model": [
        "ffn_hidden",
        "flops_per_token",
        "heads",
        "hidden",
        "layers",
        "parameters",
        "parameters_per_rank_max",
        "seq_len",
        "vocab",
    ],
    "profile": [
        "achievable_fraction",
        "calibrated",
        "calibration",
        "cores",
        "memory_bandwidth",
        "memory_bytes",
        "name",
        "nic_bandwidth",
        "nic_latency",
        "nvlink_bandwidth",
        "nvlink_latency",
        "op_overhead",
        "peak_flops",
        "reserved_bytes",
        "source",
    ],
    "memory": [
        "bytes_per_param",
        "capacity_bytes",
        "fits",
        "headroom_bytes",
        "peak_bytes",
        "per_stage",
        "reserved_bytes",
        "worst_stage",
    ],
    "memory.bytes_per_param": ["grads", "optimizer", "weights"],
    "memory.per_stage[]": [
        "activations_bytes",
        "grads_bytes",
        "in_flight_microbatches",
        "optimizer_bytes",
        "parameters",
        "stage",
        "total_bytes",
        "weight_casts_bytes",
        "weights_bytes",
    ],
    "communication": ["links", "per_stage"],
    "communication.links": ["dp", "pp", "tp"],
    "communication.per_stage[]": ["collectives", "groups", "stage"],
    "communication.per_stage[].groups.dp": ["link", "payload_bytes", "seconds", "wire_bytes"],
    "communication.per_stage[].collectives[]": [
        "after_backward",
        "calls",
        "group",
        "members",
        "op",
        "payload_bytes",
        "wire_bytes",
    ],
    "time": [
        "available_cores",
        "bubble",
        "compute_comm_ratio",
        "compute_seconds",
        "cpu_seconds",
        "dependency_seconds",
        "dp_exposed_seconds",
        "dp_seconds",
        "mfu",
        "optimizer_seconds",
        "overhead_seconds",
        "oversubscription",
        "pacing_stage",
        "pipeline_seconds",
        "pp_seconds",
        "predicted_bubble",
        "rank_flops",
        "step_seconds",
        "tokens_per_second",
        "tp_seconds",
        "verdict",
        "work_bound",
    ],
    "batch": [
        "critical_batch_tokens",
        "global_batch",
        "gradient_noise_scale",
        "tokens_per_step",
        "warning",
    ],
    "placement": ["domains_used", "level_bytes", "message", "nodes", "reason", "schedulable"],
}

CLUSTER = textwrap.dedent("""\
    nodes:
      - name: a1
        gpus: 4
        labels: {network.topology.nvidia.com/block: b1, network.topology.nvidia.com/leaf: l1}
      - name: a2
        gpus: 4
        labels: {network.topology.nvidia.com/block: b1, network.topology.nvidia.com/leaf: l1}
      - name: c1
        gpus: 4
        labels: {network.topology.nvidia.com/block: b2, network.topology.nvidia.com/leaf: l9}
""")


def _job(tmp_path: Path, raw: dict | None = None) -> Path:
    raw = raw or JobBuilder().layout(2, 2, 2, gpus_per_node=4).parallelism(microBatches=4).raw()
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "t"},
                "spec": raw,
            }
        )
    )
    return path


def _plan(raw: dict, gpu: str = "h100-sxm", nodes=None) -> estimate.Plan:
    return estimate.make_plan(loading.parse_spec(raw), profiles.get(gpu), nodes=nodes)


def _value(doc: dict, path: str):
    node = doc
    for part in filter(None, path.split(".")):
        many = part.endswith("[]")
        node = node[part.removesuffix("[]")]
        if many:
            node = node[0]
    return node


# --- JSON schema ---------------------------------------------------------------------------------


def test_json_schema_keys_are_stable() -> None:
    raw = JobBuilder().layout(2, 2, 2, gpus_per_node=4).parallelism(microBatches=4).raw()
    doc = report.to_json(_plan(raw, nodes=cluster.parse_text(CLUSTER)))
    assert doc["schema"] == "meshtrain.plan/v1"
    for path, keys in GOLDEN_KEYS.items():
        assert sorted(_value(doc, path)) == keys, path
    json.dumps(doc, allow_nan=False)  # strict JSON: no inf/nan


def test_json_without_cluster_has_null_placement_and_documented_keys() -> None:
    doc = report.to_json(_plan(JobBuilder().raw(), gpu="cpu"))
    assert doc["placement"] is None
    documented = Path(__file__).parents[2].joinpath("docs/planner.md").read_text()
    for path, keys in GOLDEN_KEYS.items():
        for key in keys:
            assert f"`{key}`" in documented, f"docs/planner.md does not document {path}.{key}"


def test_text_report_has_every_section() -> None:
    raw = JobBuilder().layout(2, 2, 2, gpus_per_node=4).parallelism(microBatches=4).raw()
    text = report.to_text(_plan(raw, nodes=cluster.parse_text(CLUSTER)))
    for needle in (
        "parameters",
        "memory per GPU",
        "headroom",
        "communication per rank",
        "pipeline bubble",
        "compute/communication ratio",
        "global batch",
        "placement",
        "pod 1",
        "bytes per step crossing",
    ):
        assert needle in text


# --- warnings and admission ----------------------------------------------------------------------


def test_critical_batch_warning() -> None:
    raw = (
        JobBuilder()
        .layout(64, 1, 1, gpus_per_node=8)
        .model(preset="1.3b")
        .training(microBatch=64)
        .raw()
    )
    plan = _plan(raw)
    assert plan.batch.tokens == 64 * 64 * 2048
    assert plan.batch.warning and "critical batch" in plan.batch.warning
    assert not _plan(JobBuilder().raw()).batch.warning


def test_admission_refuses_a_7b_model_on_one_a100_40g_with_numbers() -> None:
    job = loading.parse_spec(JobBuilder().layout(2, 1, 1, gpus_per_node=2).model(preset="7b").raw())
    verdict = admission.check(job, profiles.get("a100-40g"))
    assert isinstance(verdict, admission.WontFit)
    assert verdict.reason == "WontFit" and verdict.needed_bytes > verdict.capacity_bytes
    for needle in ("40.00 GiB", "weights", "optimizer", "activations", "parallelism.tensor"):
        assert needle in verdict.message
    sharded = loading.parse_spec(
        JobBuilder().layout(1, 4, 8, gpus_per_node=8).model(preset="7b").raw()
    )
    assert admission.check(sharded, profiles.get("h100-sxm")) is None


def test_refusal_names_the_single_changes_that_would_fit() -> None:
    job = loading.parse_spec(
        JobBuilder().layout(1, 1, 1).model(preset="1.3b").training(microBatch=16).raw()
    )
    l40s = profiles.get("l40s")
    verdict = admission.check(job, l40s)
    assert isinstance(verdict, admission.WontFit)
    remedies = dict(admission.fitting_remedies(job, l40s))
    assert set(remedies) == {"training.activationCheckpointing=true", "training.microBatch=1"}
    recomputed = loading.apply_overrides(job, ["training.activationCheckpointing=true"])
    assert admission.check(recomputed, l40s) is None
    assert (
        f"training.activationCheckpointing=true ({remedies['training.activationCheckpointing=true'] / 2**30:.2f} GiB)"
        in verdict.message
    )


def test_status_summary_is_json_ready() -> None:
    summary = admission.status_summary(_plan(JobBuilder().layout(2, 1, 2, gpus_per_node=4).raw()))
    assert {
        "memoryPerGpuBytes",
        "memoryHeadroomBytes",
        "stepSeconds",
        "bubbleRatio",
        "verdict",
        "fits",
    } <= set(summary)
    json.dumps(summary, allow_nan=False)


def test_profile_from_node_labels() -> None:
    assert (
        admission.profile_for_labels({"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}).name
        == "h100-sxm"
    )
    assert (
        admission.profile_for_labels({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}).name
        == "a100-80g"
    )
    assert (
        admission.profile_for_labels({"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}).name
        == "a100-40g"
    )
    assert admission.profile_for_labels({}) is None
    # not the devices of the built-in profiles: a MIG slice, a Grace Hopper superchip
    for product in ("NVIDIA-H100-80GB-HBM3-MIG-1g.10gb", "NVIDIA-GH200-480GB"):
        assert admission.profile_for_labels({"nvidia.com/gpu.product": product}) is None, product


def test_a_node_is_judged_with_the_memory_its_labels_report() -> None:
    """GPU feature discovery's labels: a MIG slice gets the default profile at the slice's memory."""
    h100 = profiles.get("h100-sxm")
    slice_labels = {
        "nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb",
        "nvidia.com/gpu.memory": "9984",
    }
    judged = admission.node_profile(slice_labels, h100)
    assert judged is not None and judged.profile.memory_bytes == 9984 * 2**20
    assert judged.profile.reserved_bytes == h100.reserved_bytes
    assert judged.why == (
        "operator default --gpu-profile h100-sxm (nvidia.com/gpu.product="
        "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb names no built-in profile), "
        "at nvidia.com/gpu.memory=9984 MiB"
    )
    sliced = judged.profile
    whole = {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3", "nvidia.com/gpu.memory": "81559"}
    assert admission.node_profile(whole, None) == admission.NodeProfile(
        h100, "label nvidia.com/gpu.product=NVIDIA-H100-80GB-HBM3"
    )  # the label agrees with the profile
    # MIG's mixed strategy: the node's labels are the whole GPU's, the slice is a resource
    mixed = {**whole, "nvidia.com/mig-1g.10gb.memory": "9984"}
    as_slice = admission.node_profile(mixed, h100, "nvidia.com/mig-1g.10gb")
    assert as_slice is not None and as_slice.profile.memory_bytes == 9984 * 2**20
    assert "nvidia.com/mig-1g.10gb is a MIG slice" in as_slice.why
    unknown = {"nvidia.com/gpu.product": "NVIDIA-B300"}  # no built-in, no memory label
    assert admission.node_profile(unknown, h100).profile == h100
    assert admission.node_profile(unknown, None) is None  # --gpu-profile none: unchecked
    assert admission.node_profile({}, h100) is None  # names no GPU: the operator's default path
    # a job the whole GPU takes is refused on the slice
    job = loading.parse_spec(JobBuilder().model(preset="1.3b").layout(data=1).gpus(1).raw())
    assert admission.check(job, h100) is None and admission.check(job, sliced) is not None


# --- profiles ------------------------------------------------------------------------------------


def test_builtin_profiles_have_sources() -> None:
    known = profiles.load_all()
    assert {"h100-sxm", "h200", "a100-80g", "a100-40g", "l40s", "cpu"} <= set(known)
    assert known["h100-sxm"].peak_flops == pytest.approx(989e12)
    assert known["h200"].memory_bytes > known["h100-sxm"].memory_bytes
    assert all(p.source for p in known.values())


def test_numbers_as_helm_prints_them_load(tmp_path: Path) -> None:
    """Helm's toYaml writes 2e-05 (no dot), which YAML 1.1 reads as a string."""
    text = (profiles.BUILTIN_DIR / "h100-sxm.yaml").read_text()
    path = tmp_path / "h100-sxm.yaml"
    path.write_text(text + "op_overhead: 2e-05\ncores: 0\n")
    assert isinstance(yaml.safe_load(path.read_text())["op_overhead"], str)
    assert profiles.load_file(path).op_overhead == 2e-05


def test_unknown_profile_lists_the_known_ones() -> None:
    with pytest.raises(
        profiles.ProfileError, match="known profiles: a100-40g, a100-80g, cpu, h100-sxm"
    ):
        profiles.get("h99")


def test_user_profiles_from_a_directory_and_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = yaml.safe_load(profiles.BUILTIN_DIR.joinpath("h100-sxm.yaml").read_text())
    (tmp_path / "mine.yaml").write_text(
        yaml.safe_dump({**base, "name": "b200ish", "peak_flops": 2.2e15})
    )
    assert profiles.get("b200ish", [tmp_path]).peak_flops == 2.2e15
    monkeypatch.setenv(profiles.ENV_VAR, str(tmp_path))
    assert "b200ish" in profiles.load_all()


@pytest.mark.parametrize(
    "change,message",
    [
        ({"peak_flops": -1}, "'peak_flops' must be a positive number"),
        ({"achievable_fraction": 1.5}, "must be <= 1"),
        ({"source": ""}, "'source' must be a non-empty string"),
        ({"colour": "green"}, "unknown key"),
        ({"precision": "fp8"}, "'precision' must be bf16 or fp32"),
        ({"reserved_bytes": -1}, "'reserved_bytes' must be a number >= 0"),
        ({"reserved_bytes": 9e10}, "'reserved_bytes' .* must be less than 'memory_bytes'"),
    ],
)
def test_malformed_profiles_are_refused(tmp_path: Path, change: dict, message: str) -> None:
    base = yaml.safe_load(profiles.BUILTIN_DIR.joinpath("h100-sxm.yaml").read_text())
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({**base, **change}))
    with pytest.raises(profiles.ProfileError, match=message):
        profiles.load_file(path)


# --- cluster files -------------------------------------------------------------------------------


def test_cluster_file_parses() -> None:
    nodes = cluster.parse_text(CLUSTER)
    assert [n.name for n in nodes] == ["a1", "a2", "c1"]
    assert (
        nodes[0].allocatable_gpus == 4
        and nodes[2].labels["network.topology.nvidia.com/leaf"] == "l9"
    )
    assert [n.name for n in cluster.parse_text("- {name: x, gpus: 8}")] == ["x"]


@pytest.mark.parametrize(
    "text,message",
    [
        ("nodes: []", "non-empty list of nodes"),
        (
            "nodes:\n  - name: a\n    gpus: 8\n  - name: b\n    gpus: eight\n",
            r"nodes\[1\] 'b' \(line 5\): 'gpus' must be an integer",
        ),
        ("nodes:\n  - gpus: 8\n", r"nodes\[0\] \(line 2\): 'name' must be a non-empty string"),
        (
            "nodes:\n  - {name: a, gpus: 1}\n  - {name: a, gpus: 1}\n",
            r"duplicate node name \(first at nodes\[0\]\)",
        ),
        ("nodes:\n  - {name: a, gpus: 1, colour: red}\n", "unknown key"),
        ("nodes:\n  - {name: a, gpus: 1, labels: [x]}\n", "'labels' must be a mapping"),
        ("nodes: [\n", "not valid YAML"),
        ("machines: []", "unknown top-level key"),
    ],
)
def test_malformed_cluster_files_name_the_entry_and_line(text: str, message: str) -> None:
    with pytest.raises(cluster.ClusterError, match=message):
        cluster.parse_text(text, "c.yaml")


def test_missing_cluster_file(tmp_path: Path) -> None:
    with pytest.raises(cluster.ClusterError, match="cannot read cluster file"):
        cluster.load(tmp_path / "nope.yaml")


# --- the command ---------------------------------------------------------------------------------


def test_cli_plan_text_json_and_placement(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path)
    (tmp_path / "cluster.yaml").write_text(CLUSTER)
    assert (
        main.main(
            ["plan", str(job), "--gpu", "a100-80g", "--cluster", str(tmp_path / "cluster.yaml")]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "a100-80g" in out and "pod 0" in out and "-> a" in out
    assert main.main(["plan", str(job), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "meshtrain.plan/v1" and doc["profile"]["name"] == "h100-sxm"


def test_cli_plan_uses_the_jobs_measured_noise_scale(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path)
    document = yaml.safe_load(job.read_text())
    sequences = loading.parse_spec(document["spec"]).global_batch
    document["status"] = {"progress": {"step": 40, "gradientNoiseScale": sequences / 20}}
    job.write_text(yaml.safe_dump(document))  # as `kubectl get tj NAME -o yaml` writes it
    assert main.main(["plan", str(job), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["batch"]["gradient_noise_scale"] == pytest.approx(sequences / 20)
    assert "20x the job's measured gradient noise scale" in doc["batch"]["warning"]
    assert doc["batch"]["warning"] in doc["warnings"]
    assert main.main(["plan", str(job)]) == 0
    assert "measured gradient noise scale" in capsys.readouterr().out


def test_cli_plan_tries_spec_changes_with_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = _job(tmp_path)
    assert main.main(["plan", str(job), "--json"]) == 0
    before = json.loads(capsys.readouterr().out)
    assert (
        main.main(["plan", str(job), "--json", "--set", "training.activationCheckpointing=true"])
        == 0
    )
    after = json.loads(capsys.readouterr().out)
    assert (
        not before["job"]["activation_checkpointing"] and after["job"]["activation_checkpointing"]
    )
    assert after["memory"]["peak_bytes"] < before["memory"]["peak_bytes"]


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "parallelism.tensor=3"], "spec.parallelism.tensor"),
        (["--gpu", "h99"], "unknown GPU profile 'h99'; known profiles:"),
        (["--cluster", "missing.yaml"], "cannot read cluster file"),
        (["--critical-batch-tokens", "0"], "--critical-batch-tokens must be >= 1"),
    ],
)
def test_cli_plan_errors(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    assert main.main(["plan", str(_job(tmp_path)), *args]) == 2
    assert message in capsys.readouterr().err


def test_cli_plan_refuses_an_invalid_job(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = JobBuilder().layout(2, 1, 3, gpus_per_node=4).raw()
    assert main.main(["plan", str(_job(tmp_path, bad))]) == 2
    assert "spec.parallelism.tensor" in capsys.readouterr().err


def test_cli_plan_reports_an_unschedulable_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "small.yaml").write_text("- {name: only, gpus: 4}\n")
    # 4 (UNSCHEDULABLE), no longer 0: "the cluster may free nodes" is no reason to say success to a
    # script or CI gate asking whether the job runs on these nodes (issue #37 review); the report
    # still prints and says why
    assert main.main(["plan", str(_job(tmp_path)), "--cluster", str(tmp_path / "small.yaml")]) == 4
    out, err = capsys.readouterr()
    assert "unschedulable" in out and "cannot be placed on these nodes (exit 4)" in err
