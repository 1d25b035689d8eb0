"""The generated CRD on a real API server: kubectl explain, and invalid specs refused at apply time."""

from __future__ import annotations

import copy

import pytest
import yaml

from meshtrain.api import rules

pytestmark = pytest.mark.integration

VALID = {
    "apiVersion": "meshtrain.io/v1alpha1",
    "kind": "TrainingJob",
    "metadata": {"name": "bad"},
    "spec": {
        "parallelism": {"data": 2, "pipeline": 2, "tensor": 2},
        "resources": {"gpusPerNode": 4},
        "model": {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 64},
    },
}


def _rule(name: str) -> str:
    return next(r.cel_message for r in (*rules.RULES, rules.SHAPE_RULE) if r.name == name)


def _with(path: str, value) -> dict:
    body = copy.deepcopy(VALID)
    node = body
    *parents, last = path.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value
    return body


def _straggler_replace_with_data(data: int) -> dict:
    body = _with("spec.parallelism", {"data": data, "pipeline": 2, "tensor": 2})
    body["spec"]["checkpoint"] = {"claimName": "ckpt"}
    body["spec"]["runPolicy"] = {"stragglerPolicy": {"action": "replace"}}
    return body


def _sequence_parallel_with_odd_seq_len() -> dict:
    body = _with("spec.parallelism.sequenceParallel", True)
    body["spec"]["model"]["seqLen"] = 63
    return body


def _elastic_from_three_of_four() -> dict:
    body = _with("spec.parallelism", {"data": 4, "pipeline": 1, "tensor": 1, "microBatches": 1})
    body["spec"]["runPolicy"] = {"elastic": {"minData": 3, "maxData": 4}}  # 3 divides no batch of 4
    return body


def _kv_heads_and_tensor_coprime() -> dict:
    body = _with("spec.parallelism.tensor", 4)  # 6 kv heads: neither split nor replicated evenly
    body["spec"]["model"] = {
        **body["spec"]["model"],
        "family": "llama",
        "hidden": 96,
        "heads": 12,
        "kvHeads": 6,
    }
    return body


def _tied_across_stages_with_zero2() -> dict:
    body = _with("spec.parallelism.zeroStage", 2)
    body["spec"]["model"]["tieEmbeddings"] = True
    return body


INVALID = [
    (
        "kvHeads and tensor divide neither way",
        _kv_heads_and_tensor_coprime(),
        _rule("kv-heads-split-over-tensor"),
    ),
    (
        "embedding tied across stages under ZeRO-2",
        _tied_across_stages_with_zero2(),
        _rule("tied-embeddings-across-stages-unsharded"),
    ),
    (
        "tensor does not divide gpusPerNode",
        _with("spec.parallelism.tensor", 3),
        _rule("tensor-divides-gpus-per-node"),
    ),
    (
        "world not a multiple of gpusPerNode",
        _with("spec.resources.gpusPerNode", 16),
        _rule("world-multiple-of-gpus-per-node"),
    ),
    (
        "global batch arithmetic",
        _with("spec.training", {"globalBatch": 7}),
        _rule("global-batch-arithmetic"),
    ),
    (
        "virtual stages without interleaving",
        _with("spec.parallelism.virtualStages", 2),
        _rule("virtual-stages-need-interleaving"),
    ),
    (
        "interleaved micro-batches",
        _with(
            "spec.parallelism",
            {
                "data": 2,
                "pipeline": 2,
                "tensor": 2,
                "schedule": "interleaved-1f1b",
                "virtualStages": 2,
                "microBatches": 3,
            },
        ),
        _rule("interleaved-micro-batches"),
    ),
    ("layers over stages", _with("spec.model.layers", 3), _rule("layers-split-over-stages")),
    ("heads over tensor", _with("spec.model.heads", 3), _rule("heads-split-over-tensor")),
    ("hidden over heads", _with("spec.model.hidden", 66), _rule("hidden-split-over-heads")),
    ("ffn over tensor", _with("spec.model.ffnHidden", 255), _rule("ffn-split-over-tensor")),
    (
        "sequence parallel over tensor",
        _sequence_parallel_with_odd_seq_len(),
        _rule("sequence-split-over-tensor"),
    ),
    (
        "metrics ports over the rendezvous port",
        _with("spec.metrics", {"port": 29498}),
        _rule("metrics-ports-fit"),
    ),
    (
        "learning rate order",
        _with("spec.training", {"learningRate": 0.001, "minLearningRate": 0.01}),
        _rule("learning-rate-order"),
    ),
    (
        "elastic minData above maxData",
        _with("spec.runPolicy", {"elastic": {"minData": 2, "maxData": 1}}),
        _rule("elastic-bounds"),
    ),
    (
        "elastic bounds without the declared degree",
        _with("spec.runPolicy", {"elastic": {"minData": 4, "maxData": 8}}),
        _rule("elastic-holds-data"),
    ),
    (
        "elastic resizes without a checkpoint claim",
        _with("spec.runPolicy", {"elastic": {"minData": 1, "maxData": 2}}),
        _rule("elastic-keeps-checkpoints"),
    ),
    (
        "elastic minData that cannot keep the global batch",
        _elastic_from_three_of_four(),
        _rule("elastic-min-keeps-batch"),
    ),
    ("incomplete model shape", _with("spec.model", {"layers": 4}), _rule("model-shape-complete")),
    (
        "selective recompute beside full activation checkpointing",
        _with("spec.training", {"activationCheckpointing": True, "selectiveRecompute": ["mlp"]}),
        _rule("selective-or-full-recompute"),
    ),
    (
        "env name not a C identifier",
        _with("spec.pod", {"env": [{"name": "NCCL-IB-HCA", "value": "mlx5"}]}),
        "spec.pod.env[0].name in body should match",
    ),
    (
        "env credential as a plain value",
        _with("spec.pod", {"env": [{"name": "HF_TOKEN", "value": "hf_x"}]}),
        _rule("env-no-plain-secrets"),
    ),
    (
        "env overriding the operator's variables",
        _with("spec.pod", {"env": [{"name": "PET_NNODES", "value": "1"}]}),
        _rule("env-not-reserved"),
    ),
    (
        "env valueFrom with two sources",
        _with(
            "spec.pod",
            {
                "env": [
                    {
                        "name": "X",
                        "valueFrom": {
                            "fieldRef": {"fieldPath": "spec.nodeName"},
                            "secretKeyRef": {"name": "s", "key": "k"},
                        },
                    }
                ]
            },
        ),
        _rule("env-value-or-source"),
    ),
    (
        "custom trainer without a command",
        _with("spec.trainer", {"type": "custom"}),
        _rule("custom-trainer-command"),
    ),
    (
        "straggler replace without data-parallel peers",
        _straggler_replace_with_data(1),
        _rule("straggler-replace-needs-peers"),
    ),
    (
        "straggler replace without a checkpoint volume",
        _with("spec.runPolicy", {"stragglerPolicy": {"action": "replace"}}),
        _rule("straggler-replace-keeps-checkpoints"),
    ),
    (
        "straggler threshold not above 1",
        _with("spec.runPolicy", {"stragglerPolicy": {"threshold": 1}}),
        "should be greater than 1",
    ),
    (
        "pod label the operator selects by",
        _with("spec.pod", {"labels": {"meshtrain.io/attempt": "9"}}),
        _rule("labels-not-reserved"),
    ),
    (
        "the GPU resource asked again through extraResources",
        _with("spec.resources", {"gpusPerNode": 4, "extraResources": {"nvidia.com/gpu": "8"}}),
        _rule("extra-resources-leave-the-gpu-to-gpus-per-node"),
    ),
    (
        "unknown schedule (enum)",
        _with("spec.parallelism.schedule", "zero-bubble"),
        'Unsupported value: "zero-bubble"',
    ),
    (
        "elastic minimum resize interval above a day",
        _with(
            "spec.runPolicy",
            {"elastic": {"minData": 2, "maxData": 2, "minResizeIntervalSeconds": 86401}},
        ),
        "spec.runPolicy.elastic.minResizeIntervalSeconds: Invalid value: 86401",
    ),
    (
        "elastic grow stability negative",
        _with("spec.runPolicy", {"elastic": {"minData": 2, "maxData": 2, "growStableSeconds": -1}}),
        "spec.runPolicy.elastic.growStableSeconds: Invalid value: -1",
    ),
    (
        "data below its minimum",
        _with("spec.parallelism.data", 0),
        "should be greater than or equal to 1",
    ),
    (
        "name too long",
        _with("metadata.name", "x" * 41),
        "metadata.name must be at most 40 characters",
    ),
]


def test_kubectl_explain_shows_the_model_descriptions(cluster):
    result = cluster.kubectl("explain", "trainingjob.spec.parallelism")
    assert result.returncode == 0, result.stderr
    assert "Tensor-parallel degree" in result.stdout
    assert "Pipeline schedule" in result.stdout
    short = cluster.kubectl("explain", "tj.spec.runPolicy.backoffLimit")
    assert "Gang restarts allowed before the job fails" in short.stdout


def test_a_valid_job_is_accepted_with_defaults(cluster, namespace):
    body = _with("metadata.name", "good")
    result = cluster.kubectl(
        "apply",
        "--dry-run=server",
        "-n",
        namespace,
        "-o",
        "yaml",
        "-f",
        "-",
        stdin=yaml.safe_dump(body),
    )
    assert result.returncode == 0, result.stderr
    stored = yaml.safe_load(result.stdout)
    assert stored["spec"]["parallelism"]["schedule"] == "1f1b"
    assert stored["spec"]["runPolicy"]["backoffLimit"] == 3
    assert stored["spec"]["resources"]["gpuResourceName"] == "nvidia.com/gpu"


@pytest.mark.parametrize(("case", "body", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_by_kubectl_apply(cluster, namespace, case, body, message):
    result = cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body)
    )
    assert result.returncode != 0, f"{case}: accepted"
    assert message in result.stderr, result.stderr


def test_model_is_immutable_but_the_layout_may_change(cluster, namespace):
    body = _with("metadata.name", "fixedmodel")
    created = cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body)
    )
    assert created.returncode == 0, created.stderr
    reshaped = cluster.kubectl(
        "patch",
        "tj",
        "fixedmodel",
        "-n",
        namespace,
        "--type",
        "merge",
        "-p",
        '{"spec": {"parallelism": {"data": 1}, "resources": {"gpusPerNode": 4}}}',
    )
    assert reshaped.returncode == 0, reshaped.stderr
    grown = cluster.kubectl(
        "patch",
        "tj",
        "fixedmodel",
        "-n",
        namespace,
        "--type",
        "merge",
        "-p",
        '{"spec": {"model": {"layers": 8}}}',
    )
    assert grown.returncode != 0, "a change of spec.model was accepted"
    assert "spec.model is immutable" in grown.stderr, grown.stderr
