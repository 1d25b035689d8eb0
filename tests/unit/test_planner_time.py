"""The time model's arithmetic: pipeline replay, op counts, calibrated links and cores, confidence, search.

Pure and fast; the timing targets themselves are checked by
benchmarks/bench_planner_time.py, never here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import yaml
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import bench_planner_time as bench
from meshtrain.api import loading
from meshtrain.api import spec as api_spec
from meshtrain.cli import main
from meshtrain.planner import cluster, comm, estimate, profiles, report, search, validation
from meshtrain.planner.timing import (
    core_share,
    cpu_host,
    device_node,
    network,
    pipeline_window,
    stage_work,
    step_time,
)
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import schedules
from meshtrain.trainer.parallel.loss import lm_loss
from meshtrain.trainer.telemetry import recording, stepstats
from tests.builders import JobBuilder


def job(**parallelism) -> api_spec.TrainingJobSpec:
    p = {"data": 1, "pipeline": 1, "tensor": 1, **parallelism}
    builder = JobBuilder().layout(p.pop("data"), p.pop("pipeline"), p.pop("tensor"))
    return loading.parse_spec(builder.parallelism(**p).training(precision="fp32").raw())


def calibrated_cpu(**changes) -> profiles.Profile:
    base = profiles.get("cpu")
    values = {
        "name": "cpu-test",
        "peak_flops": 2e10,
        "achievable_fraction": 1.0,
        "op_overhead": 5e-6,
        "cores": 2,
        "flops_by_ranks": {2: 2e10},
        "collectives": (
            profiles.CollectiveFit("all_reduce", 2, alpha=3e-4, bandwidth=5e8, processes=2),
            profiles.CollectiveFit("send", 2, alpha=1e-4, bandwidth=1e9, processes=2),
        ),
        "calibration": {"host": "here", "device": "test cpu", "backend": "gloo"},
        **changes,
    }
    return dataclasses.replace(base, **values)


# --- pipeline replay -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "p", "m", "v"),
    [("gpipe", 2, 4, 1), ("1f1b", 4, 8, 1), ("1f1b", 3, 2, 1), ("interleaved-1f1b", 2, 4, 2)],
)
def test_window_of_equal_stages_is_the_trainers_unit_time_simulation(
    schedule: str, p: int, m: int, v: int
) -> None:
    # Every action (one chunk, forward or backward) one time unit, free sends: the trainer's simulate().
    reference = schedules.simulate(schedule, p, m, v)
    window = pipeline_window.window(
        m, [pipeline_window.StageDurations(float(v), float(v))] * p, 0.0, v
    )
    assert window.seconds == max(t for line in reference for t, _ in line) + 1
    assert window.busy == tuple(float(len(line)) for line in reference)
    assert window.idle_share(0) == pytest.approx(pipeline_window.bubble_ratio(p, m, v))


def test_slow_sends_and_a_heavy_last_stage_lengthen_the_window() -> None:
    equal = pipeline_window.window(4, [pipeline_window.StageDurations(1.0, 2.0)] * 2, 0.0)
    sends = pipeline_window.window(4, [pipeline_window.StageDurations(1.0, 2.0)] * 2, 0.5)
    heavy = pipeline_window.window(
        4, [pipeline_window.StageDurations(1.0, 2.0), pipeline_window.StageDurations(2.0, 4.0)], 0.0
    )
    assert equal.seconds == pytest.approx(3.0 * (4 + 2 - 1))
    # The first activation crosses the boundary forward and the last gradient backward.
    assert sends.seconds == pytest.approx(equal.seconds + 2 * 0.5)
    # Walked by hand: stage 1 is busy 4 x 6 once its first forward arrives (after stage 0's 1) and
    # stage 0 ends with the last backward (2) after it: 27.
    assert heavy.seconds == pytest.approx(27.0)
    assert heavy.idle_share(0) > equal.idle_share(0)


def test_stage_0_s_idle_share_is_the_bubble_the_trainer_measures_after_its_closing_collectives() -> (
    None
):
    """Exposed data-parallel reduction counts as work, the tied-embedding all-reduce after it as idle."""
    # Stage 0 of a two-stage 1F1B with m = 2, one time unit per forward, two per backward.
    replayed = pipeline_window.window(2, [pipeline_window.StageDurations(1.0, 2.0)] * 2, 0.0)
    compute = [(0.0, 1.0), (1.0, 2.0), (4.0, 6.0), (7.0, 9.0)]
    assert replayed.seconds == 9.0 and replayed.busy[0] == sum(b - a for a, b in compute)
    exposed, closing = 0.5, 0.25
    events = [recording.Event("compute", "forward", a, b) for a, b in compute] + [
        recording.Event("collective", "all_reduce", 8.0, 9.0 + exposed, group="dp"),
        recording.Event("collective", "all_reduce", 9.5, 9.5 + closing, group="pp"),
    ]
    events[2] = dataclasses.replace(events[2], kind="backward")
    events[3] = dataclasses.replace(events[3], kind="backward")
    facts = stepstats.JobFacts(2, 2, 1, 2, {"dp": 2, "pp": 2, "tp": 1}, 1.0, 1.0)  # p, m, v, world
    measured = stepstats.summarise(
        events, facts, step=1, loss=0.0, tokens=1, seconds=10.0, start=0.0
    ).bubble_ratio
    assert replayed.idle_share(0, closing=closing, exposed=exposed) == pytest.approx(measured)
    assert (
        replayed.idle_share(0, exposed=exposed) < measured
    )  # a closing all-reduce counted as work


# --- op counts -------------------------------------------------------------------------------------


class _CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_op_counts_are_the_trainer_models_dispatched_ops(chunks: int) -> None:
    """Per block, and outside the blocks with the trainer's fused loss walking ``chunks`` token chunks."""
    config = gpt.GPTConfig(vocab=96, seq_len=16, layers=2, hidden=32, heads=4, ffn_hidden=128)
    chunk_bytes = 4 * 96 * (32 // chunks)  # 32 tokens a micro-batch
    counts = []
    for layers in (1, 2):
        model = gpt.GPT(dataclasses.replace(config, layers=layers))
        tokens = torch.randint(0, 96, (2, 16))
        with _CountOps() as forward:
            loss = lm_loss(model, tokens, tokens, chunk_bytes=chunk_bytes)
        with _CountOps() as backward:
            loss.backward()
        counts.append((forward.count, backward.count))
    per_block = (counts[1][0] - counts[0][0], counts[1][1] - counts[0][1])
    assert per_block == stage_work.BLOCK_OPS
    outside = (counts[0][0] - per_block[0], counts[0][1] - per_block[1])
    planned = stage_work.OUTSIDE_BLOCK_OPS[0] + stage_work.LOSS_OPS_PER_CHUNK * chunks
    assert planned == pytest.approx(outside[0], rel=0.02)
    assert stage_work.OUTSIDE_BLOCK_OPS[1] == outside[1]


# --- calibrated figures ----------------------------------------------------------------------------


def test_a_measured_fit_replaces_the_links_alpha_and_beta() -> None:
    profile = calibrated_cpu()
    link = network.links(profile)["nvlink"]
    reduce = comm.Collective(group="dp", op="all_reduce", calls=3, nbytes=10**6, members=2)
    assert network.collective_seconds(reduce, link) == pytest.approx(3 * 2 * 3e-4 + 10**6 / 5e8)
    # No fit for all-gather: the datasheet figures of the link.
    gather = comm.Collective(group="dp", op="all_gather", calls=1, nbytes=10**6, members=2)
    assert network.collective_seconds(gather, link) == pytest.approx(
        profile.nvlink_latency + 0.5 * 10**6 / profile.nvlink_bandwidth
    )


def test_ranks_beyond_the_cores_share_them() -> None:
    profile = calibrated_cpu()
    flops_per_rank = core_share.flops_per_rank
    assert flops_per_rank(profile, 2) == pytest.approx(2e10)  # measured with 2 ranks, 1 thread each
    assert flops_per_rank(profile, 4) == pytest.approx(1e10)  # 4 single-thread ranks on 2 cores
    assert flops_per_rank(profile, 1) == pytest.approx(4e10)  # one rank gets both cores
    assert flops_per_rank(profiles.get("h100-sxm"), 8) == profiles.get("h100-sxm").achievable_flops


def test_op_overhead_and_shared_cores_enter_the_step() -> None:
    spec = job(data=2)
    quiet = estimate.make_plan(spec, calibrated_cpu(op_overhead=0.0)).time
    loaded = estimate.make_plan(spec, calibrated_cpu()).time
    stage = loaded.stages[0]
    ops = sum(stage_work.rank_ops_per_microbatch(spec.model.shape(), 1, 0, False))
    assert stage.overhead == pytest.approx(ops * spec.parallelism.micro_batches * 5e-6)
    assert loaded.step_seconds > quiet.step_seconds
    four = loading.parse_spec(JobBuilder().layout(4, 1, 1).training(precision="fp32").raw())
    assert estimate.make_plan(four, calibrated_cpu()).time.oversubscription == 2.0


def cpu_time_profile(**changes) -> profiles.Profile:
    """A calibrated CPU host with CPU-time figures: the work-over-cores model applies."""
    return calibrated_cpu(
        **{"core_flops": 4e10, "core_op_overhead": 2e-6, "available_cores": 2.0, **changes}
    )


def test_cpu_cost_fit_prices_calls_and_bytes_in_cpu_seconds() -> None:
    fit = profiles.CollectiveFit(
        "all_reduce", 4, alpha=1e-3, bandwidth=1e8, cpu_call_seconds=2e-4, cpu_bandwidth=1e9
    )
    link = network.Link("nvlink", 1.0, 1.0, (cpu_host.cpu_cost_fit(fit),))
    reduce = comm.Collective(group="dp", op="all_reduce", calls=3, nbytes=10**6, members=4)
    assert network.collective_seconds(reduce, link) == pytest.approx(3 * 2e-4 + 10**6 / 1e9)
    unmeasured = dataclasses.replace(fit, cpu_call_seconds=0.0)
    assert cpu_host.cpu_cost_fit(unmeasured) == unmeasured


def test_cpu_host_step_is_the_larger_of_work_over_cores_and_the_critical_path() -> None:
    spec = loading.parse_spec(
        JobBuilder().layout(2, 2, 1).training(precision="fp32").raw()
    )  # four single-thread ranks on two cores
    shape, par = spec.model.shape(), spec.parallelism
    free = estimate.make_plan(spec, cpu_time_profile()).time
    busy = estimate.make_plan(spec, cpu_time_profile(available_cores=0.25)).time
    for t in (free, busy):
        assert t.step_seconds == pytest.approx(
            max(t.dependency_seconds, t.cpu_seconds / t.available_cores)
        )
    # CPU work does not depend on what other tenants leave; it holds every rank's compute.
    assert busy.cpu_seconds == pytest.approx(free.cpu_seconds)
    flops = sum(
        stage_work.rank_flops_per_microbatch(shape, 2, 1, stage, spec.training.micro_batch)
        for stage in range(2)
    )
    assert free.cpu_seconds > par.data * flops * par.micro_batches / 4e10
    # A quarter of a core: work-bound.  The k runnable ranks share it (0.25 / k each)
    # where on two cores they ran at min(1, 2 / k) >= 0.5: the pipeline's compute is
    # 8x slower, its sends (priced at one rank's speed, 1 -> 0.25) 4x.
    assert busy.work_bound and busy.step_seconds == pytest.approx(busy.cpu_seconds / 0.25)
    assert 4 * free.pipeline_seconds < busy.pipeline_seconds <= 8 * free.pipeline_seconds
    assert busy.available_cores == 0.25 and free.available_cores == 2.0
    # Unmeasured available cores: all of them; GPU profiles keep the per-device model.
    assert cpu_host.available_cores(cpu_time_profile(available_cores=0.0)) == 2.0
    gpu = estimate.make_plan(spec, profiles.get("h100-sxm")).time
    assert gpu.cpu_seconds == 0.0 and gpu.available_cores == 0.0 and not gpu.work_bound


def test_the_profile_names_one_kind_of_machine() -> None:
    """The profile says which kind of machine prices the job, and only a shared host reports its load.

    No ``cores``: a device per rank; ``cores`` alone: each rank a device at its share of them;
    CPU-time figures too: CPU seconds over the cores, the one kind that reports CPU work.
    """
    spec = job(data=2)
    gpu, shared, cpu = profiles.get("h100-sxm"), calibrated_cpu(), cpu_time_profile()
    assert type(step_time.machine_for(spec, gpu)) is device_node.DeviceNode
    assert type(step_time.machine_for(spec, shared)) is core_share.CoreShareHost
    assert type(step_time.machine_for(spec, cpu)) is cpu_host.CpuHost
    assert estimate.make_plan(spec, gpu).time.host is None
    by_share = estimate.make_plan(spec, shared).time.host
    assert by_share is not None and by_share.oversubscription == 1.0 and by_share.work is None
    by_cpu = estimate.make_plan(spec, cpu).time.host
    assert by_cpu is not None and by_cpu.work is not None and by_cpu.work.available_cores == 2.0


def test_calibrated_message_latencies_delay_the_replayed_pipeline() -> None:
    """Latencies measured on the trainer's own messages hold up the hop they belong to.

    pp2 GPipe with a rank per core: stage 0's last backward needs stage 1's
    last gradients, so a 10 ms gradient latency in place of the send fit's
    (a few tenths of a millisecond) adds one hop of about 10 ms to the window
    and to stage 0's idle share, and a 10 ms activation latency another; a
    measured latency replaces the fit (below it too), and a GPU profile's
    closed-form window ignores them.
    """
    spec = job(pipeline=2, schedule="gpipe", microBatches=4)
    free = estimate.make_plan(spec, cpu_time_profile()).time
    slow = estimate.make_plan(spec, cpu_time_profile(gradient_message_seconds=0.01)).time
    assert slow.pipeline_seconds - free.pipeline_seconds == pytest.approx(0.01, abs=1e-3)
    assert slow.bubble_stage0 > free.bubble_stage0
    both = estimate.make_plan(
        spec, cpu_time_profile(gradient_message_seconds=0.01, activation_message_seconds=0.01)
    ).time
    assert both.pipeline_seconds - slow.pipeline_seconds == pytest.approx(0.01, abs=1e-3)
    # Measured, a latency replaces the fit's price of the message, below it too.
    prompt = cpu_time_profile(gradient_message_seconds=1e-9, activation_message_seconds=1e-9)
    assert estimate.make_plan(spec, prompt).time.pipeline_seconds < free.pipeline_seconds
    gpu = profiles.get("h100-sxm")
    assert (
        estimate.make_plan(spec, dataclasses.replace(gpu, gradient_message_seconds=0.01)).time
        == estimate.make_plan(spec, gpu).time
    )


def test_a_rank_per_core_waits_its_tensor_collectives_wall_time_and_shared_cores_do_not() -> None:
    """Calibrated wall latency of the TP all-reduce, CPU figures unchanged.

    tp2 on two cores: every TP call idles its core for its wall time, so the
    critical path (and the step) grows with it while the CPU work does not.
    dp2·tp2 on two cores: another rank runs while one waits; the step stays
    the work bound and does not move.
    """

    def plan(parallel: api_spec.TrainingJobSpec, wall_alpha: float) -> step_time.TimePlan:
        fit = profiles.CollectiveFit(
            "all_reduce",
            2,
            alpha=wall_alpha,
            bandwidth=5e8,
            processes=2,
            cpu_call_seconds=1e-4,
            cpu_bandwidth=5e9,
        )
        return estimate.make_plan(parallel, cpu_time_profile(collectives=(fit,))).time

    alone, shared = job(tensor=2), job(data=2, tensor=2)
    fast, slow = plan(alone, 1e-5), plan(alone, 5e-3)
    assert slow.cpu_seconds == pytest.approx(fast.cpu_seconds)
    calls = sum(
        c.calls
        for c in estimate.make_plan(alone, cpu_time_profile()).comm[0].collectives
        if c.group == "tp"
    )
    # two ring steps of alpha per all-reduce of two members, on the critical path
    assert slow.dependency_seconds - fast.dependency_seconds == pytest.approx(
        calls * 2 * (5e-3 - 1e-5), rel=0.01
    )
    assert slow.step_seconds > fast.step_seconds
    crowded_fast, crowded_slow = plan(shared, 1e-5), plan(shared, 5e-3)
    assert crowded_slow.step_seconds == pytest.approx(crowded_fast.step_seconds)


def test_profile_file_round_trip_and_errors(tmp_path: Path) -> None:
    profile = cpu_time_profile(
        collectives=(
            profiles.CollectiveFit(
                "all_reduce", 2, 3e-4, 5e8, 2, cpu_call_seconds=1e-4, cpu_bandwidth=2e9
            ),
        )
    )
    path = tmp_path / "cpu-test.yaml"
    path.write_text(yaml.safe_dump(profiles.to_mapping(profile)))
    loaded = profiles.get("cpu-test", [tmp_path])
    assert dataclasses.replace(loaded, path="") == dataclasses.replace(profile, path="")
    assert loaded.calibrated and not profiles.get("cpu").calibrated
    bad = profiles.to_mapping(profile)
    bad["collectives"][0]["op"] = "broadcast"
    with pytest.raises(profiles.ProfileError, match=r"collectives\[0\]: 'op' must be one of"):
        profiles.from_mapping(bad, "x.yaml")


# --- confidence ------------------------------------------------------------------------------------


BAND = validation.Band(
    results_files=("benchmarks/results/planner_time-vm.json",),
    measured_at="2026-11-23T11:00:00Z",
    machine="vm, AMD EPYC, 2 cores",
    layouts=10,
    min_ratio=0.8,
    max_ratio=1.3,
    median_abs_error=0.12,
    load_average=(3.0, 9.5),
    max_bubble_error=0.04,
)


def test_confidence_says_which_profile_where_and_the_band() -> None:
    here = validation.confidence(calibrated_cpu(), "here", BAND)
    assert here.calibrated_here and "calibrated on this machine" in here.statement
    assert "0.80-1.30" in here.statement and "10 layouts" in here.statement
    elsewhere = validation.confidence(calibrated_cpu(), "other-host", BAND)
    assert (
        not elsewhere.calibrated_here and "another machine (here, test cpu)" in elsewhere.statement
    )
    for_dp4 = calibrated_cpu(calibration={"host": "here", "job_layout": "dp4·pp1·tp1"})
    other = validation.confidence(for_dp4, "here", BAND, "dp2·pp2·tp1")
    assert "for layout dp4·pp1·tp1, not this one (dp2·pp2·tp1)" in other.statement
    assert (
        "not this one" not in validation.confidence(for_dp4, "here", BAND, "dp4·pp1·tp1").statement
    )
    datasheet = validation.confidence(profiles.get("h100-sxm"), "here", BAND)
    assert not datasheet.calibrated and "not calibrated" in datasheet.statement
    assert "not this one" in datasheet.statement


def _committed_band() -> validation.Band:
    band = validation.load_band()
    if band is None:
        pytest.fail(
            "meshtrain/planner/validation.json is missing: run benchmarks/bench_planner_time.py"
        )
    return band


def test_committed_band_matches_its_results_files() -> None:
    band = _committed_band()
    root = Path(__file__).parents[2]
    assert validation.band_from_results([root / f for f in band.results_files]) == band


def test_the_validation_runs_predicted_again_keep_the_required_layouts_within_target() -> None:
    """A model change is checked against every committed run's measurements, without running one."""
    for results in _committed_band().results_files:
        document = json.loads((Path(__file__).parents[2] / results).read_text())
        assert set(bench.REQUIRED) <= {row["layout"] for row in document["results"]["layouts"]}
        summary = bench.repredict(document)["results"]["summary"]
        assert summary["required_misses"] == [], results


# --- search ----------------------------------------------------------------------------------------


def test_search_ranks_valid_fitting_layouts_by_predicted_time() -> None:
    base = loading.parse_spec(
        JobBuilder()
        .layout(8, 1, 1, gpus_per_node=8)
        .model(preset="1.3b")
        .parallelism(microBatches=2)
        .training(microBatch=4)
        .raw()
    )
    h100 = profiles.get("h100-sxm")
    found = search.search(base, h100, world=16, limit=5)
    assert len(found) == 5
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    for candidate in found:
        raw = base.model_dump(by_alias=True, exclude_none=True)
        layout = {k: v for k, v in candidate.parallelism.items() if k != "microBatch"}
        raw["parallelism"].update(layout)
        raw["training"]["microBatch"] = candidate.parallelism["microBatch"]
        spec = loading.parse_spec(raw)  # passes the spec's rules
        assert spec.world_size == 16 and spec.global_batch == base.global_batch
        plan = estimate.make_plan(spec, h100)
        assert plan.memory.fits
        assert plan.time.step_seconds == pytest.approx(candidate.step_seconds)
    # Nothing left out was faster and valid: the best of the whole enumeration is the first.
    every = search.search(base, h100, world=16, limit=10_000)
    assert every[0] == found[0] and len(every) > 5


def test_search_tries_every_schedule_whatever_schedule_the_job_declares() -> None:
    """A job that runs interleaved 1F1B still gets GPipe and 1F1B candidates (with one chunk per rank)."""
    base = JobBuilder().layout(2, 2, 1, gpus_per_node=4).parallelism(microBatches=4)
    plain = loading.parse_spec(base.clone().parallelism(schedule="1f1b").raw())
    interleaved = loading.parse_spec(
        base.clone().parallelism(schedule="interleaved-1f1b", virtualStages=2).raw()
    )
    tried = [[change for change, _ in search.candidates(job, 8)] for job in (plain, interleaved)]
    assert {c["schedule"] for c in tried[1]} == {"gpipe", "1f1b", "interleaved-1f1b"}
    assert tried[1] == tried[0]


def test_search_on_a_cluster_keeps_only_placeable_layouts() -> None:
    base = loading.parse_spec(
        JobBuilder().layout(4, 1, 1, gpus_per_node=4).training(precision="fp32").raw()
    )
    nodes = cluster.parse_text("nodes:\n  - {name: a, gpus: 4}\n  - {name: b, gpus: 2}\n")
    found = search.search(base, calibrated_cpu(), world=8, nodes=nodes, limit=3)
    assert found == []  # 8 ranks in pods of 4 need two nodes with 4 free GPUs
    found = search.search(base, calibrated_cpu(), world=4, nodes=nodes, limit=3)
    assert found and all(c.nodes == ("a",) for c in found)


def test_cli_search_and_confidence_in_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "job.yaml"
    raw = JobBuilder().layout(2, 1, 1).training(precision="fp32").raw()
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "meshtrain.io/v1alpha1",
                "kind": "TrainingJob",
                "metadata": {"name": "j"},
                "spec": raw,
            }
        )
    )
    assert main.main(["plan", str(path), "--search", "--world", "4", "--top", "3", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "meshtrain.plan-search/v1" and 1 <= len(doc["layouts"]) <= 3
    assert doc["confidence"]["calibrated"] is False
    assert main.main(["plan", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["confidence"]["profile"] == "cpu" and doc["profile"]["calibrated"] is False
    assert sorted(doc["confidence"]) == [
        "band",
        "calibrated",
        "calibrated_for",
        "calibrated_here",
        "calibrated_on",
        "profile",
        "statement",
    ]


def test_a_measuring_search_prices_its_best_grids_with_their_own_step_loop() -> None:
    """The three best distinct grids are measured once each, on their best layout, and ranked again.

    The measurement stands in for calibration's step-loop run: it makes the
    best grid's step loop cost a second per step, so that grid falls behind
    every other and the fourth grid, now among the best three, is measured
    too; only the measured grids' candidates are flagged.
    """
    spec = job(data=2)
    profile = cpu_time_profile()
    first = search.search(spec, profile, world=4, nodes=None, limit=100)
    grids = list(dict.fromkeys(search.grid(c.parallelism) for c in first))[: search.MEASURED_GRIDS]
    measured: list[api_spec.TrainingJobSpec] = []

    def measure(layout: api_spec.TrainingJobSpec, base: profiles.Profile) -> profiles.Profile:
        measured.append(layout)
        key = (layout.parallelism.data, layout.parallelism.pipeline, layout.parallelism.tensor)
        return dataclasses.replace(base, rank_step_cpu_seconds=1.0 if key == grids[0] else 0.0)

    found = search.search(spec, profile, world=4, nodes=None, limit=100, measure=measure)
    best_of = {g: next(c for c in first if search.grid(c.parallelism) == g) for g in grids}
    measured_grids = [
        (m.parallelism.data, m.parallelism.pipeline, m.parallelism.tensor) for m in measured
    ]
    assert measured_grids[:3] == grids and len(measured_grids) == len(set(measured_grids)) == 4
    best_three = list(dict.fromkeys(search.grid(c.parallelism) for c in found))[:3]
    assert set(best_three) <= set(measured_grids) and grids[0] not in best_three
    for layout, g in zip(measured, grids):
        assert layout.training.micro_batch == best_of[g].parallelism["microBatch"]
        assert layout.parallelism.micro_batches == best_of[g].parallelism["microBatches"]
    assert [c.step_seconds for c in found] == sorted(c.step_seconds for c in found)
    for c in found:
        assert c.grid_measured == (search.grid(c.parallelism) in measured_grids)
    slow = [c for c in found if search.grid(c.parallelism) == grids[0]]
    assert slow and all(c.step_seconds > 1.0 for c in slow)
    assert search.grid(found[0].parallelism) != grids[0]


def test_search_says_which_layouts_its_validated_error_cannot_order() -> None:
    """Layouts predicted within the band's median error of the best are flagged, the rest not.

    The committed band's median error is the resolution: a user choosing among
    layouts closer than that must measure them (on this VM two runs of the
    validation put the top pick 6-10% behind a layout predicted 3% slower).
    """
    spec = job(data=2)
    profile = cpu_time_profile()
    found = search.search(spec, profile, world=4, nodes=None, limit=10)
    band = _committed_band()
    stated = validation.confidence(profile, "here", band)
    layouts = report.search_json(found, 4, stated)["layouts"]
    best = layouts[0]["step_seconds"]
    flags = [row["within_error_of_best"] for row in layouts]
    assert flags[0] is True
    assert flags == [row["step_seconds"] / best - 1 <= band.median_abs_error for row in layouts]
    assert False in flags  # some layouts of 4 ranks are further than the band apart
    text = report.search_text(found, 4, profile, stated, placed=False)
    assert ("cannot order them" in text) == (sum(flags) > 1)
    uncalibrated = validation.confidence(profiles.get("cpu"), "here", band)
    assert {
        row["within_error_of_best"] for row in report.search_json(found, 4, uncalibrated)["layouts"]
    } == {None}


def test_planner_says_when_hierarchical_all_reduce_pays() -> None:
    """dp16 over 2 nodes of 8: only a 1/8 shard crosses the slower fabric, so the dp time falls;
    a dp group inside one node has nothing to cross, so hierarchical buys nothing there."""
    h100 = profiles.get("h100-sxm")

    def dp_seconds(data: int, gpus: int, all_reduce: str) -> float:
        raw = (
            JobBuilder()
            .layout(data, 1, 1, gpus_per_node=gpus)
            .model(preset="1.3b")
            .parallelism(allReduce=all_reduce)
            .raw()
        )
        return estimate.make_plan(loading.parse_spec(raw), h100).time.stages[0].dp

    assert dp_seconds(16, 8, "hierarchical") < 0.5 * dp_seconds(16, 8, "flat")
    assert dp_seconds(8, 8, "hierarchical") >= dp_seconds(8, 8, "flat")


@pytest.mark.parametrize(
    "exchange",
    [
        {},
        {"allReduce": "hierarchical"},
        {"gradientCompression": {"mode": "bf16"}},
        {"gradientCompression": {"mode": "int8"}},
        {"gradientCompression": {"mode": "topk"}},
        {"gradientCompression": {"mode": "powersgd", "rank": 4}},
    ],
    ids=["flat", "hierarchical", "bf16", "int8", "topk", "powersgd"],
)
def test_a_bucket_exchange_overlaps_backward_only_as_a_whole_chain(exchange: dict) -> None:
    """The trainer issues each bucket's whole exchange (every leg, every compressed collective) when
    the bucket's gradients are final.  With one bucket that is after the last backward, so nothing of
    the dp time hides behind backward; with many buckets the earlier ones do."""
    h100 = profiles.get("h100-sxm")

    def dp_stage(bucket_mb: float) -> stage_work.StageTime:
        raw = (
            JobBuilder()
            .layout(16, 1, 1, gpus_per_node=8)
            .model(preset="1.3b")
            .parallelism(bucketMb=bucket_mb, **exchange)
            .training(microBatch=64)  # backward long enough to hide all but the last buckets
            .raw()
        )
        return estimate.make_plan(loading.parse_spec(raw), h100).time.stages[0]

    one_bucket = dp_stage(2**16)  # MiB: more than the model's gradients
    assert one_bucket.dp_exposed == pytest.approx(one_bucket.dp, rel=1e-12)
    many = dp_stage(25)
    assert 0 < many.dp_exposed < 0.5 * many.dp


@pytest.mark.parametrize("all_reduce", ["flat", "hierarchical"])
def test_the_last_buckets_whole_chain_is_exposed(all_reduce: str) -> None:
    """The last bucket (in GPT: the token embedding's, whose gradient backward produces last) starts its
    exchange when backward ends: dp_exposed is at least that chain, computed here with the ring
    formula on the fabric from the embedding's bytes alone (a lower bound of the bucket)."""
    h100 = profiles.get("h100-sxm")
    raw = (
        JobBuilder()
        .layout(16, 1, 1, gpus_per_node=8)
        .model(preset="1.3b")
        .parallelism(bucketMb=25, allReduce=all_reduce)
        .training(microBatch=64, precision="fp32")  # backward hides all but the last chain
        .raw()
    )
    job = loading.parse_spec(raw)
    stage = estimate.make_plan(job, h100).time.stages[0]
    shape = job.model.shape()
    model = gpt.GPT(
        gpt.GPTConfig(vocab=96, seq_len=16, layers=2, hidden=32, heads=4, ffn_hidden=128)
    )
    assert next(iter(model.parameters())).shape == (96, 32)  # the embedding is registered first
    grad_bytes = 4  # fp32 gradients
    embedding = shape.vocab * shape.hidden * grad_bytes
    members, nbytes = (16, embedding) if all_reduce == "flat" else (2, embedding / 8)
    last_chain = (
        2 * (members - 1) * h100.nic_latency
        + 2 * (members - 1) / members * nbytes / h100.nic_bandwidth
    )
    assert stage.dp_exposed >= last_chain
    assert stage.dp_exposed < 0.5 * stage.dp  # the earlier buckets still hide behind backward


def test_zero2_hides_each_micro_batchs_reduce_scatters_behind_its_own_backward() -> None:
    """ZeRO-2 moves m reduce-scatters a step, one per micro-batch, each issued in that micro-batch's backward.

    Against ZeRO-1 (one all-reduce of every bucket behind the last backward,
    the same gather after it) it cannot expose more where each micro-batch's
    share fits behind its own backward; charged against one backward, as
    before, it exposed most of its m exchanges.
    """

    def plan(zero: int) -> step_time.TimePlan:
        raw = (
            JobBuilder()
            .layout(16, 1, 1)
            .model(preset="1.3b")
            .training(precision="bf16", microBatch=4, globalBatch=512)
            .parallelism(zeroStage=zero, microBatches=8)
            .raw()
        )
        raw["resources"] = {"gpusPerNode": 8}
        return estimate.make_plan(loading.parse_spec(raw), profiles.get("h100-sxm")).time

    zero1, zero2 = plan(1).stages[0], plan(2).stages[0]
    assert zero2.dp > 2 * zero1.dp  # m reduce-scatters move more than one all-reduce
    assert zero2.dp_exposed <= zero1.dp_exposed
