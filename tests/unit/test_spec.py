"""The TrainingJob spec model: defaults, every cross-field rule, overrides, files."""

import pytest
import yaml

from meshtrain.api import layout, loading, rules, spec
from tests.builders import JobBuilder


def test_defaults_give_a_valid_single_process_job():
    job = loading.parse_spec(JobBuilder().raw())
    assert job.world_size == 1 and job.pods == 1
    assert job.parallelism.schedule == "1f1b"
    assert job.training.precision == "auto"
    assert job.model.shape().ffn_hidden == 4 * job.model.shape().hidden


def test_dra_claims_are_optional_and_read_from_camel_case():
    assert loading.parse_spec(JobBuilder().raw()).resources.dra is None
    job = loading.parse_spec(
        JobBuilder()
        .dra(
            "gpu.nvidia.com",
            "device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H200'",
            match_attribute="resource.kubernetes.io/pcieRoot",
            compute_domain=True,
        )
        .raw()
    )
    claims = job.resources.dra
    assert claims is not None and claims.device_class_name == "gpu.nvidia.com"
    assert claims.match_attribute == "resource.kubernetes.io/pcieRoot" and claims.compute_domain
    assert claims.selectors == ["device.attributes['gpu.nvidia.com'].productName == 'NVIDIA H200'"]


def test_layout_string_and_pods():
    job = loading.parse_spec(JobBuilder().layout(2, 4, 8, gpus_per_node=8).model(preset="7b").raw())
    assert job.parallelism.layout_string == "dp2·pp4·tp8"
    assert job.world_size == 64 and job.pods == 8


def test_the_layout_is_the_parallelism_sections_and_follows_a_copy():
    job = loading.parse_spec(JobBuilder().layout(2, 2, 2, gpus_per_node=4).raw())
    assert job.parallelism.layout == layout.ParallelLayout(data=2, pipeline=2, tensor=2)
    resized = job.parallelism.model_copy(update={"data": 4})
    assert resized.layout.data == 4 and resized.world_size == 16


def test_context_is_a_fourth_degree_of_the_layout_and_the_world():
    job = loading.parse_spec(
        JobBuilder().layout(2, 2, 2, gpus_per_node=8, context=4).model(preset="7b").raw()
    )
    assert job.parallelism.layout == layout.ParallelLayout(data=2, pipeline=2, tensor=2, context=4)
    assert job.parallelism.layout_string == "dp2·pp2·cp4·tp2"
    assert job.world_size == 32 and job.pods == 4


# (case, builder, field path the message must name, words the message must contain)
INVALID = [
    (
        "sequence not divisible by 2 x context",
        JobBuilder().layout(context=4).model(preset="tiny", seqLen=36),
        "spec.model.seqLen",
        ["context=4", "seqLen=36", "2 x context = 8"],
    ),
    (
        "sequence parallel slice not divisible by tensor under context",
        JobBuilder()
        .layout(tensor=4, context=2)
        .model(preset="tiny", seqLen=36)
        .parallelism(sequenceParallel=True),
        "spec.model.seqLen",
        ["seqLen / context", "tensor=4"],
    ),
    (
        "context parallelism with the hierarchical all-reduce",
        JobBuilder().layout(data=2, context=2).parallelism(allReduce="hierarchical"),
        "spec.parallelism.context",
        ["allReduce hierarchical", "allReduce flat"],
    ),
    (
        "context past its bound",
        JobBuilder().layout(context=512, gpus_per_node=8),
        "spec.parallelism.context",
        ["less than or equal to 256"],
    ),
    (
        "world with context not a multiple of gpusPerNode",
        JobBuilder().layout(data=3, context=2, gpus_per_node=4),
        "spec.parallelism",
        ["context", "= 6", "gpusPerNode=4"],
    ),
    (
        "tensor does not divide gpusPerNode",
        JobBuilder()
        .layout(1, 1, 3, gpus_per_node=4)
        .model(preset="tiny", heads=3, hidden=63, vocab=255, ffnHidden=252),
        "spec.parallelism.tensor",
        ["tensor=3", "gpusPerNode=4"],
    ),
    (
        "world not a multiple of gpusPerNode",
        JobBuilder().layout(3, 1, 1, gpus_per_node=2),
        "spec.parallelism",
        ["= 3", "gpusPerNode=2"],
    ),
    (
        "layers not divisible by stages",
        JobBuilder().layout(1, 3, 1),
        "spec.model.layers",
        ["layers=4", "3"],
    ),
    (
        "heads not divisible by tensor",
        JobBuilder().layout(1, 1, 8).model(preset="tiny", heads=4, hidden=64),
        "spec.model.heads",
        ["heads=4", "tensor=8"],
    ),
    (
        "batch arithmetic off",
        JobBuilder()
        .layout(2, 1, 1)
        .parallelism(microBatches=4)
        .training(microBatch=2, globalBatch=10),
        "spec.training.globalBatch",
        ["globalBatch=10", "2 x 4 x 2 = 16"],
    ),
    (
        "virtual stages without interleaving",
        JobBuilder().layout(1, 2, 1).parallelism(virtualStages=2),
        "spec.parallelism.virtualStages",
        ["virtualStages=2", "interleaved-1f1b"],
    ),
    (
        "interleaved needs virtual stages",
        JobBuilder().layout(1, 2, 1).parallelism(schedule="interleaved-1f1b"),
        "spec.parallelism.virtualStages",
        ["virtualStages >= 2"],
    ),
    (
        "interleaved micro-batches in rounds",
        JobBuilder()
        .layout(1, 2, 1)
        .parallelism(schedule="interleaved-1f1b", virtualStages=2, microBatches=3),
        "spec.parallelism.microBatches",
        ["microBatches=3", "pipeline=2"],
    ),
    (
        "no shape at all",
        JobBuilder().model(preset=None, layers=2),
        "spec.model",
        ["hidden", "heads"],
    ),
    (
        "sequence parallel needs divisible seqLen",
        JobBuilder()
        .layout(1, 1, 2)
        .parallelism(sequenceParallel=True)
        .model(preset="tiny", seqLen=33),
        "spec.model.seqLen",
        ["seqLen=33"],
    ),
    (
        "metrics ports past 65535",
        JobBuilder().layout(8, 1, 1).metrics(port=65530),
        "spec.metrics.port",
        ["65530-65537", "65528"],
    ),
    (
        "metrics ports over the rendezvous port",
        JobBuilder().layout(8, 1, 1).metrics(port=29495),
        "spec.metrics.port",
        ["29495-29502", "29500"],
    ),
    (
        "below a minimum",
        JobBuilder().parallelism(microBatches=0),
        "spec.parallelism.microBatches",
        ["greater than or equal to 1"],
    ),
    (
        "unknown schedule",
        JobBuilder().parallelism(schedule="zigzag"),
        "spec.parallelism.schedule",
        ["gpipe", "zigzag"],
    ),
    (
        "unknown field (typo)",
        JobBuilder().parallelism(microbatches=4),
        "spec.parallelism.microbatches",
        ["not permitted"],
    ),
    (
        "env name not a C identifier",
        JobBuilder().pod(env=[{"name": "NCCL-IB-HCA", "value": "mlx5"}]),
        "spec.pod.env[0].name",
        ["pattern", "^[A-Za-z_]"],
    ),
    (
        "env credential as a plain value",
        JobBuilder().pod(env=[{"name": "WANDB_API_KEY", "value": "abc"}]),
        "spec.pod.env",
        ["env[0] WANDB_API_KEY", "valueFrom.secretKeyRef"],
    ),
    (
        "env overriding torchrun's variables",
        JobBuilder().pod(env=[{"name": "MASTER_ADDR", "value": "10.0.0.1"}]),
        "spec.pod.env",
        ["env[0] MASTER_ADDR", "set by the operator"],
    ),
    (
        "env with both value and valueFrom",
        JobBuilder().pod(
            env=[
                {
                    "name": "X",
                    "value": "1",
                    "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}},
                }
            ]
        ),
        "spec.pod.env",
        ["env[0] X", "exactly one of value or valueFrom"],
    ),
    (
        "custom trainer without a command",
        JobBuilder().trainer(type="custom"),
        "spec.trainer.command",
        ["trainer.command is empty", "torchrun"],
    ),
    (
        "command for the built-in trainer",
        JobBuilder().trainer(command=["python", "train.py"]),
        "spec.trainer.command",
        ["trainer.type custom"],
    ),
    (
        "progress port for the built-in trainer",
        JobBuilder().trainer(progressPort=9500),
        "spec.trainer.progressPort",
        ["progressPort=9500", "trainer.type custom", "metrics.port"],
    ),
    (
        "gradient compression without data parallelism",
        JobBuilder().parallelism(gradientCompression={"mode": "bf16"}),
        "spec.parallelism.gradientCompression.mode",
        ["mode=bf16", "data=1", "data >= 2"],
    ),
    (
        "stateful gradient compression with ZeRO-3",
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=3, gradientCompression={"mode": "int8"}),
        "spec.parallelism.gradientCompression.mode",
        ["mode=int8", "zeroStage=3", "mode bf16 or fp16", "zeroStage 2"],
    ),
    (
        "an exact warm-up before ZeRO-3's 16-bit reduce-scatter",
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=3, gradientCompression={"mode": "bf16", "warmupSteps": 5}),
        "spec.parallelism.gradientCompression.warmupSteps",
        ["warmupSteps=5", "mode=bf16", "zeroStage=3", "FSDP2", "warmupSteps 0", "zeroStage 2"],
    ),
    (
        "PowerSGD on ZeRO-2's every-micro-batch reduce-scatter",
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=2, microBatches=4, gradientCompression={"mode": "powersgd"}),
        "spec.parallelism.gradientCompression.mode",
        [
            "mode=powersgd",
            "zeroStage=2",
            "microBatches=4",
            "4x",
            "zeroStage 1",
            "bf16, fp16 or int8",
        ],
    ),
    (
        "hierarchical all-reduce without data parallelism",
        JobBuilder().parallelism(allReduce="hierarchical"),
        "spec.parallelism.allReduce",
        ["allReduce=hierarchical", "data=1", "data >= 2"],
    ),
    (
        "hierarchical all-reduce with an uneven split over nodes",
        JobBuilder().layout(6, 2, 1, gpus_per_node=4).parallelism(allReduce="hierarchical"),
        "spec.parallelism.allReduce",
        ["allReduce=hierarchical", "data=6", "gpusPerNode=4", "multiple"],
    ),
    (
        "gradient compression with ZeRO-3",
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=3, gradientCompression={"mode": "powersgd"}),
        "spec.parallelism.gradientCompression.mode",
        ["zeroStage=3", "ZeRO-3", "zeroStage 0 or 1"],
    ),
    (
        "PowerSGD rank larger than a matrix",
        JobBuilder()
        .layout(2, 1, 2, gpus_per_node=4)
        .model(preset="tiny", hidden=64, heads=4, seqLen=128)
        .parallelism(gradientCompression={"mode": "powersgd", "rank": 40}),
        "spec.parallelism.gradientCompression.rank",
        ["rank=40", "64/2", "at most 32"],
    ),
    (
        "llama3 RoPE scaling with an empty blended band",
        JobBuilder().model(
            preset="llama-tiny",
            ropeScaling={
                "factor": 8,
                "lowFreqFactor": 4,
                "highFreqFactor": 1,
                "originalMaxPositionEmbeddings": 16,
            },
        ),
        "spec.model.ropeScaling.highFreqFactor",
        ["lowFreqFactor=4.0", "highFreqFactor=1.0"],
    ),
    (
        "RoPE scaling on a GPT",
        JobBuilder().model(
            preset="tiny",
            ropeScaling={
                "factor": 8,
                "lowFreqFactor": 1,
                "highFreqFactor": 4,
                "originalMaxPositionEmbeddings": 16,
            },
        ),
        "spec.model.ropeScaling",
        ["family=gpt"],
    ),
    (
        "selective recompute beside full activation checkpointing",
        JobBuilder().training(activationCheckpointing=True, selectiveRecompute=["mlp"]),
        "spec.training.selectiveRecompute",
        ["selectiveRecompute=['mlp']", "activationCheckpointing=true", "set one of them"],
    ),
    (
        "unknown selective recompute part",
        JobBuilder().training(selectiveRecompute=["norm"]),
        "spec.training.selectiveRecompute[0]",
        ["attention", "mlp"],
    ),
    (
        "pod label the operator selects by",
        JobBuilder().pod(labels={"meshtrain.io/job": "other"}),
        "spec.pod.labels",
        ["meshtrain.io/job", "operator's own"],
    ),
    (
        "the GPU resource asked again through extraResources",
        JobBuilder().gpus(2).resources(extraResources={"nvidia.com/gpu": "8"}),
        "spec.resources.extraResources",
        ["gpuResourceName", "'nvidia.com/gpu'", "'8'", "gpusPerNode=2"],
    ),
    (
        "DRA claims beside another GPU extended resource name",
        JobBuilder().dra("gpu.nvidia.com").resources(gpuResourceName="amd.com/gpu"),
        "spec.resources.gpuResourceName",
        ["resources.dra", "'amd.com/gpu'", "deviceClassName"],
    ),
    (
        "DRA claims beside a GPU asked in extraResources",
        JobBuilder().dra("gpu.nvidia.com").resources(extraResources={"amd.com/gpu": "1"}),
        "spec.resources.extraResources",
        ["resources.dra", "'amd.com/gpu'", "twice"],
    ),
    (
        "a DRA device class that is no object name",
        JobBuilder().dra("GPU_Class"),
        "spec.resources.dra.deviceClassName",
        ["GPU_Class"],
    ),
    (
        "a DRA match attribute without its domain",
        JobBuilder().dra("gpu.nvidia.com", match_attribute="pcieRoot"),
        "spec.resources.dra.matchAttribute",
        ["pcieRoot"],
    ),
    (
        "more DRA selectors than the API server takes",
        JobBuilder().dra("gpu.nvidia.com", *(["device.driver != ''"] * 33)),
        "spec.resources.dra.selectors",
        ["32"],
    ),
    (
        "a DRA selector past its length",
        JobBuilder().dra("gpu.nvidia.com", "x" * 10_241),
        "spec.resources.dra.selectors[0]",
        ["10240"],
    ),
    (
        "more warm spares than a pod's ranks",
        JobBuilder().gpus(2).run_policy(recovery={"warmSpares": 3}),
        "spec.runPolicy.recovery.warmSpares",
        ["warmSpares=3", "gpusPerNode=2", "at most 2"],
    ),
    (
        "a negative in-place budget",
        JobBuilder().run_policy(recovery={"inPlaceLimit": -1}),
        "spec.runPolicy.recovery.inPlaceLimit",
        ["greater than or equal to 0"],
    ),
    (
        "a rejoin timeout of zero",
        JobBuilder().run_policy(recovery={"rejoinTimeoutSeconds": 0}),
        "spec.runPolicy.recovery.rejoinTimeoutSeconds",
        ["greater than or equal to 1"],
    ),
    (
        "spare nodes past their bound",
        JobBuilder().run_policy(recovery={"spareNodes": 1025}),
        "spec.runPolicy.recovery.spareNodes",
        ["less than or equal to 1024"],
    ),
]


@pytest.mark.parametrize("case,builder,path,words", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_spec_is_refused_naming_field_and_values(case, builder, path, words):
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(builder.raw())
    paths = [p.path for p in err.value.problems]
    assert path in paths, f"{case}: expected a problem at {path}, got {paths}"
    message = next(str(p) for p in err.value.problems if p.path == path)
    for word in words:
        assert word in message, f"{case}: {word!r} missing from {message!r}"


@pytest.mark.parametrize(
    ("stage", "mode", "warmup"),
    [(2, m, 10) for m in ("bf16", "fp16", "int8", "topk", "powersgd")]
    + [(3, "bf16", 0), (3, "fp16", 0)],  # FSDP2's reduce dtype is fixed: no warm-up on ZeRO-3
)
def test_gradient_compression_is_accepted_on_the_reduce_scatter_it_can_compress(
    stage, mode, warmup
):
    job = loading.parse_spec(
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=stage, gradientCompression={"mode": mode, "warmupSteps": warmup})
        .raw()
    )
    assert job.parallelism.gradient_compression.warmup_steps == warmup


@pytest.mark.parametrize(
    ("stage", "mode"), [(2, "bf16"), (2, "fp16"), (2, "int8"), (1, "powersgd"), (1, "topk")]
)
def test_zero2s_per_micro_batch_modes_and_zero1s_whole_bucket_modes_take_micro_batches(stage, mode):
    job = loading.parse_spec(
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(zeroStage=stage, microBatches=4, gradientCompression={"mode": mode})
        .raw()
    )
    assert job.parallelism.micro_batches == 4


@pytest.mark.parametrize(("mode", "warmup"), [("powersgd", 10), ("int8", 0), ("bf16", 0)])
def test_an_empty_warmup_is_the_swept_default_for_powersgd_only(mode, warmup):
    job = loading.parse_spec(
        JobBuilder()
        .layout(2, 1, 1, gpus_per_node=2)
        .parallelism(gradientCompression={"mode": mode})
        .raw()
    )
    compression = job.parallelism.gradient_compression
    assert compression.warmup_steps is None and compression.exact_steps == warmup
    assert compression.rank == 8  # docs/trainer.md's sweep


def test_recovery_defaults_restart_in_place_with_one_warm_spare():
    recovery = loading.parse_spec(JobBuilder().raw()).run_policy.recovery
    assert (recovery.in_place, recovery.in_place_limit, recovery.warm_spares) == (True, 10, 1)
    assert (recovery.rejoin_timeout_seconds, recovery.spare_nodes) == (120, 0)


def test_every_broken_rule_is_listed_at_once():
    raw = JobBuilder().layout(2, 3, 3, gpus_per_node=4).training(globalBatch=7).raw()
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(raw)
    names = {p.path for p in err.value.problems}
    assert {
        "spec.parallelism.tensor",
        "spec.parallelism",
        "spec.training.globalBatch",
        "spec.model.layers",
        "spec.model.heads",
    } <= names
    assert len(err.value.problems) >= 5


def test_every_rule_has_a_cel_expression_and_message():
    for rule in rules.RULES + (rules.SHAPE_RULE,):
        assert rule.cel and "self." in rule.cel, rule.name
        assert rule.cel_message, rule.name


def test_overrides_accept_camel_and_snake_case_and_revalidate():
    job = loading.parse_spec(JobBuilder().layout(2, 1, 1).raw())
    changed = loading.apply_overrides(job, ["training.steps=7", "parallelism.micro_batches=3"])
    assert changed.training.steps == 7 and changed.parallelism.micro_batches == 3
    with pytest.raises(loading.SpecError, match="spec.parallelism.tensor"):
        loading.apply_overrides(job, ["parallelism.tensor=3"])
    with pytest.raises(loading.SpecError, match="path=value"):
        loading.apply_overrides(job, ["training.steps"])


def test_load_manifest_round_trip(tmp_path):
    job = loading.parse_spec(JobBuilder().layout(2, 2, 2, gpus_per_node=4).raw())
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(spec.to_manifest("demo", job, namespace="ml")))
    metadata, loaded = loading.load_manifest(path)
    assert metadata == {"name": "demo", "namespace": "ml"}
    assert loaded == job


@pytest.mark.parametrize(
    "content,words",
    [
        ("kind: Deployment\napiVersion: apps/v1\n", ["kind", "TrainingJob"]),
        ("kind: TrainingJob\napiVersion: meshtrain.io/v9\n", ["apiVersion", "v1alpha1"]),
        ("spec: [unclosed\n", ["not valid YAML"]),
        ("- a list\n", ["YAML mapping"]),
    ],
)
def test_bad_files_name_the_problem(tmp_path, content, words):
    path = tmp_path / "job.yaml"
    path.write_text(content)
    with pytest.raises(loading.SpecError) as err:
        loading.load_manifest(path)
    for word in words:
        assert word in str(err.value)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(loading.SpecError, match="file not found"):
        loading.load_spec_file(tmp_path / "nope.yaml")
