"""``meshtrain plan`` warns: exit 3 when the job does not fit, UNCALIBRATED in the headline, the
built-in CPU profile priced on this host's cores, one MFU definition (docs/planner.md)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.cli import exitcodes
from meshtrain.planner import estimate, host_model, mfu, profiles
from tests.builders import JobBuilder

EXAMPLE = Path(__file__).resolve().parents[2] / "manifests" / "examples" / "tiny-cpu.yaml"


def _plan(*args: str) -> subprocess.CompletedProcess[str]:
    """The real command line, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "plan", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def test_a_job_that_does_not_fit_exits_3_and_one_that_fits_0(tmp_path: Path) -> None:
    fits = JobBuilder().layout(2, 1, 1, gpus_per_node=2).write(tmp_path, "fits.yaml")
    done = _plan(str(fits), "--gpu", "h100-sxm")
    assert done.returncode == exitcodes.OK == 0, done.stderr
    too_big = (
        JobBuilder()
        .model(preset="1.3b")
        .layout(1, 1, 1, gpus_per_node=1)
        .write(tmp_path, "too-big.yaml")
    )
    done = _plan(str(too_big), "--gpu", "l40s", "--set", "training.microBatch=64")
    assert done.returncode == exitcodes.DOES_NOT_FIT == 3, done.stdout + done.stderr
    assert "DOES NOT FIT" in done.stdout  # the report still prints, on stdout
    assert "does not fit (exit 3)" in done.stderr
    assert (
        _plan(str(too_big), "--json", "--gpu", "l40s", "--set", "training.microBatch=64").returncode
        == 3
    )
    bad = _plan(str(fits), "--gpu", "no-such-device")
    assert bad.returncode == exitcodes.INVALID == 2


def test_an_unplaceable_gang_exits_4_and_a_fruitless_search_5(tmp_path: Path) -> None:
    job = JobBuilder().layout(2, 1, 1, gpus_per_node=2).write(tmp_path)
    one_gpu = tmp_path / "cluster.yaml"
    one_gpu.write_text("- {name: only, gpus: 1}\n")  # the gang needs 2 GPUs on a node
    done = _plan(str(job), "--gpu", "h100-sxm", "--cluster", str(one_gpu))
    assert done.returncode == exitcodes.UNSCHEDULABLE == 4, done.stdout + done.stderr
    assert "unschedulable" in done.stdout and "(exit 4)" in done.stderr
    big = JobBuilder().model(preset="llama3-70b").layout(1, 1, 1, gpus_per_node=1).write(tmp_path)
    done = _plan(str(big), "--gpu", "l40s", "--search", "--world", "1")  # 70B on one 48 GB card
    assert done.returncode == exitcodes.NO_LAYOUT == 5, done.stdout + done.stderr
    assert "(exit 5)" in done.stderr
    assert exitcodes.UNEXPECTED == 1 and 1 not in (exitcodes.NO_LAYOUT, exitcodes.UNSCHEDULABLE)


def test_every_code_is_documented_once() -> None:
    """The table in docs/planner.md, "Exit codes", has exactly one row per code, both ways."""
    documented = (Path(__file__).resolve().parents[2] / "docs" / "planner.md").read_text()
    assert "meshtrain/cli/exitcodes.py" in documented
    section = documented.split("### Exit codes", 1)[1].split("\n#", 1)[0]
    rows = [int(m) for m in re.findall(r"^\| (\d+) \|", section, flags=re.M)]
    assert sorted(rows) == sorted(exitcodes.CODES), (rows, sorted(exitcodes.CODES))
    assert len(rows) == len(set(rows))


def test_uncalibrated_headline_says_so_and_how_to_calibrate(tmp_path: Path) -> None:
    done = _plan(str(EXAMPLE))
    headline = done.stdout.splitlines()[:2]
    assert headline[1].startswith("UNCALIBRATED: profile cpu"), headline
    assert "meshtrain plan JOB.yaml --calibrate" in headline[1]
    measured = dataclasses.replace(
        profiles.get("cpu"),
        name="cpu-here",
        calibration={"host": "here", "device": "2 cores", "measured_at": "2026-11-29T10:00:00Z"},
    )
    profiles.write(measured, tmp_path)
    done = _plan(str(EXAMPLE), "--gpu", "cpu-here", "--profiles-dir", str(tmp_path))
    second = done.stdout.splitlines()[1]
    assert second.startswith("calibrated: profile cpu-here measured on here (2 cores)"), second
    assert "UNCALIBRATED" not in done.stdout


def test_the_builtin_cpu_profile_gets_the_hosts_cores() -> None:
    cpu = profiles.get("cpu")
    here = host_model.on_host(cpu, 2)
    assert here.cores == 2 and here.cpu_time_model and not here.calibrated
    assert host_model.on_host(profiles.get("h100-sxm"), 2) == profiles.get("h100-sxm")
    calibrated = dataclasses.replace(cpu, calibration={"host": "x"})
    assert host_model.on_host(calibrated, 2) is calibrated
    job = JobBuilder.from_manifest(yaml.safe_load(EXAMPLE.read_text())).raw()
    spec = loading.parse_spec(job)
    alone = estimate.make_plan(spec, cpu).time.step_seconds
    shared = estimate.make_plan(spec, here).time.step_seconds
    # eight ranks on two cores time-share them: the step is several times a rank-per-device one
    assert shared > 5 * alone


def test_the_plan_prices_this_hosts_cores_by_default() -> None:
    done = _plan(str(EXAMPLE), "--json")
    document = json.loads(done.stdout)
    assert document["time"]["available_cores"] == float(host_model.host_cores())


@pytest.mark.parametrize(
    "world,per_host,cores,expected",
    [
        (8, 0, 0, 8.0),  # GPUs: one per rank
        (8, 0, 2, 2.0),  # eight ranks on two cores use both
        (1, 0, 16, 16.0),  # one rank with 16 threads
        (3, 0, 16, 15.0),  # three ranks of 5 threads
        (8, 4, 2, 4.0),  # two hosts of 4 ranks on 2 cores each
    ],
)
def test_mfu_counts_the_devices_the_job_uses(
    world: int, per_host: int, cores: int, expected: float
) -> None:
    assert mfu.devices(world, ranks_per_host=per_host, host_cores=cores) == expected


def test_mfu_peak_is_configured_or_a_cpu_core_or_the_device() -> None:
    assert mfu.device_peak(9e14, on_cpu=False) == 9e14
    assert mfu.device_peak(9e14, on_cpu=True) == profiles.get("cpu").peak_flops
    assert mfu.device_peak(9e14, on_cpu=True, configured=5e10) == 5e10
    assert mfu.ratio(6e9, 2.0, 1e9, 3.0) == pytest.approx(1.0)
    assert mfu.ratio(6e9, 0.0, 1e9, 3.0) == 0.0


def test_host_cores_is_the_affinity_bounded_by_the_cgroup_quota(tmp_path: Path) -> None:
    """``os.cpu_count()`` counts the machine; a pod with a CPU limit or a ``taskset`` gets fewer."""
    mine = len(os.sched_getaffinity(0))  # what the kernel lets this process run on
    none = tmp_path / "absent"
    assert host_model.host_cores(none / "cpu.max", none) == mine
    v2 = tmp_path / "cpu.max"
    v2.write_text("max 100000\n")  # no limit
    assert host_model.host_cores(v2, none) == mine
    v2.write_text("50000 100000\n")  # half a core: still one
    assert host_model.host_cores(v2, none) == 1
    v2.write_text(f"{(mine + 3) * 100000} 100000\n")  # a limit above the cpuset leaves the cpuset
    assert host_model.host_cores(v2, none) == mine
    v1 = tmp_path / "v1"
    v1.mkdir()
    (v1 / "cpu.cfs_quota_us").write_text("150000\n")  # 1.5 cores: two threads can use it
    (v1 / "cpu.cfs_period_us").write_text("100000\n")
    assert host_model.host_cores(none / "cpu.max", v1) == min(mine, 2)
    (v1 / "cpu.cfs_quota_us").write_text("-1\n")
    assert host_model.host_cores(none / "cpu.max", v1) == mine
    v2.write_text("x" * 10_000)  # hostile: read bounded, ignored
    assert host_model.host_cores(v2, none) == mine
