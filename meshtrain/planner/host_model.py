"""The built-in CPU profile on the host that plans: its cores shared by the job's ranks.

``meshtrain run`` starts every rank on this machine, so eight ranks on two cores time-share them.
A CPU profile that calibration never measured has no core count and no CPU-time figures, and
would price each rank as a whole device (the README's local example: 17.8 ms predicted, about
400 ms measured).  :func:`on_host` gives it the host's core count and the CPU-time figures below,
so the plan prices the step as CPU work over the cores (:mod:`.timing.cpu_host`); calibration
(``meshtrain plan --calibrate``) replaces them with this machine's own.  The core count is
:func:`host_cores` (affinity and cgroup quota, not ``os.cpu_count()``), which the trainer's MFU
counts too.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

from meshtrain.planner import profiles


def _fit(
    op: str, cpu_call: float, cpu_bandwidth: float, alpha: float, bandwidth: float
) -> profiles.CollectiveFit:
    """A measured two-member fit of ``op``: CPU seconds per call and per byte, wall alpha and bandwidth."""
    return profiles.CollectiveFit(
        op=op,
        members=2,
        alpha=alpha,
        bandwidth=bandwidth,
        processes=8,
        cpu_call_seconds=cpu_call,
        cpu_bandwidth=cpu_bandwidth,
    )


HOST_FIGURES: dict[str, Any] = {
    "core_flops": 4.7e10,
    "core_op_overhead": 5.0e-6,
    "rank_step_cpu_seconds": 8.0e-3,
    "step_loop_between_share": 0.26,
    "collectives": (
        _fit("all_gather", 2.3e-4, 2.6e9, 3.0e-3, 2.4e8),
        _fit("all_reduce", 2.9e-4, 2.7e9, 2.0e-3, 5.0e8),
        _fit("reduce_scatter", 3.5e-4, 1.8e9, 4.0e-3, 9.4e7),
        _fit("send", 2.0e-4, 8.3e9, 2.3e-3, 1.6e9),
    ),
    "tp_collectives": (
        _fit("all_gather", 3.2e-4, 2.6e9, 2.0e-3, 2.4e8),
        _fit("all_reduce", 3.8e-4, 2.7e9, 1.3e-3, 5.0e8),
        _fit("reduce_scatter", 5.0e-4, 1.8e9, 2.6e-3, 9.4e7),
    ),
}
"""CPU-time figures of an uncalibrated CPU host: rounded from ``meshtrain plan --calibrate`` of
the dp2·pp2·tp2 tiny GPT on the 2-core development VM with 8 ranks (AMD EPYC, gloo;
``benchmarks/results/planner_time_e675c5c-vm.json``, the last layout).  They are CPU seconds per
unit of work, which the load does not change; the cores the ranks get are this host's."""


def applies(profile: profiles.Profile) -> bool:
    """Whether ``profile`` is an uncalibrated CPU profile without a core count (the built-in ``cpu``)."""
    return (
        not profile.calibrated
        and profile.precision == "fp32"
        and profile.cores == 0
        and profile.core_flops == 0
    )


def on_host(profile: profiles.Profile, cores: int) -> profiles.Profile:
    """``profile`` with ``cores`` shared by the job's ranks and :data:`HOST_FIGURES`, where it :func:`applies`.

    Any other profile (a GPU, a calibrated host, one that names its cores) is returned as it is.
    """
    if not applies(profile) or cores < 1:
        return profile
    return dataclasses.replace(
        profile,
        cores=cores,
        description=f"{profile.description}; {cores} cores of this host shared by the ranks",
        **HOST_FIGURES,
    )


CGROUP_V2_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")
"""cgroup v2's CPU limit of this container: ``QUOTA PERIOD`` in microseconds, or ``max PERIOD``."""
CGROUP_V1_CPU_DIR = Path("/sys/fs/cgroup/cpu")
"""cgroup v1's CPU controller: ``cpu.cfs_quota_us`` (-1: none) over ``cpu.cfs_period_us``."""
MAX_CGROUP_FILE_BYTES = 256
"""A cgroup file holds a line; more is not one."""


def host_cores(cpu_max: Path = CGROUP_V2_CPU_MAX, cpu_dir: Path = CGROUP_V1_CPU_DIR) -> int:
    """Cores this process may run on: its CPU affinity (``taskset``, a cpuset), bounded by the
    cgroup's CPU quota (v2 ``cpu.max``, else v1's CFS quota; a Kubernetes CPU limit) rounded up,
    at least 1.  ``os.cpu_count()`` counts the machine's cores, whatever the process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # no affinity on this platform
        cores = os.cpu_count() or 1
    quota = _cgroup_quota(cpu_max, cpu_dir)
    if quota is not None:
        cores = min(cores, math.ceil(quota))
    return max(1, cores)


def _cgroup_quota(cpu_max: Path, cpu_dir: Path) -> float | None:
    """Cores' worth of CPU time the cgroup allows (quota / period), or None when unlimited or unknown."""
    v2 = _read_words(cpu_max)
    if v2 is not None:
        return _ratio(v2[0], v2[1]) if len(v2) == 2 else None
    quota = _read_words(cpu_dir / "cpu.cfs_quota_us")
    period = _read_words(cpu_dir / "cpu.cfs_period_us")
    if quota and period:
        return _ratio(quota[0], period[0])
    return None


def _ratio(quota: str, period: str) -> float | None:
    try:
        value, per = float(quota), float(period)
    except ValueError:  # "max": no limit
        return None
    return value / per if value > 0 and per > 0 else None


def _read_words(path: Path) -> list[str] | None:
    """A small file's words, or None when it cannot be read."""
    try:
        with path.open("rb") as file:
            return file.read(MAX_CGROUP_FILE_BYTES).decode("ascii", "replace").split()
    except OSError:
        return None
