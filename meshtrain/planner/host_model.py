"""The built-in CPU profile on the host that plans: its cores shared by the job's ranks.

``meshtrain run`` starts every rank on this machine, so eight ranks on two cores time-share them.
A CPU profile that calibration never measured has no core count and no CPU-time figures, and
would price each rank as a whole device (the README's local example: 17.8 ms predicted, about
400 ms measured).  :func:`on_host` gives it the host's core count and the CPU-time figures below,
so the plan prices the step as CPU work over the cores (:mod:`.timing.cpu_host`); calibration
(``meshtrain plan --calibrate``) replaces them with this machine's own.
"""

from __future__ import annotations

import dataclasses
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
