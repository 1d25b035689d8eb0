"""``meshtrain plan``'s failure planning against an independent reference: a seeded Monte-Carlo run.

The simulation knows nothing of the formulas: it draws exponential times to failure, trains
``tau`` seconds between checkpoints of ``delta`` seconds, throws away the work since the last
checkpoint at each failure and pays a restart (which a failure can interrupt too), and measures
useful over wall time.  The analytic goodput must match it at every interval, and Daly's interval
must sit where the simulated goodput peaks.
"""

from __future__ import annotations

import json
import math
import random

import pytest

from meshtrain.cli import main
from meshtrain.planner import failures
from tests.builders import JobBuilder


def simulate(
    tau: float, delta: float, restart: float, mtbf: float, *, work: float, seed: int
) -> float:
    """Useful seconds over wall seconds for ``work`` seconds of training (whole segments)."""
    rng = random.Random(seed)
    wall = 0.0
    for _ in range(round(work / tau)):
        segment = tau + delta  # work, then the checkpoint that keeps it
        while True:
            failure = rng.expovariate(1.0 / mtbf)
            if failure >= segment:
                wall += segment
                break
            wall += failure  # the segment's work so far is lost
            while True:  # restart; a failure during it starts it again
                during = rng.expovariate(1.0 / mtbf)
                if during >= restart:
                    wall += restart
                    break
                wall += during
    return round(work / tau) * tau / wall


MTBF = 3600.0
DELTA = 36.0  # delta / M = 0.01
RESTART = 180.0
WORK = 20_000 * MTBF  # ~20,000 failures per interval: the simulated goodput's error is ~0.15 %


def test_analytic_goodput_matches_the_simulation_at_every_interval() -> None:
    for tau in (120.0, 300.0, 600.0, 1200.0, 2400.0):
        simulated = simulate(tau, DELTA, RESTART, MTBF, work=WORK, seed=7)
        assert failures.expected_goodput(tau, DELTA, RESTART, MTBF) == pytest.approx(
            simulated, abs=0.005
        ), tau


def test_dalys_interval_is_where_the_simulated_goodput_peaks() -> None:
    grid = [MTBF * f for f in (0.06, 0.09, 0.12, 0.15, 0.18, 0.22, 0.27, 0.33, 0.4, 0.5)]
    # the same seed for every interval (common random numbers): the differences are not noise
    simulated = {tau: simulate(tau, DELTA, RESTART, MTBF, work=WORK, seed=11) for tau in grid}
    best_tau = max(simulated, key=simulated.__getitem__)
    daly = failures.daly_interval(DELTA, MTBF)
    assert daly == pytest.approx(best_tau, rel=0.35)  # the grid steps by ~20-25 %
    assert failures.expected_goodput(daly, DELTA, RESTART, MTBF) == pytest.approx(
        simulated[best_tau], abs=0.005
    )
    # and no interval of the grid does better than Daly's by more than the simulation's noise
    at_daly = simulate(daly, DELTA, RESTART, MTBF, work=WORK, seed=11)
    assert at_daly >= simulated[best_tau] - 0.003


def test_daly_is_the_analytic_optimum_within_a_small_fraction() -> None:
    """Daly's series against a brute-force search of the same goodput function."""
    for ratio in (1e-4, 1e-3, 1e-2, 0.1, 0.5):
        delta = ratio * MTBF
        taus = [MTBF * 10 ** (k / 2000 - 3) for k in range(0, 8000)]
        best = max(taus, key=lambda t: failures.expected_goodput(t, delta, RESTART, MTBF))
        gap = failures.expected_goodput(best, delta, RESTART, MTBF) - failures.expected_goodput(
            failures.daly_interval(delta, MTBF), delta, RESTART, MTBF
        )
        assert -1e-6 < gap < 1e-4, ratio  # Daly may beat the grid by a hair: it can miss the peak


def test_daly_reduces_to_young_for_small_delta_over_m() -> None:
    for ratio in (1e-8, 1e-6, 1e-4):
        delta = ratio * MTBF
        young = failures.young_interval(delta, MTBF)
        assert young == pytest.approx(math.sqrt(2 * delta * MTBF))
        # relative difference ~ sqrt(delta / 2M) / 3: shrinks with delta / M
        assert failures.daly_interval(delta, MTBF) == pytest.approx(young, rel=math.sqrt(ratio))
    assert failures.daly_interval(3 * MTBF, MTBF) == MTBF  # delta >= 2M: checkpoint every M


def test_default_rate_is_llama3s_and_gives_its_interruption_interval() -> None:
    # 419 unexpected interruptions (466 less 47 planned) in 54 days on 16,384 GPUs: one every
    # 54 * 24 / 419 = 3.09 h on that job
    assert math.isclose(failures.DEFAULT_FAILURE_RATE, 1.9733e-5, rel_tol=1e-4)
    mtbf = failures.mtbf_seconds(failures.DEFAULT_FAILURE_RATE, 16_384)
    assert mtbf / 3600 == pytest.approx(54 * 24 / 419)


def test_bad_assumptions_name_the_flag() -> None:
    for bad, flag in (
        (failures.Assumptions(failure_rate=0.0), "--failure-rate"),
        (failures.Assumptions(restart_seconds=-1.0), "--restart-seconds"),
        (failures.Assumptions(save_seconds=float("nan")), "--save-seconds"),
        (failures.Assumptions(storage_bandwidth=float("inf")), "--storage-bandwidth"),
        (failures.Assumptions(memory_share=1.5), "--memory-share"),
        (failures.Assumptions(in_place_restart_seconds=-2.0), "--in-place-restart-seconds"),
    ):
        with pytest.raises(ValueError, match=flag):
            bad.check()


def _job_file(tmp_path, raw):
    import yaml  # noqa: PLC0415

    path = tmp_path / "job.yaml"
    document = {"apiVersion": "meshtrain.io/v1alpha1", "kind": "TrainingJob"}
    path.write_text(yaml.safe_dump(document | {"metadata": {"name": "t"}, "spec": raw}))
    return path


def test_plan_json_and_text_carry_the_failure_plan(tmp_path, capsys) -> None:
    job = _job_file(tmp_path, JobBuilder().layout(2, 2, 1, gpus_per_node=2).raw())
    assert (
        main.main(["plan", str(job), "--json", "--failure-rate", "0.001", "--save-seconds", "4"])
        == 0
    )
    doc = json.loads(capsys.readouterr().out)["failures"]
    assert doc["gpus"] == 4
    assert doc["mtbf_seconds"] == pytest.approx(3600 / (0.001 * 4))
    assert doc["failure_rate_source"] == "--failure-rate"
    storage = doc["storage"]
    assert storage["save_seconds"] == 4
    expected = failures.daly_interval(4, doc["mtbf_seconds"])
    assert storage["daly_interval_seconds"] == pytest.approx(expected)
    assert storage["interval_steps"] == max(1, round(expected / doc["step_seconds"]))
    assert doc["memory"]["save_seconds"] < storage["save_seconds"]
    assert main.main(["plan", str(job)]) == 0
    text = capsys.readouterr().out
    assert "Llama 3" in text and "storage checkpoints" in text and "memory checkpoints" in text
    assert main.main(["plan", str(job), "--failure-rate", "-1"]) == 2
    assert "--failure-rate" in capsys.readouterr().err


def _state(**overrides) -> failures.JobState:
    fields = {
        "gpus": 1024,
        "pods": 128,
        "step_seconds": 2.0,
        "state_bytes": 1e12,  # 1 TB of weights and optimizer state
        "rank_bytes": 2e9,
        "nic_bandwidth": 50e9,
        "storage_interval_steps": 100,
        "memory_interval_steps": None,
    }
    return failures.JobState(**(fields | overrides))


def test_an_asynchronous_save_blocks_for_the_host_copy_and_spaces_saves_by_the_write() -> None:
    assumed = failures.Assumptions(storage_bandwidth=1e9)  # the write takes 1,000 s
    planned = failures.plan_failures(_state(), assumed)
    assert planned.storage.save_seconds == pytest.approx(2e9 / failures.HOST_COPY_BANDWIDTH)
    assert planned.storage.steps >= 1000 / 2.0  # the next save waits for the write
    assert planned.storage.reload_seconds == pytest.approx(1000)  # a restore reads it all
    synchronous = failures.plan_failures(_state(async_save=False), assumed)
    assert synchronous.storage.save_seconds == pytest.approx(1000)
    expected = failures.daly_interval(1000, synchronous.mtbf_seconds)
    assert synchronous.storage.steps == round(expected / 2.0)
    # in memory: training waits for the shard's copy to host only (the peer copy runs behind);
    # a memory restore follows an in-place restart and copies the shard back from host
    host = 2e9 / failures.HOST_COPY_BANDWIDTH
    assert planned.memory.save_seconds == pytest.approx(host)
    assert planned.memory.restart_seconds == pytest.approx(failures.IN_PLACE_RESTART_SECONDS + host)
    assert planned.memory_share == failures.MEMORY_SHARE_WITH_PEER
    alone = failures.plan_failures(_state(pods=1), assumed)
    assert alone.memory.save_seconds == pytest.approx(host)
    assert alone.memory_share == failures.MEMORY_SHARE_ALONE


def simulate_two_level(
    memory: tuple[float, float, float],
    storage: tuple[float, float, float],
    *,
    share: float,
    mtbf: float,
    work: float,
    seed: int,
) -> float:
    """Useful over wall seconds with checkpoints at two levels, each ``(interval, save, restart)``
    in seconds: failures at any time (mean interval ``mtbf``); a share ``share`` of them goes back
    to the newest checkpoint of either level and pays the memory restart, the others to the newest
    storage checkpoint (a gang rebuild empties host memory) and pay the storage restart."""
    rng = random.Random(seed)
    (tau_m, delta_m, restart_m), (tau_s, delta_s, restart_s) = memory, storage
    wall = progress = kept_m = kept_s = 0.0
    failure = rng.expovariate(1.0 / mtbf)  # wall time of the next failure
    while progress < work:
        next_m = (math.floor(progress / tau_m + 1e-9) + 1) * tau_m
        next_s = (math.floor(progress / tau_s + 1e-9) + 1) * tau_s
        target = min(next_m, next_s, work)
        cost = (delta_m if target == next_m else 0.0) + (delta_s if target == next_s else 0.0)
        if wall + (target - progress) + cost <= failure:  # the work and its checkpoints
            wall += target - progress + cost
            progress = target
            kept_m = progress if target == next_m else kept_m
            kept_s = progress if target == next_s else kept_s
            continue
        wall = failure
        if rng.random() < share:
            progress, wall = max(kept_m, kept_s), wall + restart_m
        else:
            progress = kept_m = kept_s
            wall += restart_s
        failure = wall + rng.expovariate(1.0 / mtbf)
    return work / wall


TWO_MTBF = 36_000.0  # the job fails every 10 h; memory recovers 90% of failures
SHARE = 0.9
MEMORY = (2.0, 3.0)  # host copy 2 s, in-place restart and reload 3 s
STORAGE = (60.0, 90.0)  # save 60 s, gang rebuild and reload 90 s


def test_two_level_goodput_and_intervals_match_a_simulation() -> None:
    tau_m = failures.daly_interval(MEMORY[0], TWO_MTBF / SHARE)
    tau_s = failures.daly_interval(STORAGE[0], TWO_MTBF / (1 - SHARE))
    simulated = {}
    for scale_m, scale_s in ((1, 1), (0.4, 1), (2.5, 1), (1, 0.4), (1, 2.5)):
        memory, storage = (tau_m * scale_m, *MEMORY), (tau_s * scale_s, *STORAGE)
        got = simulate_two_level(
            memory, storage, share=SHARE, mtbf=TWO_MTBF, work=3000 * TWO_MTBF, seed=5
        )
        expected = failures.two_level_goodput(memory, storage, share=SHARE, mtbf=TWO_MTBF)
        assert expected == pytest.approx(got, abs=0.004), (scale_m, scale_s)
        simulated[scale_m, scale_s] = got
    # each level's Daly interval at its own MTBF is better than a few times off either way
    assert simulated[1, 1] >= max(simulated.values()) - 0.001, simulated


def test_the_plan_prices_memory_with_both_levels() -> None:
    state = _state(memory_interval_steps=10)
    planned = failures.plan_failures(state, failures.Assumptions(memory_share=0.5))
    mtbf, host = planned.mtbf_seconds, 2e9 / failures.HOST_COPY_BANDWIDTH
    assert planned.memory.daly_seconds == pytest.approx(failures.daly_interval(host, mtbf / 0.5))
    beside = failures.daly_interval(planned.storage.save_seconds, mtbf / 0.5)
    # the asynchronous write (1,000 s at 1 GB/s) still spaces the storage saves
    assert planned.storage_steps_beside_memory == max(round(beside / 2.0), 500)
    expected = failures.two_level_goodput(
        (planned.memory.steps * 2.0, host, planned.memory.restart_seconds),
        (
            planned.storage_steps_beside_memory * 2.0,
            planned.storage.save_seconds,
            planned.storage.restart_seconds,
        ),
        share=0.5,
        mtbf=mtbf,
    )
    assert planned.memory.goodput == pytest.approx(expected)
    assert planned.memory.goodput > planned.storage.goodput  # memory recovers half, faster
    assert planned.memory.configured_goodput is not None
    never = failures.plan_failures(state, failures.Assumptions(memory_share=0.0))
    assert never.memory.goodput == pytest.approx(
        1
        - planned.storage.save_seconds / (never.storage_steps_beside_memory * 2.0)
        - (never.storage_steps_beside_memory * 2.0 / 2 + never.storage.restart_seconds)
        / never.mtbf_seconds
    )
