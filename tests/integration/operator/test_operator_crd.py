"""The generated CRD on a real API server: kubectl explain, and invalid specs refused at apply time."""

from __future__ import annotations

import pytest
import yaml

from meshtrain.api import loading, rules
from meshtrain.api.spec import run_policy
from meshtrain.trainer.guards import faults
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration


def _valid(name: str = "bad") -> JobBuilder:
    """dp2 x pp2 x tp2 on pods of 4 GPUs, an explicit small shape; no namespace (kubectl's -n)."""
    shape = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 64}
    return JobBuilder(name, None).layout(data=2, pipeline=2, tensor=2, gpus_per_node=4).model(shape)


def _rule(name: str) -> str:
    return next(r.cel_message for r in (*rules.RULES, rules.SHAPE_RULE) if r.name == name)


def _dry_run(cluster, namespace: str, body: dict):
    """``kubectl apply --dry-run=server`` of ``body``: the object as the API server would store it."""
    return cluster.kubectl(
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


INVALID = [
    (
        "an exact warm-up before ZeRO-3's 16-bit reduce-scatter",
        _valid()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=3, gradientCompression={"mode": "bf16", "warmupSteps": 5})
        .manifest(),
        _rule("zero3-casts-have-no-warmup"),
    ),
    (
        "PowerSGD on ZeRO-2's every-micro-batch reduce-scatter",
        _valid()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=2, microBatches=4, gradientCompression={"mode": "powersgd"})
        .manifest(),
        _rule("zero2-whole-bucket-modes-once-per-step"),
    ),
    (
        "sequence not divisible by 2 x context",
        _valid().parallelism(context=2).model(seqLen=66).gpus(8).manifest(),
        _rule("sequence-split-over-context"),
    ),
    (
        "context parallelism with the hierarchical all-reduce",
        _valid().parallelism(context=2, allReduce="hierarchical").gpus(8).manifest(),
        _rule("context-parallel-supported"),
    ),
    (
        "world with context not a multiple of gpusPerNode",
        _valid().parallelism(context=3).gpus(16).manifest(),
        _rule("world-multiple-of-gpus-per-node"),
    ),
    (
        "kvHeads and tensor divide neither way",
        _valid()
        .parallelism(tensor=4)  # 6 kv heads: neither split nor replicated evenly
        .model(family="llama", hidden=96, heads=12, kvHeads=6)
        .manifest(),
        _rule("kv-heads-split-over-tensor"),
    ),
    (
        "embedding tied across stages under ZeRO-2",
        _valid().parallelism(zeroStage=2).model(tieEmbeddings=True).manifest(),
        _rule("tied-embeddings-across-stages-unsharded"),
    ),
    (
        "tensor does not divide gpusPerNode",
        _valid().parallelism(tensor=3).manifest(),
        _rule("tensor-divides-gpus-per-node"),
    ),
    (
        "world not a multiple of gpusPerNode",
        _valid().gpus(16).manifest(),
        _rule("world-multiple-of-gpus-per-node"),
    ),
    (
        "global batch arithmetic",
        _valid().training(globalBatch=7).manifest(),
        _rule("global-batch-arithmetic"),
    ),
    (
        "virtual stages without interleaving",
        _valid().parallelism(virtualStages=2).manifest(),
        _rule("virtual-stages-need-interleaving"),
    ),
    (
        "interleaved micro-batches",
        _valid()
        .parallelism(schedule="interleaved-1f1b", virtualStages=2, microBatches=3)
        .manifest(),
        _rule("interleaved-micro-batches"),
    ),
    (
        "DRA claims beside another GPU extended resource name",
        _valid().dra("gpu.nvidia.com").resources(gpuResourceName="amd.com/gpu").manifest(),
        _rule("dra-leaves-gpu-resource-name"),
    ),
    (
        "DRA claims beside a GPU in extraResources",
        _valid().dra("gpu.nvidia.com").resources(extraResources={"amd.com/gpu": "1"}).manifest(),
        _rule("dra-extra-resources-leave-the-gpus"),
    ),
    ("layers over stages", _valid().model(layers=3).manifest(), _rule("layers-split-over-stages")),
    ("heads over tensor", _valid().model(heads=3).manifest(), _rule("heads-split-over-tensor")),
    ("hidden over heads", _valid().model(hidden=66).manifest(), _rule("hidden-split-over-heads")),
    ("ffn over tensor", _valid().model(ffnHidden=255).manifest(), _rule("ffn-split-over-tensor")),
    (
        "sequence parallel over tensor",
        _valid().parallelism(sequenceParallel=True).model(seqLen=63).manifest(),
        _rule("sequence-split-over-tensor"),
    ),
    (
        "metrics ports over the rendezvous port",
        _valid().metrics(port=29498).manifest(),
        _rule("metrics-ports-fit"),
    ),
    (
        "learning rate order",
        _valid().training(learningRate=0.001, minLearningRate=0.01).manifest(),
        _rule("learning-rate-order"),
    ),
    (
        "elastic minData above maxData",
        _valid().run_policy(elastic={"minData": 2, "maxData": 1}).manifest(),
        _rule("elastic-bounds"),
    ),
    (
        "elastic bounds without the declared degree",
        _valid().run_policy(elastic={"minData": 4, "maxData": 8}).manifest(),
        _rule("elastic-holds-data"),
    ),
    (
        "elastic resizes without a checkpoint claim",
        _valid().run_policy(elastic={"minData": 1, "maxData": 2}).manifest(),
        _rule("elastic-keeps-checkpoints"),
    ),
    (
        "elastic minData that cannot keep the global batch",
        _valid()
        .parallelism(data=4, pipeline=1, tensor=1, microBatches=1)
        .run_policy(elastic={"minData": 3, "maxData": 4})  # 3 divides no batch of 4
        .manifest(),
        _rule("elastic-min-keeps-batch"),
    ),
    (
        "incomplete model shape",
        _valid().model({"layers": 4}).manifest(),
        _rule("model-shape-complete"),
    ),
    (
        "selective recompute beside full activation checkpointing",
        _valid().training(activationCheckpointing=True, selectiveRecompute=["mlp"]).manifest(),
        _rule("selective-or-full-recompute"),
    ),
    (
        "document mask on the built-in byte corpus",
        _valid().training(documentMask=True).manifest(),
        _rule("documents-known"),
    ),
    (
        "epochs over weighted datasets",
        _valid()
        .training(sampling="epochs", datasets=[{"path": "/data/a.bin", "weight": 2.0}])
        .manifest(),
        _rule("epochs-without-weights"),
    ),
    (
        "env name not a C identifier",
        _valid().pod(env=[{"name": "NCCL-IB-HCA", "value": "mlx5"}]).manifest(),
        "spec.pod.env[0].name in body should match",
    ),
    (
        "env credential as a plain value",
        _valid().pod(env=[{"name": "HF_TOKEN", "value": "hf_x"}]).manifest(),
        _rule("env-no-plain-secrets"),
    ),
    (
        "env choosing the GPUs a container sees",
        _valid().pod(env=[{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]).manifest(),
        _rule("env-no-gpu-visibility"),
    ),
    (
        "env overriding the operator's variables",
        _valid().pod(env=[{"name": "PET_NNODES", "value": "1"}]).manifest(),
        _rule("env-not-reserved"),
    ),
    (
        "env valueFrom with two sources",
        _valid()
        .pod(
            env=[
                {
                    "name": "X",
                    "valueFrom": {
                        "fieldRef": {"fieldPath": "spec.nodeName"},
                        "secretKeyRef": {"name": "s", "key": "k"},
                    },
                }
            ]
        )
        .manifest(),
        _rule("env-value-or-source"),
    ),
    (
        "custom trainer without a command",
        _valid().trainer(type="custom").manifest(),
        _rule("custom-trainer-command"),
    ),
    (
        "progress port for the built-in trainer",
        _valid().trainer(progressPort=9500).manifest(),
        _rule("custom-trainer-progress-port"),
    ),
    (
        "straggler replace without data-parallel peers",
        _valid()
        .parallelism(data=1)
        .checkpoint(claimName="ckpt")
        .run_policy(stragglerPolicy={"action": "replace"})
        .manifest(),
        _rule("straggler-replace-needs-peers"),
    ),
    (
        "straggler replace without a checkpoint volume",
        _valid().run_policy(stragglerPolicy={"action": "replace"}).manifest(),
        _rule("straggler-replace-keeps-checkpoints"),
    ),
    (
        "straggler threshold not above 1",
        _valid().run_policy(stragglerPolicy={"threshold": 1}).manifest(),
        "should be greater than 1",
    ),
    (
        "more warm spares than a pod's ranks",
        _valid().run_policy(recovery={"warmSpares": 5}).manifest(),
        _rule("warm-spares-fit"),
    ),
    (
        "in-place budget past its bound",
        _valid().run_policy(recovery={"inPlaceLimit": 10001}).manifest(),
        "spec.runPolicy.recovery.inPlaceLimit: Invalid value: 10001",
    ),
    (
        "pod label the operator selects by",
        _valid().pod(labels={"meshtrain.io/attempt": "9"}).manifest(),
        _rule("labels-not-reserved"),
    ),
    (
        "pod annotation of Kueue's",
        _valid().pod(annotations={"kueue.x-k8s.io/workload": "w"}).manifest(),
        _rule("annotations-not-reserved"),
    ),
    (
        "the GPU resource asked again through extraResources",
        _valid().resources(extraResources={"nvidia.com/gpu": "8"}).manifest(),
        _rule("extra-resources-leave-the-gpu-to-gpus-per-node"),
    ),
    (
        "unknown schedule (enum)",
        _valid().parallelism(schedule="zero-bubble").manifest(),
        'Unsupported value: "zero-bubble"',
    ),
    (
        "elastic minimum resize interval above a day",
        _valid()
        .run_policy(elastic={"minData": 2, "maxData": 2, "minResizeIntervalSeconds": 86401})
        .manifest(),
        "spec.runPolicy.elastic.minResizeIntervalSeconds: Invalid value: 86401",
    ),
    (
        "elastic grow stability negative",
        _valid()
        .run_policy(elastic={"minData": 2, "maxData": 2, "growStableSeconds": -1})
        .manifest(),
        "spec.runPolicy.elastic.growStableSeconds: Invalid value: -1",
    ),
    (
        "data below its minimum",
        _valid().parallelism(data=0).manifest(),
        "should be greater than or equal to 1",
    ),
    (
        "a stage-scoped level only preferred",
        _valid().topology(levels=[{"label": "example.com/rack", "scope": "stage"}]).manifest(),
        _rule("stage-scope-required"),
    ),
    (
        "a wait on a required level",
        _valid()
        .topology(levels=[{"label": "example.com/rack", "mode": "required", "waitSeconds": 30}])
        .manifest(),
        _rule("wait-preferred-only"),
    ),
    (
        "a wait above an hour",
        _valid().topology(levels=[{"label": "example.com/rack", "waitSeconds": 3601}]).manifest(),
        "spec.topology.levels[0].waitSeconds: Invalid value: 3601",
    ),
    (
        "a stage-scoped level where stages share pods",
        _valid()
        .layout(data=1, pipeline=2, tensor=2, gpus_per_node=4)
        .topology(levels=[{"label": "example.com/rack", "mode": "required", "scope": "stage"}])
        .manifest(),
        _rule("stage-scope-fills-pods"),
    ),
    (
        "the NVLink-domain label above a fabric level",
        _valid()
        .topology(
            nvlinkDomainLabel="nvidia.com/gpu.clique",
            levels=[{"label": "nvidia.com/gpu.clique"}, {"label": "example.com/rack"}],
        )
        .manifest(),
        _rule("nvlink-domain-level-last"),
    ),
    (
        "name too long",
        _valid("x" * 41).manifest(),
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
    body = _valid("good").manifest()
    result = _dry_run(cluster, namespace, body)
    assert result.returncode == 0, result.stderr
    stored = yaml.safe_load(result.stdout)
    assert stored["spec"]["parallelism"]["schedule"] == "1f1b"
    assert stored["spec"]["runPolicy"]["backoffLimit"] == 3
    assert stored["spec"]["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    # the API server's defaults (the CRD's schema) are the spec model's, every field of them
    recovery = stored["spec"]["runPolicy"]["recovery"]
    assert recovery == run_policy.Recovery().model_dump(by_alias=True, mode="json")


def test_a_custom_program_may_declare_its_progress_port(cluster, namespace):
    body = _valid("own").trainer(type="custom", command=["train"], progressPort=9500).manifest()
    result = _dry_run(cluster, namespace, body)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["spec"]["trainer"]["progressPort"] == 9500


def test_a_chaos_drills_fault_injection_env_is_accepted_and_the_operators_is_not(
    cluster, namespace
):
    """The trainer's fault-injection variables are the job's own to set (``pod.FAULT_ENV_NAMES``,
    named from the trainer's ``faults`` module); the operator's ``MESHTRAIN_*`` stay refused by
    the API server and the model alike."""
    drill = [
        {"name": faults.ENV, "value": "1:8:device"},
        {"name": faults.NODE_ENV, "value": "gpu-b0-l0-n0"},
        {"name": faults.SLOW_ENV, "value": "1:1.5"},
    ]
    body = _valid("drill").pod(env=drill).manifest()
    result = _dry_run(cluster, namespace, body)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["spec"]["pod"]["env"] == drill
    own = _valid("own-env").pod(env=[*drill, {"name": "MESHTRAIN_SPEC_FILE", "value": "/x"}])
    refused = _dry_run(cluster, namespace, own.manifest())
    assert refused.returncode != 0, refused.stdout
    assert "MESHTRAIN_*" in refused.stderr, refused.stderr
    loading.parse_spec(_valid("drill").pod(env=drill).raw())  # the model agrees
    with pytest.raises(loading.SpecError, match="MESHTRAIN_SPEC_FILE is set by the operator"):
        loading.parse_spec(own.raw())


def test_a_context_parallel_job_is_accepted(cluster, namespace):
    body = _valid("cp").parallelism(context=2).gpus(8).manifest()
    result = _dry_run(cluster, namespace, body)
    assert result.returncode == 0, result.stderr
    assert yaml.safe_load(result.stdout)["spec"]["parallelism"]["context"] == 2


@pytest.mark.parametrize(("case", "body", "message"), INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_by_kubectl_apply(cluster, namespace, case, body, message):
    result = cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body)
    )
    assert result.returncode != 0, f"{case}: accepted"
    assert message in result.stderr, result.stderr


def test_model_is_immutable_but_the_layout_may_change(cluster, namespace):
    body = _valid("fixedmodel").manifest()
    created = cluster.kubectl(
        "apply", "--server-side", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(body)
    )
    assert created.returncode == 0, created.stderr
    # the patches are raw on purpose: merge patches as a user types them to kubectl patch
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
