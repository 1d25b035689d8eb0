"""Admission by plan, table-driven: candidate nodes -> profile -> Admitted | Refused | unchecked."""

from __future__ import annotations

import pytest

from meshtrain import placement
from meshtrain.api import loading
from meshtrain.operator.policy import memory_admission, progress_status
from meshtrain.planner import admission, profiles
from meshtrain.sandbox import nodeconfig as sandbox_nodeconfig
from meshtrain.sandbox import supervisor as sandbox_supervisor
from tests.builders import JobBuilder

H100 = profiles.get("h100-sxm")
A100_40 = profiles.get("a100-40g")
H200 = profiles.get("h200")
CPU = profiles.get("cpu")

SEVEN_B_ONE_GPU = (
    JobBuilder().layout(gpus_per_node=1).model(preset="7b").training(precision="bf16").raw()
)
SEVEN_B_TP8 = (
    JobBuilder()
    .layout(tensor=8, gpus_per_node=8)
    .model(preset="7b")
    .training(precision="bf16")
    .raw()
)
TINY_FP32 = (
    JobBuilder().layout(data=2, pipeline=2, gpus_per_node=2).training(precision="fp32").raw()
)


def labelled(profile: profiles.Profile) -> admission.NodeProfile:
    return admission.NodeProfile(profile, "label nvidia.com/gpu.product")


def node(name: str, product: str | None = None, gpus: int = 8, **labels: str) -> placement.Node:
    if product:
        labels[admission.PRODUCT_LABEL] = product
    return placement.Node(name=name, allocatable_gpus=gpus, labels=labels)


@pytest.mark.parametrize(
    ("name", "selector", "nodes", "expected"),
    [
        ("every GPU node without a selector", {}, [node("a"), node("b")], ["a", "b"]),
        ("nodes without GPUs are not candidates", {}, [node("a", gpus=0), node("b")], ["b"]),
        (
            "the node selector narrows",
            {"pool": "x"},
            [node("a", pool="x"), node("b", pool="y"), node("c")],
            ["a"],
        ),
    ],
)
def test_candidates(name, selector, nodes, expected):
    spec = loading.parse_spec(JobBuilder().resources(nodeSelector=selector).raw())
    assert [n.name for n in memory_admission.candidates(spec, nodes)] == expected


@pytest.mark.parametrize(
    ("name", "node_profiles", "default", "expected", "source_has"),
    [
        (
            "a labelled node names the profile",
            [("n1", labelled(H200))],
            H100,
            "h200",
            "node n1: label nvidia.com/gpu.product",
        ),
        (
            "mixed GPUs: the smallest, whatever the order",
            [("n1", labelled(H100)), ("n2", labelled(A100_40)), ("n3", labelled(H200))],
            None,
            "a100-40g",
            "smallest of a100-40g, h100-sxm, h200",
        ),
        (
            "mixed GPUs reversed",
            [("n3", labelled(H200)), ("n2", labelled(A100_40)), ("n1", labelled(H100))],
            None,
            "a100-40g",
            "node n2",
        ),
        (
            "unknown products fall back to the default",
            [("n1", None), ("n2", None)],
            CPU,
            "cpu",
            "--gpu-profile cpu",
        ),
        ("no candidate at all: the default", [], H100, "h100-sxm", "--gpu-profile h100-sxm"),
        (
            "known wins over unknown",
            [("n1", None), ("n2", labelled(A100_40))],
            H100,
            "a100-40g",
            "node n2",
        ),
        (
            "no label and no default: nothing to judge by",
            [("n1", None)],
            None,
            None,
            "--gpu-profile is none",
        ),
    ],
)
def test_choose_profile(name, node_profiles, default, expected, source_has):
    choice = memory_admission.choose_profile(node_profiles, default)
    assert (choice.profile.name if choice.profile else None) == expected
    assert source_has in choice.source


@pytest.mark.parametrize(
    ("name", "raw", "profile", "verdict"),
    [
        ("7B on one 80 GB GPU won't fit", SEVEN_B_ONE_GPU, H100, "Refused"),
        ("the same 7B fits one 141 GB H200", SEVEN_B_ONE_GPU, H200, "Admitted"),
        ("7B split 8 ways fits 80 GB", SEVEN_B_TP8, H100, "Admitted"),
        ("7B split 8 ways fits 40 GB", SEVEN_B_TP8, A100_40, "Admitted"),
        ("the sandbox's tiny fp32 job fits a CPU worker", TINY_FP32, CPU, "Admitted"),
        ("tiny fp32 job judged by a GPU default fits too", TINY_FP32, H100, "Admitted"),
        ("no profile: not judged", SEVEN_B_ONE_GPU, None, None),
    ],
)
def test_admit(name, raw, profile, verdict):
    spec = loading.parse_spec(raw)
    choice = memory_admission.Choice(profile, "test")
    result = memory_admission.admit(spec, choice)
    assert (type(result).__name__ if result is not None else None) == verdict
    if result is not None:
        assert result.summary["profile"] == profile.name and result.summary["fits"] is (
            verdict == "Admitted"
        )
        assert result.summary["profileSource"] == "test"
        assert result.summary["memoryPerGpuBytes"] > 0 and result.summary["parameters"] > 0


def test_refusal_message_has_the_numbers_and_the_profile_source():
    spec = loading.parse_spec(SEVEN_B_ONE_GPU)
    refused = memory_admission.admit(
        spec, memory_admission.choose_profile([("gpu-7", labelled(H100))], None)
    )
    assert isinstance(refused, memory_admission.Refused) and refused.reason == "WontFit"
    assert "dp1·pp1·tp1 on h100-sxm" in refused.message and "GiB" in refused.message
    # nvidia-smi's 81559 MiB less the 2 GiB reserve
    assert "the GPU has 77.65 GiB for tensors (79.65 GiB less 2.00 GiB" in refused.message
    assert "node gpu-7" in refused.message
    assert refused.summary["memoryHeadroomBytes"] < 0


def test_sandbox_nodes_name_no_known_gpu_so_the_default_judges():
    node = sandbox_supervisor.NODES[0]
    manifest = {
        "metadata": {"name": node.name, "labels": sandbox_nodeconfig.node_labels(node)},
        "status": {"allocatable": {"nvidia.com/gpu": str(node.gpus), "cpu": "2", "memory": "8Gi"}},
    }
    found = placement.node_from_manifest(manifest, "nvidia.com/gpu")
    spec = loading.parse_spec(TINY_FP32)
    assert memory_admission.candidates(spec, [found]) == [found]
    assert admission.profile_for_labels(found.labels) is None
    judged = admission.node_profile(found.labels, CPU)
    choice = memory_admission.choose_profile([(found.name, judged)], CPU)
    assert choice.profile == CPU and "operator default --gpu-profile cpu" in choice.source
    assert "Sandbox-CPU names no built-in profile" in choice.source, choice.source
    assert isinstance(memory_admission.admit(spec, choice), memory_admission.Admitted)


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (None, {}),
        ("", {}),
        ("   \n", {}),
        (
            '{"step": 40, "loss": 2.0, "tokens_per_second": 10, "last_checkpoint_step": 40, "updated_at": "2026-01-01T00:00:00Z"}\n',
            {
                "progress": {
                    "step": 40,
                    "loss": 2.0,
                    "tokensPerSecond": 10.0,
                    "updatedAt": "2026-01-01T00:00:00Z",
                },
                "lastCheckpointStep": 40,
            },
        ),
        (
            "Traceback (most recent call last):\n  ...\nRuntimeError: boom\n",
            {},
        ),  # FallbackToLogsOnError: a log tail
        (
            'log line\n{"step": 12}\nanother line\n',
            {"progress": {"step": 12}},
        ),  # the last JSON object line
        ('{"step": 12', {}),  # truncated
        ("[1, 2]", {}),
        ('{"step": "forty"}', {}),
    ],
)
def test_final_progress_from_the_termination_message(message, expected):
    assert progress_status.from_termination_message(message) == expected
