"""Model FLOPs utilisation (MFU): one definition for the plan, the trainer's steps and metric, the run
report and the benchmarks.

    MFU = model FLOPs of a step / (step seconds x peak FLOP/s per device x devices used)

Model FLOPs are ``6 N + 12 L s h`` per token (``N`` the non-embedding parameters; the trainer's
``gpt.flops_per_token``, the planner's ``stage_work.model_flops_per_token``), times the step's
tokens.  The devices are the ones the job actually uses: one GPU per rank at its datasheet dense
peak in the training precision; CPU ranks sharing a host use its cores (at most ``ranks x
threads``, :func:`devices`), each at the built-in ``cpu`` profile's stated per-core peak
(:func:`cpu_core_peak`).  ``metrics.peakFlops`` replaces the per-device peak on both sides.
docs/telemetry.md ("Definitions") and docs/planner.md ("Time") state the same.
"""

from __future__ import annotations

import functools
import math

from meshtrain.planner import profiles


@functools.lru_cache(maxsize=1)
def cpu_core_peak() -> float:
    """fp32 FLOP/s of one CPU core: the built-in ``cpu`` profile's ``peak_flops`` (never a user override)."""
    return profiles.load_file(profiles.BUILTIN_DIR / "cpu.yaml").peak_flops


def devices(world: int, *, ranks_per_host: int = 0, host_cores: int = 0) -> float:
    """Devices the job uses: ``world`` GPUs, or with ``host_cores`` the CPU cores its hosts give it.

    Each host of ``ranks_per_host`` ranks (every rank when 0) runs ``host_cores // ranks`` threads
    per rank (at least one, as ``meshtrain run`` and the pods set ``OMP_NUM_THREADS``), so it uses
    ``min(host_cores, ranks x threads)`` cores.
    """
    if host_cores <= 0:
        return float(world)
    per_host = ranks_per_host if 0 < ranks_per_host <= world else world
    threads = max(1, host_cores // per_host)
    hosts = math.ceil(world / per_host)
    return float(hosts * min(host_cores, per_host * threads))


def device_peak(profile_peak: float, *, on_cpu: bool, configured: float | None = None) -> float:
    """Peak FLOP/s of one device: ``metrics.peakFlops`` when set, else a CPU core's, else the device's."""
    if configured:
        return float(configured)
    return cpu_core_peak() if on_cpu else profile_peak


def ratio(model_flops: float, seconds: float, peak_flops: float, device_count: float) -> float:
    """MFU of a step of ``model_flops`` that took ``seconds`` on ``device_count`` devices of ``peak_flops``."""
    denominator = seconds * peak_flops * device_count
    return model_flops / denominator if denominator > 0 else 0.0
