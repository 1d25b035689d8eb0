"""The planner's arithmetic: literature figures reproduced, and agreement with the trainer's own code.

Pure and fast: the trainer's model is built (tiny shapes) only to count its
parameters; no process groups.
"""

from __future__ import annotations

import pytest
import torch

from meshtrain.api import layout, loading
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import model as api_model
from meshtrain.planner import comm, memory, parameters, precision, profiles
from meshtrain.planner.timing import network, pipeline_window, stage_work, step_time
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import pipeline, reducer, schedules, tensor
from meshtrain.trainer.telemetry import stepstats
from tests.builders import JobBuilder


def job(**parallelism) -> api_spec.TrainingJobSpec:
    """A tiny valid job; parallelism keys in camelCase."""
    p = {"data": 1, "pipeline": 1, "tensor": 1, **parallelism}
    builder = JobBuilder().layout(p.pop("data"), p.pop("pipeline"), p.pop("tensor"))
    return loading.parse_spec(builder.parallelism(**p).training(precision="fp32").raw())


SHAPES = [
    api_model.ModelShape(layers=4, hidden=64, heads=4, vocab=256, seq_len=64, ffn_hidden=256),
    api_model.ModelShape(layers=6, hidden=48, heads=6, vocab=96, seq_len=32, ffn_hidden=80),
]


# --- literature arithmetic ------------------------------------------------------------------------


def test_7b_mixed_precision_adam_needs_112_gb_per_replicated_worker() -> None:
    state = memory.state_bytes(7e9, precision.MIXED, zero_stage=0, data=64)
    assert precision.MIXED.total == 16
    assert state.total == pytest.approx(112e9)


def test_zero_stages_divide_the_right_components() -> None:
    n, params = 64, 7e9
    assert memory.state_bytes(params, precision.MIXED, 1, n).total == pytest.approx(
        params * (2 + 2 + 12 / n)
    )
    assert memory.state_bytes(params, precision.MIXED, 2, n).total == pytest.approx(
        params * (2 + (2 + 12) / n)
    )
    assert memory.state_bytes(params, precision.MIXED, 3, n).total == pytest.approx(params * 16 / n)
    zero1 = memory.state_bytes(params, precision.MIXED, 1, n)
    assert (zero1.weights, zero1.grads) == (2 * params, 2 * params)
    assert zero1.optimizer == pytest.approx(12 * params / 64)
    assert precision.FP32.total == 16 and memory.state_bytes(1, precision.FP32, 1, 4).optimizer == 2


def test_ring_allreduce_of_1b_fp16_params_over_100_gbit_is_about_0_32_s() -> None:
    link = network.Link("fabric", bandwidth=100e9 / 8, latency=0.0)
    seconds = network.ring_allreduce_seconds(2 * 1e9, members=1024, link=link)
    assert seconds == pytest.approx(2 * 2e9 / 12.5e9, rel=1e-3)
    assert seconds == pytest.approx(0.32, rel=1e-3)
    with_latency = network.ring_allreduce_seconds(2e9, 8, network.Link("x", 12.5e9, 1e-5))
    assert with_latency == pytest.approx(2 * 7 * 1e-5 + 2 * 7 / 8 * 2e9 / 12.5e9)
    assert network.ring_allreduce_seconds(2e9, 1, link) == 0.0


@pytest.mark.parametrize(
    "p,m,v", [(1, 4, 1), (2, 4, 1), (4, 8, 1), (4, 16, 1), (2, 4, 2), (4, 8, 2), (4, 8, 4)]
)
def test_bubble_agrees_with_the_trainer_and_telemetry(p: int, m: int, v: int) -> None:
    ours = pipeline_window.bubble_ratio(p, m, v)
    assert ours == pytest.approx((p - 1) / (v * m + p - 1))
    timeline = schedules.simulate("interleaved-1f1b" if v > 1 else "1f1b", p, m, v)
    span = max(t for stage in timeline for t, _ in stage) + 1
    assert ours == pytest.approx(1 - 2 * m * v / span)  # the trainer's schedules idle that long
    facts = stepstats.JobFacts(
        stages=p,
        micro_batches=m,
        virtual_stages=v,
        world_size=p,
        group_sizes={},
        flops_per_token=1.0,
        peak_flops=1.0,
    )
    assert ours == facts.bubble_theoretical


def test_activations_follow_korthikanti_without_dropout() -> None:
    """The paper's count (sec. 4.1) less its dropout masks, plus the two LayerNorms' fp32 mean and rstd.

    Under sequence parallelism the trainer keeps the gathered norm outputs
    (2 s b h elements, whole) where Megatron-LM keeps its shard and gathers
    again in backward: ``4 + 28/t`` instead of the paper's ``32/t``.
    """
    shape = api_model.ModelShape(
        layers=1, hidden=1024, heads=16, vocab=256, seq_len=2048, ffn_hidden=4096
    )
    s, b, h, a = 2048, 2, 1024, 16
    statistics = 2 * 2 * 4 * s * b  # bytes
    for t in (1, 2, 8):
        unfused = memory.layer_activation_bytes(
            shape, b, t, precision.MIXED, sequence_parallel=False, fused_attention=False
        )
        assert unfused == pytest.approx(
            s * b * h * (8 + 24 / t) + 4 * a * s * s * b / t + statistics
        )
        sp = memory.layer_activation_bytes(
            shape, b, t, precision.MIXED, sequence_parallel=True, fused_attention=False
        )
        assert sp == pytest.approx(
            s * b * h * (4 + 28 / t) + 4 * a * s * s * b / t + statistics / t
        )
        fused = memory.layer_activation_bytes(shape, b, t, precision.MIXED, sequence_parallel=False)
        assert fused == pytest.approx(s * b * h * (8 + 24 / t) + 4 * a * s * b / t + statistics)


def test_activation_checkpointing_keeps_block_inputs_and_one_working_set() -> None:
    job = (
        JobBuilder()
        .layout(data=1, pipeline=2, tensor=2)
        .parallelism(microBatches=8, sequenceParallel=True)
        .model(preset="1.3b")
        .training(microBatch=1)
    )
    plain = loading.parse_spec(job.raw())
    recompute = loading.parse_spec(job.training(activationCheckpointing=True).raw())
    h100 = profiles.get("h100-sxm")
    shape, scheme = (
        plain.model.shape(),
        precision.scheme_for(precision.resolve_precision(plain, h100)),
    )
    per_layer = memory.layer_activation_bytes(  # overlap.tensor (default): the inputs' shards
        shape, 1, 2, scheme, sequence_parallel=True, gathered_inputs=False
    )
    kept = memory.checkpointed_layer_bytes(shape, 1, 2, scheme, sequence_parallel=True)
    assert kept == shape.seq_len * shape.hidden * scheme.stream_bytes / 2
    before, after = (
        memory.plan_memory(plain, h100).stages[0],
        memory.plan_memory(recompute, h100).stages[0],
    )
    layers = shape.layers // 2
    assert before.activations == pytest.approx(before.in_flight * layers * per_layer)
    assert after.activations == pytest.approx(after.in_flight * layers * kept + per_layer)
    assert after.activations < before.activations / 5


def test_activation_checkpointing_costs_one_more_forward_of_the_blocks() -> None:
    shape = api_model.ModelShape(
        layers=8, hidden=1024, heads=16, vocab=50304, seq_len=2048, ffn_hidden=4096
    )
    training = stage_work.rank_flops_per_microbatch(shape, 2, 1, 0, 1)  # stage 0: blocks only
    assert stage_work.recompute_flops_per_microbatch(shape, 2, 1, 1) == pytest.approx(training / 3)


def test_checkpointed_blocks_save_only_their_inputs() -> None:
    """What autograd keeps from a forward of checkpointed blocks is exactly the planner's kept bytes."""
    shape = api_model.ModelShape(layers=3, hidden=32, heads=4, vocab=64, seq_len=16, ffn_hidden=128)
    model = gpt.GPT(gpt.GPTConfig.from_shape(shape), recompute_blocks=True)
    model.tok_emb = model.pos_emb = model.norm = model.head = (
        None  # a middle pipeline stage: hidden in, hidden out
    )
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    x = torch.randn(2, shape.seq_len, shape.hidden, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        out = model(x)
    out.sum().backward()
    kept = memory.checkpointed_layer_bytes(shape, 2, 1, precision.FP32, sequence_parallel=False)
    assert sum(saved.values()) == shape.layers * kept


# --- agreement with the trainer's code ------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES, ids=["tiny", "odd-ffn"])
def test_parameter_count_matches_the_trainer_model(shape: api_model.ModelShape) -> None:
    model = gpt.GPT(gpt.GPTConfig.from_shape(shape))
    assert parameters.total_params(shape) == sum(p.numel() for p in model.parameters())
    assert parameters.total_params(shape) == gpt.dense_param_count(gpt.GPTConfig.from_shape(shape))


STAGE_SHAPES = {
    "gpt": {},
    # one key/value head (replicated over every tensor rank) and the embedding tied across stages
    "llama-mqa-tied": {"family": "llama", "kv_heads": 1, "tie_embeddings": True},
}


@pytest.mark.parametrize("model", list(STAGE_SHAPES))
@pytest.mark.parametrize("p,t,v", [(1, 2, 1), (2, 1, 1), (2, 2, 1), (2, 2, 2), (2, 4, 1)])
def test_rank_params_and_registration_order_match_the_sharded_stages(
    p: int, t: int, v: int, model: str
) -> None:
    shape = api_model.ModelShape(
        layers=8, hidden=32, heads=4, vocab=64, seq_len=16, ffn_hidden=96, **STAGE_SHAPES[model]
    )
    for stage in range(p):
        for tp_rank in range(t):
            torch.manual_seed(0)
            chunks = pipeline.split_model(
                llama.build(gpt.GPTConfig.from_shape(shape)),
                stage=stage,
                stages=p,
                virtual_stages=v,
            )
            if t > 1:
                ctx = tensor.TPContext(group=None, rank=tp_rank, size=t)
                for chunk in chunks:
                    tensor.apply_tensor_parallel(chunk, ctx)
            real = [param.numel() for chunk in chunks for param in chunk.parameters()]
            planned: list[int] = []
            for chunk in range(v):
                j = chunk * p + stage
                planned += comm.chunk_param_sizes(
                    shape, t, shape.layers // (p * v), first=j == 0, last=j == p * v - 1
                )
            assert planned == real
            assert parameters.rank_params(shape, p, t, stage) == sum(real)


def _peak_in_flight(actions: list[schedules.Action]) -> int:
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == "forward" else -1
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize(
    "schedule,p,m,v",
    [
        ("gpipe", 4, 8, 1),
        ("1f1b", 4, 8, 1),
        ("1f1b", 4, 2, 1),
        ("interleaved-1f1b", 4, 8, 2),
        ("interleaved-1f1b", 2, 4, 3),
        ("interleaved-1f1b", 4, 4, 2),
    ],
)
def test_in_flight_microbatches_match_the_trainer_schedules(
    schedule: str, p: int, m: int, v: int
) -> None:
    for stage in range(p):
        peak_chunks = _peak_in_flight(schedules.actions(schedule, p, m, stage, v))
        assert memory.in_flight_microbatches(schedule, p, m, stage, v) == pytest.approx(
            peak_chunks / v
        )


def test_interleaved_first_stage_matches_korthikantis_factor() -> None:
    p, v, m = 4, 2, 16
    assert memory.in_flight_microbatches("interleaved-1f1b", p, m, 0, v) == pytest.approx(
        p * (1 + (p - 1) / (p * v))
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_comm_payloads_per_group(overlap: bool) -> None:
    spec = job(data=2, tensor=2, microBatches=3, overlap={"tensor": overlap})
    shape = spec.model.shape()
    stage = comm.stage_comm(spec, 0, precision.FP32)
    b, s, h = spec.training.micro_batch, shape.seq_len, shape.hidden
    keys = stage.by_key()
    assert keys[("dp", "all_reduce")].nbytes == parameters.rank_params(shape, 1, 2, 0) * 4
    # 4 reductions per block per micro-batch, the embedding, the head and the loss (3 floats per token), the norm;
    # overlapped, the two row-parallel outputs' in chunks (the same bytes)
    per_block = 2 * layout.TP_OVERLAP_CHUNKS + 2 if overlap else 4
    tp = keys[("tp", "all_reduce")]
    assert tp.calls == per_block * shape.layers * 3 + 3 + 3 + 2 * 3 + 1
    assert tp.nbytes == (4 * shape.layers + 2) * 3 * b * s * h * 4 + 3 * 3 * b * s * 4 + 8
    assert tp.wire_bytes == pytest.approx(tp.nbytes)  # 2 (n-1)/n = 1 for n = 2
    assert stage.payload("pp") == 0


def test_pipeline_sends_and_interleaving() -> None:
    spec = job(pipeline=2, microBatches=4, schedule="interleaved-1f1b", virtualStages=2)
    shape = spec.model.shape()
    message = spec.training.micro_batch * shape.seq_len * shape.hidden * 4
    first, last = comm.plan_comm(spec, precision.FP32)
    # virtual stages 0,2 on stage 0 and 1,3 on stage 1: 3 forward and 3 backward hops over 4 chunks.
    assert first.by_key()[("pp", "send")].calls == (1 + 2) * 4
    assert last.by_key()[("pp", "send")].calls == (2 + 1) * 4
    assert first.payload("pp") == 12 * message + 8


def test_zero_buckets_are_padded_to_the_group() -> None:
    assert comm.padded(10, 4) == 12 and comm.padded(12, 4) == 12
    assert comm.bucket_numels([100, 200, 300], 4, 1300 / 2**20) == [300 + 200, 100]
    sizes = [7, 300, 5, 1000, 64, 64, 9]
    for limit in (100, 1300, 5000):
        theirs = [
            sum(sizes[::-1][i] for i in bucket)
            for bucket in reducer.plan_buckets(sizes[::-1], 4, limit)
        ]
        assert comm.bucket_numels(sizes, 4, limit / 2**20) == theirs
    spec = job(data=4, zeroStage=2, bucketMb=0.01)
    keys = comm.stage_comm(spec, 0, precision.FP32).by_key()
    assert keys[("dp", "reduce_scatter")].nbytes == keys[("dp", "all_gather")].nbytes
    assert keys[("dp", "all_reduce")].nbytes == 8


# --- time ---------------------------------------------------------------------------------------


def test_groups_use_nvlink_inside_a_pod_and_the_fabric_across() -> None:
    inside = loading.parse_spec(JobBuilder().layout(2, 2, 2, gpus_per_node=8).raw())
    assert network.group_links(inside) == {"dp": "nvlink", "tp": "nvlink", "pp": "nvlink"}
    split = loading.parse_spec(JobBuilder().layout(2, 2, 2, gpus_per_node=4).raw())
    assert network.group_links(split) == {"dp": "nvlink", "tp": "nvlink", "pp": "fabric"}
    dp_out = loading.parse_spec(JobBuilder().layout(4, 1, 2, gpus_per_node=2).raw())
    assert network.group_links(dp_out) == {"dp": "fabric", "tp": "nvlink", "pp": "nvlink"}
    # Two pods on one NVLink clique: everything stays on NVLink.
    assert network.group_links(split, ["clique-a", "clique-a"])["pp"] == "nvlink"


def test_compute_flops_of_all_ranks_add_up_to_the_model() -> None:
    shape = SHAPES[0]
    whole = stage_work.rank_flops_per_microbatch(shape, 1, 1, 0, 2)
    assert whole == pytest.approx(stage_work.model_flops_per_token(shape) * 2 * shape.seq_len)
    config = gpt.GPTConfig.from_shape(shape)
    assert stage_work.model_flops_per_token(shape) == pytest.approx(gpt.flops_per_token(config))
    parts = sum(stage_work.rank_flops_per_microbatch(shape, 2, 1, s, 2) for s in range(2))
    assert parts == pytest.approx(whole)


def test_step_time_adds_the_bubble_and_verdicts() -> None:
    h100 = profiles.get("h100-sxm")
    big = loading.parse_spec(
        JobBuilder()
        .layout(1, 4, 8, gpus_per_node=8)
        .model(preset="7b")
        .parallelism(microBatches=8)
        .raw()
    )
    scheme = precision.scheme_for("bf16")
    plan = step_time.plan_time(big, h100, comm.plan_comm(big, scheme))
    assert plan.bubble == pytest.approx(3 / 11)
    # The replayed window holds every action of the pacing stage plus the other stages' fill and drain.
    assert plan.step_seconds >= plan.pipeline_seconds > max(s.busy for s in plan.stages)
    assert plan.verdict == "compute-bound" and plan.compute_comm_ratio > 1
    assert 0 < plan.mfu < h100.achievable_fraction
    # The tiny model over a slow fabric is dominated by communication.
    tiny = loading.parse_spec(JobBuilder().layout(8, 1, 1, gpus_per_node=1).raw())
    slow = step_time.plan_time(tiny, h100, comm.plan_comm(tiny, scheme))
    assert slow.links["dp"].name == "fabric"
    assert slow.verdict == "communication-bound"


def test_placement_traffic_in_the_placement_modules_terms() -> None:
    spec = job(data=2, pipeline=2, microBatches=4)
    shape = spec.model.shape()
    dp, pp = comm.placement_traffic(spec, precision.FP32)
    assert dp == pytest.approx(max(s.wire("dp") for s in comm.plan_comm(spec, precision.FP32)))
    assert dp == pytest.approx(2 * (2 - 1) / 2 * parameters.rank_params(shape, 2, 1, 0) * 4)
    assert pp == 2 * 4 * spec.training.micro_batch * shape.seq_len * shape.hidden * 4
