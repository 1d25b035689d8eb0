"""``meshtrain plan --calibrate`` code paths on a tiny job: two real gloo processes, short measurements.

The figures themselves depend on the machine; what is checked is that every
collective the job runs is measured and fitted, that the file round-trips
through ``--profiles-dir`` and that the plan then says it was calibrated here.
"""

from __future__ import annotations

import dataclasses
import json
import socket
import statistics
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import yaml
from torch.utils.flop_counter import FlopCounterMode

from meshtrain.api import loading
from meshtrain.cli import main
from meshtrain.planner import estimate, parameters, profiles
from meshtrain.trainer.calibration import measure, step_loop
from tests.builders import JobBuilder

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _tiny_dp2() -> dict:
    return (
        JobBuilder()
        .layout(2, 1, 1)
        .model(preset="tiny", layers=2, hidden=32, heads=2, seqLen=16)
        .training(precision="fp32", microBatch=2)
        .raw()
    )


def test_fit_recovers_alpha_and_bus_bandwidth() -> None:
    alpha, bandwidth, n = 1e-4, 1e9, 4
    samples = {m: 2 * (n - 1) * alpha + 2 * (n - 1) / n * m / bandwidth for m in (256, 1 << 21)}
    fitted = measure.fit("all_reduce", n, samples, processes=n)
    assert fitted.alpha == pytest.approx(alpha, rel=0.01)
    assert fitted.bandwidth == pytest.approx(bandwidth, rel=0.01)
    cpu_call, cpu_bandwidth = 3e-5, 4e9
    cpu = {m: cpu_call + (m - 256) / cpu_bandwidth for m in (256, 1 << 21)}
    fitted = measure.fit("all_reduce", n, samples, processes=n, cpu_samples=cpu)
    assert fitted.cpu_call_seconds == pytest.approx(cpu_call)
    assert fitted.cpu_bandwidth == pytest.approx(cpu_bandwidth)


def test_cli_calibrate_writes_the_profile_and_plans_with_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    manifest = {
        "apiVersion": "meshtrain.io/v1alpha1",
        "kind": "TrainingJob",
        "metadata": {"name": "t"},
    }
    path.write_text(yaml.safe_dump({**manifest, "spec": _tiny_dp2()}))
    argv = ["plan", str(path), "--calibrate", "--calibration-seconds", "0.02"]
    argv += ["--profile-name", "mine", "--profiles-dir", str(tmp_path / "p"), "--json"]
    assert main.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"]["name"] == "mine" and doc["profile"]["calibrated"] is True
    assert doc["confidence"]["calibrated_here"] is True
    measured = profiles.get("mine", [tmp_path / "p"])
    assert {(f.op, f.members, f.processes) for f in measured.collectives} == {
        (op, 2, 2) for op in profiles.COLLECTIVE_OPS
    }
    assert all(f.alpha > 0 and f.bandwidth > 0 for f in measured.collectives)
    assert all(f.cpu_call_seconds > 0 and f.cpu_bandwidth > 0 for f in measured.collectives)
    assert measured.peak_flops > 0 and measured.op_overhead > 0
    # CPU-time figures: the work model's; the cores the two ranks received, at most the host's.
    assert measured.core_flops > 0 and measured.core_op_overhead > 0
    assert 0 < measured.available_cores <= measured.cores
    assert estimate.make_plan(loading.parse_spec(_tiny_dp2()), measured).time.available_cores > 0
    assert list(measured.flops_by_ranks) == [2]
    # The step loop's cost: a real run of the layout, rank 0's CPU per step after warm-up.
    loop = measured.calibration["step_loop_run"]
    assert len(loop["rank0_cpu_seconds"]) == step_loop.LOOP_STEPS - step_loop.LOOP_STEPS // 2
    assert all(c > 0 for c in loop["rank0_cpu_seconds"])
    assert measured.calibration["host"] == socket.gethostname()
    assert measured.calibration["backend"] == "gloo" and measured.calibration["processes"] == 2
    job = loading.parse_spec(_tiny_dp2())
    assert estimate.make_plan(job, measured).time.step_seconds == pytest.approx(
        doc["time"]["step_seconds"]
    )
    assert main.main(["plan", str(path), "--calibrate", "--calibration-seconds", "0"]) == 2
    assert "--calibration-seconds must be > 0" in capsys.readouterr().err


def test_search_with_calibrate_measures_the_best_grids_on_this_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``plan --search --calibrate``: calibrated for dp2, then a step-loop run of each best grid.

    Two ranks of the tiny model have three grids (dp2, pp2, tp2); all are
    measured, so every listed layout is flagged, and the ranking is still by
    predicted step.
    """
    path = tmp_path / "job.yaml"
    manifest = {"apiVersion": "meshtrain.io/v1alpha1", "kind": "TrainingJob"}
    path.write_text(yaml.safe_dump({**manifest, "metadata": {"name": "t"}, "spec": _tiny_dp2()}))
    argv = ["plan", str(path), "--calibrate", "--calibration-seconds", "0.02", "--search"]
    argv += ["--profiles-dir", str(tmp_path / "p"), "--top", "50", "--json"]
    assert main.main(argv) == 0
    captured = capsys.readouterr()
    assert "measuring the step loop of the 3 best dp/pp/tp grids" in captured.err
    layouts = json.loads(captured.out)["layouts"]
    grids = {
        (r["parallelism"]["data"], r["parallelism"]["pipeline"], r["parallelism"]["tensor"])
        for r in layouts
    }
    assert grids == {(2, 1, 1), (1, 2, 1), (1, 1, 2)}
    assert all(r["grid_measured"] for r in layouts)
    steps = [r["step_seconds"] for r in layouts]
    assert steps == sorted(steps)


@pytest.fixture
def solo_group() -> Iterator[dist.ProcessGroup]:
    """A gloo world of this process alone, and its one-process group."""
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield dist.new_group([0])
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("tensor", [1, 2, 4])
def test_the_calibrated_block_is_one_tensor_rank_s_share_as_the_planner_counts_it(
    tensor: int, solo_group: dist.ProcessGroup
) -> None:
    """Its parameters are the planner's per-rank block, and torch counts the FLOPs the rate divides."""
    spec = loading.parse_spec(
        JobBuilder()
        .layout(1, 1, tensor)
        .model(preset="tiny", layers=2, hidden=64, heads=4, seqLen=32)
        .training(precision="fp32", microBatch=2)
        .raw()
    )
    shape = spec.model.shape()
    block = measure.rank_block(spec, solo_group)
    assert sum(p.numel() for p in block.parameters()) == parameters.layer_params(shape, tensor)
    x = torch.randn(2, shape.seq_len, shape.hidden, requires_grad=True)
    with FlopCounterMode(display=False) as counted:
        block(x).sum().backward()
    tokens = 2 * shape.seq_len
    planner = (
        6 * parameters.layer_params(shape, tensor) + 12 * shape.seq_len * shape.hidden / tensor
    )
    assert counted.get_total_flops() == pytest.approx(planner * tokens, rel=0.02)


def test_the_step_loop_run_sends_the_job_s_messages_where_its_block_is_affordable(
    solo_group: dist.ProcessGroup,
) -> None:
    """The run's pipeline messages are the job's size; a wide block keeps its width and runs fewer tokens."""
    small = loading.parse_spec(
        JobBuilder()
        .layout(1, 2, 1)
        .model(preset="tiny", layers=4, hidden=128, heads=4, seqLen=128)
        .training(precision="fp32", microBatch=4, globalBatch=16)
        .parallelism(microBatches=4)
        .raw()
    )
    loop = loading.parse_spec(step_loop.loop_job(small, "/nonexistent"), "loop")
    assert loop.model.shape().layers == 2
    message = loop.training.micro_batch * loop.model.shape().seq_len * loop.model.shape().hidden
    assert message == 4 * 128 * 128

    wide = loading.parse_spec(
        JobBuilder()
        .layout(1, 2, 2)
        .model(preset="tiny", layers=24, hidden=2048, heads=16, seqLen=2048)
        .training(precision="fp32", microBatch=8)
        .raw()
    )
    loop = loading.parse_spec(step_loop.loop_job(wide, "/nonexistent"), "loop")
    shape = loop.model.shape()
    assert shape.hidden == 2048 and loop.parallelism.tensor == 2
    assert shape.seq_len % 2 == 0 and loop.training.micro_batch == 1
    block = measure.rank_block(loop, solo_group)
    x = torch.randn(1, shape.seq_len, shape.hidden)
    with torch.no_grad(), FlopCounterMode(display=False) as counted:
        block(x)
    assert (
        0.5 * step_loop.LOOP_ACTION_FLOPS < counted.get_total_flops() <= step_loop.LOOP_ACTION_FLOPS
    )


def test_the_trainer_s_tensor_parallel_calls_fit_what_the_plan_waits_for_them() -> None:
    """Fitted from the step-loop run's own calls, the planner's count of them adds up to the seconds and CPU they took.

    The trainer's trace, not the planner, says how many tensor-parallel calls of
    which size a step makes, how long each waited and what CPU its process
    spent meanwhile; a planner that counted other calls or bytes would price
    a different sum.
    """
    raw = _tiny_dp2()
    raw["parallelism"].update(data=1, tensor=2)
    job = loading.parse_spec(raw)
    micro_benchmark = profiles.CollectiveFit(
        "all_reduce",
        2,
        alpha=0.0,
        bandwidth=1e9,
        processes=2,
        cpu_call_seconds=1e-5,
        cpu_bandwidth=1e10,
    )
    profile = dataclasses.replace(
        profiles.get("cpu"),
        cores=2,
        core_flops=1e10,
        collectives=(micro_benchmark,),
        calibration={"host": socket.gethostname()},
    )
    fitted = measure.measure_step_loop(job, profile)
    loop_run = fitted.calibration["step_loop_run"]
    calls = loop_run["tp_calls"]
    assert set(calls) == {"all_reduce"} and calls["all_reduce"]["calls"] > 0
    assert [(f.op, f.members) for f in fitted.tp_collectives] == [("all_reduce", 2)]
    loop = loading.parse_spec(step_loop.loop_job(job, "/nonexistent"), "loop")
    rank_steps = loop.world_size * (step_loop.LOOP_STEPS - step_loop.LOOP_STEPS // 2)
    planned = estimate.make_plan(loop, fitted).time.stages[0].tp
    assert planned == pytest.approx(calls["all_reduce"]["seconds"] / rank_steps, rel=1e-6)
    # Nothing asynchronous runs beside a tp-only layout's calls: each one timed its CPU.
    reduce = calls["all_reduce"]
    assert reduce["cpu_calls"] == reduce["calls"] and reduce["cpu_bytes"] == reduce["bytes"]
    assert 0 < reduce["cpu_seconds"] <= reduce["seconds"] * 4  # a process of a few threads
    # The work bound's CPU of those calls beyond their bytes (a zero cost would mean unmeasured).
    free_calls = dataclasses.replace(
        fitted,
        tp_collectives=tuple(
            dataclasses.replace(f, cpu_call_seconds=1e-15) for f in fitted.tp_collectives
        ),
    )
    call_cpu = (
        estimate.make_plan(loop, fitted).time.rank_cpu_seconds[0]
        - estimate.make_plan(loop, free_calls).time.rank_cpu_seconds[0]
    )
    copying = reduce["bytes"] / micro_benchmark.cpu_bandwidth
    assert call_cpu == pytest.approx(max(0.0, reduce["cpu_seconds"] - copying) / rank_steps)
    # Priced with all of that, rank 0's CPU per step is what the step log measured (the
    # step loop is the rest), or more where the calls alone exceed it.
    measured = statistics.median(loop_run["rank0_cpu_seconds"])
    priced = estimate.make_plan(loop, fitted).time.rank_cpu_seconds[0]
    if fitted.rank_step_cpu_seconds > 0:
        assert priced == pytest.approx(measured, rel=1e-6)
    else:
        assert priced >= measured


def test_a_layout_s_step_loop_is_measured_from_the_micro_benchmarks_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measuring a --search candidate with a profile calibrated for another layout gives what a clean profile gives.

    The other layout's step loop, tensor-parallel fits and message latencies
    say nothing about this run; subtracted from it, they would make every
    measured grid look cheaper than it ran.  The run is a recorded one (its
    figures as :func:`step_loop_run.run` returns them), so both measure the same.
    """
    raw = _tiny_dp2()
    raw["parallelism"].update(data=1, tensor=2)
    job = loading.parse_spec(raw)
    recorded = {
        "rank0_cpu_seconds": [0.5, 0.6, 0.55],
        "outside_events_seconds": {0: 0.002, 1: 0.003},
        "actions": 8,
        "tp_calls": {
            "all_reduce": {"calls": 99, "seconds": 0.2, "bytes": 1e7}
            | {"cpu_calls": 99, "cpu_bytes": 1e7, "cpu_seconds": 0.1}
        },
        "messages": {},
    }
    monkeypatch.setattr(step_loop, "run", lambda _job: recorded)
    micro_benchmark = profiles.CollectiveFit(
        "all_reduce",
        2,
        alpha=1e-4,
        bandwidth=1e9,
        processes=2,
        cpu_call_seconds=2e-4,
        cpu_bandwidth=1e10,
    )
    clean = dataclasses.replace(
        profiles.get("cpu"), cores=2, core_flops=1e10, collectives=(micro_benchmark,)
    )
    other = dataclasses.replace(
        clean,
        rank_step_cpu_seconds=0.3,
        step_loop_between_share=0.2,
        tp_collectives=(dataclasses.replace(micro_benchmark, cpu_call_seconds=5e-3),),
        activation_message_seconds=0.01,
        gradient_message_seconds=0.02,
    )
    from_clean = measure.measure_step_loop(job, clean)
    assert from_clean.rank_step_cpu_seconds > 0 and from_clean.tp_collectives
    assert measure.measure_step_loop(job, other) == from_clean


@pytest.mark.alone  # a message counts only while its receiver already waits: CPU contention hides them
def test_a_pipeline_s_messages_are_timed_on_the_trainer_s_own_sends() -> None:
    """The step-loop run of a pp2 GPipe job times both message kinds from its ranks' traces.

    GPipe's stage 1 waits for micro-batch 0's activations and stage 0, its
    forwards done, for micro-batch 0's gradients in every step, so both kinds
    are measured.  The two ranks' traces meet on the wall clock only: a
    message that seemed to arrive before it was sent, or to take a second,
    would be two clocks misread.
    """
    raw = _tiny_dp2()
    raw["parallelism"].update(data=1, pipeline=2, schedule="gpipe")
    job = loading.parse_spec(raw)
    messages = step_loop.run(job)["messages"]
    assert set(messages) == {"activations", "gradients"}
    assert all(0 < s < 1 for samples in messages.values() for s in samples), messages
