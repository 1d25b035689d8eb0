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
    # 466 interruptions in 54 days on 16,384 GPUs: one every 54 * 24 / 466 = 2.78 h on that job
    assert math.isclose(failures.DEFAULT_FAILURE_RATE, 2.1946e-5, rel_tol=1e-4)
    mtbf = failures.mtbf_seconds(failures.DEFAULT_FAILURE_RATE, 16_384)
    assert mtbf / 3600 == pytest.approx(54 * 24 / 466)


def test_bad_assumptions_name_the_flag() -> None:
    for bad, flag in (
        (failures.Assumptions(failure_rate=0.0), "--failure-rate"),
        (failures.Assumptions(restart_seconds=-1.0), "--restart-seconds"),
        (failures.Assumptions(save_seconds=float("nan")), "--save-seconds"),
        (failures.Assumptions(storage_bandwidth=float("inf")), "--storage-bandwidth"),
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
    # in memory: the shard to host and to a peer pod; one pod has no peer
    assert planned.memory.save_seconds == pytest.approx(
        2e9 / failures.HOST_COPY_BANDWIDTH + 2e9 / 50e9
    )
    alone = failures.plan_failures(_state(pods=1), assumed)
    assert alone.memory.save_seconds == pytest.approx(2e9 / failures.HOST_COPY_BANDWIDTH)
