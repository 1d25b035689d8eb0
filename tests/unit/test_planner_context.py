"""Context parallelism in the planner: memory per rank, the ring's time, the search's fourth degree,
and the longest sequence a Llama shape trains at on H200s (issue #35, item 3)."""

from __future__ import annotations

import dataclasses

import pytest

from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.planner import comm, context, estimate, memory, precision, profiles, report, search
from tests.builders import JobBuilder

H200 = profiles.get("h200")


def llama(
    seq: int,
    context_: int,
    tensor: int = 8,
    *,
    data: int = 1,
    checkpointing: bool = False,
    zero: int = 0,
) -> api_spec.TrainingJobSpec:
    """llama3-8b in bf16, one sequence per micro-batch, ``tensor x context`` ranks per 8-GPU pod or fewer."""
    return loading.parse_spec(
        JobBuilder()
        .model(preset="llama3-8b", seqLen=seq)
        .layout(data=data, tensor=tensor, gpus_per_node=min(8, data * tensor * context_))
        .parallelism(context=context_, zeroStage=zero)
        .training(microBatch=1, precision="bf16", activationCheckpointing=checkpointing)
        .raw()
    )


def worst(job: api_spec.TrainingJobSpec) -> memory.RankMemory:
    return memory.plan_memory(job, H200).worst


# --- memory ------------------------------------------------------------------------------------


def test_a_context_rank_keeps_the_activations_of_its_share_of_the_sequence() -> None:
    """A rank of cp4 at 32k tokens holds 8k tokens of each sequence: the activations of an 8k run,
    and per layer the ring's own output (8192 tokens x 4096 / tp8 wide in bf16: 8 MiB)."""
    split, short = worst(llama(32768, 4)), worst(llama(8192, 1))
    assert split.activations == pytest.approx(short.activations + 32 * 8 * 2**20)
    whole = worst(llama(32768, 1))
    # about a quarter: the head's fp32 weight gradient and one loss chunk's logits do not shrink
    assert split.activations / whole.activations == pytest.approx(1 / 4, rel=0.05)
    # the model state does not depend on the sequence
    assert (split.weights, split.grads, split.optimizer) == (
        whole.weights,
        whole.grads,
        whole.optimizer,
    )


def test_the_ring_buffers_are_two_kv_blocks_and_three_fp32_gradient_blocks() -> None:
    # llama3-8b: 8 key/value heads of 128 over tp8, one per rank; 32k / cp4 = 8192 tokens;
    # K and V in bf16 (2 x 8192 x 128 x 2 bytes = 4 MiB), dK/dV in fp32 (8 MiB)
    assert worst(llama(32768, 4)).ring == 2 * 4 * 2**20 + 3 * 8 * 2**20
    assert worst(llama(32768, 1)).ring == 0


# --- time --------------------------------------------------------------------------------------


def test_flops_per_rank_fall_by_the_context_degree_and_the_model_flops_do_not() -> None:
    one = estimate.make_plan(llama(32768, 1), H200).time
    four = estimate.make_plan(llama(32768, 4), H200).time
    assert four.stages[0].compute == pytest.approx(one.stages[0].compute / 4)
    assert four.model_flops == one.model_flops


def test_the_ring_hides_behind_long_blocks_on_nvlink() -> None:
    # tp2 x cp4 fills one 8-GPU node: the ring runs on NVLink, each 8k-token block's attention
    # outlasts its K/V transfer
    # outlasts its K/V transfer; only the last dK/dV hop of each layer, bringing a rank's own
    # gradient home, runs behind nothing: 4 of the 32 x (6 K/V + 4 dK/dV) blocks' bytes
    # (bf16 K/V of 8192 tokens x 4 heads x 128: 16 MiB; fp32 dK/dV: 32 MiB)
    job = llama(32768, 4, tensor=2)
    stage = estimate.make_plan(job, H200).time.stages[0]
    assert stage.cp_ring > 0
    assert stage.cp / stage.cp_ring == pytest.approx(32 / (6 * 16 + 4 * 32), rel=0.05)


def test_a_slow_ring_is_exposed_by_what_its_blocks_do_not_hide() -> None:
    job = llama(32768, 2, tensor=8)  # a context ring across two nodes: the fabric's link
    slow = dataclasses.replace(H200, nic_bandwidth=1e8)
    plan = estimate.make_plan(job, slow)
    assert plan.time.links["cp"].name == "fabric"
    stage = plan.time.stages[0]
    steps = context.ring_steps(job)
    # every step's transfer outlasts its block here, so exposed = transfers - block attention:
    # 16k tokens a rank, two 8k chunks a block, 2 b L^2 h / t = 2 x 16384^2 x 4096 / 8 FLOPs
    assert context.block_attention_flops(job) == 2 * 16384**2 * 4096 / 8
    hidden = (steps.forward + 2.5 * steps.backward) * context.block_attention_flops(job)
    assert stage.cp == pytest.approx(stage.cp_ring - hidden / plan.time.rank_flops)
    # the ring's exposed time joins the stage's critical path beside the matmuls' exposed TP time
    assert stage.busy == pytest.approx(
        stage.compute + stage.overhead + stage.tp_exposed + stage.pp + stage.cp
    )
    fast = estimate.make_plan(job, H200).time
    assert plan.time.step_seconds > fast.step_seconds


def test_the_ring_sends_kv_forward_and_back_and_fp32_gradients_home_per_layer() -> None:
    """trainer/parallel/context.py per layer: 3 K/V hops forward, 3 again in backward (it
    recomputes), 4 dK/dV hops (the last brings a rank's own gradient home)."""
    job = llama(32768, 4)
    (ring,) = [
        c
        for c in comm.plan_comm(job, precision.scheme_for("bf16"))[0].collectives
        if c.group == "cp"
    ]
    layers, kv, grad = 32, 4 * 2**20, 8 * 2**20  # bf16 K/V and fp32 dK/dV of 8192 tokens
    assert ring.calls == layers * (3 + 3 + 4)
    assert ring.nbytes == layers * ((3 + 3) * kv + 4 * grad)


# --- search ------------------------------------------------------------------------------------


def test_search_explores_context_where_the_sequence_splits() -> None:
    job = llama(65536, 1, tensor=8)  # does not fit one tp8 node's memory (below)
    assert not estimate.make_plan(job, H200).memory.fits
    found = search.search(job, H200, world=16, limit=20)
    assert found
    degrees = {c.parallelism.get("context", 1) for c in found}
    assert degrees - {1}, degrees
    for candidate in found:
        c = candidate.parallelism.get("context", 1)
        assert 65536 % (2 * c) == 0
        assert (f"·cp{c}·" in candidate.label) == (c > 1)


def test_search_leaves_context_out_for_short_sequences() -> None:
    short = loading.parse_spec(JobBuilder().layout(2, 1, 1).raw())  # the tiny preset
    assert short.model.shape().seq_len < search.CONTEXT_MIN_TOKENS
    assert all("context" not in change for change, _ in search.candidates(short, 8))


# --- issue #35, item 3: a Llama shape at 4x the sequence one rank holds ---------------------------


SEQ_STEP = 1024
"""Granularity of the longest-sequence search."""


def longest_fitting(context_: int, zero: int = 0) -> int:
    """Longest multiple of :data:`SEQ_STEP` tokens that llama3-8b at tp8 x ``context`` fits on H200s."""
    low, high = SEQ_STEP, 1024 * SEQ_STEP
    while high - low > SEQ_STEP:
        middle = (low + high) // 2 // SEQ_STEP * SEQ_STEP
        low, high = (
            (middle, high)
            if memory.plan_memory(llama(middle, context_, zero=zero), H200).fits
            else (low, middle)
        )
    return low


def test_llama3_8b_trains_at_four_times_the_sequence_one_tp8_group_holds() -> None:
    """The numbers docs/planner.md quotes: 60,416 tokens at cp1; at cp4 the ring's outputs kept
    for backward and its buffers stop short of 4x (237,568); with the optimizer state sharded
    over the four context ranks (ZeRO-1 over the dp-cp group), 4x fits."""
    one = longest_fitting(1)
    assert one == 60416
    assert not memory.plan_memory(llama(one + SEQ_STEP, 1), H200).fits
    # ZeRO-1 without data or context ranks shards nothing: one rank holds the same either way
    assert longest_fitting(1, zero=1) == one
    assert longest_fitting(4) == 237568
    four = memory.plan_memory(llama(4 * one, 4, zero=1), H200)
    assert four.fits
    # the activations at 4x over cp4 are the cp1 run's (the tokens each rank holds are the same)
    # and 32 layers of the ring's bf16 output, 60,416 tokens x 4096 / tp8 wide
    one_rank = memory.plan_memory(llama(one, 1), H200).worst.activations
    assert four.worst.activations == pytest.approx(one_rank + 32 * 60416 * 512 * 2)


# --- report ------------------------------------------------------------------------------------


def test_the_report_shows_the_ring_only_for_context_jobs() -> None:
    split = estimate.make_plan(llama(32768, 2, tensor=4), H200)
    doc = report.to_json(split)
    stage = split.time.stages[0]
    assert (doc["time"]["cp_seconds"], doc["time"]["cp_exposed_seconds"]) == (
        stage.cp_ring,
        stage.cp,
    )
    assert doc["communication"]["links"]["cp"] == "nvlink"  # tp4 x cp2 fills one 8-GPU node
    assert doc["communication"]["per_stage"][0]["groups"]["cp"]["payload_bytes"] > 0
    assert doc["memory"]["per_stage"][0]["ring_bytes"] == split.memory.stages[0].ring
    assert "context ring" in report.to_text(split)
    whole = report.to_json(estimate.make_plan(llama(8192, 1), H200))
    assert "cp_seconds" not in whole["time"] and "cp" not in whole["communication"]["links"]
