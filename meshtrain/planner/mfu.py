"""Model FLOPs utilisation (MFU): one definition for the plan, the trainer's steps and metric, the run
report and the benchmarks.

    MFU = model FLOPs of a step / (step seconds x peak FLOP/s per device x devices used)

Model FLOPs are ``6 N + 12 L s h`` per token (``N`` the non-embedding parameters; the trainer's
``gpt.flops_per_token``, the planner's ``stage_work.model_flops_per_token``), times the step's
tokens.  The devices are the ones the job actually uses: one GPU per rank at its datasheet dense
bf16 peak, with ``training.float8`` too (meshtrain's own convention: one denominator for both, so
an fp8 MFU above bf16's means a faster step, not a share of the float8 peak); CPU ranks sharing a
host use its cores (at most ``ranks x threads``, :func:`devices`), each at the built-in ``cpu``
profile's stated per-core peak (:func:`cpu_core_peak`).  ``metrics.peakFlops`` replaces the per-device peak on both sides.
Every peak is a built-in profile's ``peak_flops`` (``meshtrain/planner/profiles/*.yaml``): the
trainer finds a GPU's profile by its CUDA name (:data:`GPU_PROFILES`, :func:`gpu_peak`).
docs/telemetry.md ("Definitions") and docs/planner.md ("Time") state the same.
"""

from __future__ import annotations

import functools
import math
import re

from meshtrain.planner import profiles

GPU_PROFILES: tuple[tuple[str, str], ...] = (
    ("H200", "h200"),
    ("H100 80GB HBM3", "h100-sxm"),
    ("H100 SXM", "h100-sxm"),
    ("A100-SXM4-40GB", "a100-40g"),
    ("A100-PCIE-40GB", "a100-40g"),
    ("A100", "a100-80g"),
    ("L40S", "l40s"),
)
"""(words of a GPU's CUDA name, the built-in profile whose ``peak_flops`` is its MFU peak); the
first whose words stand alone in the name wins (``GH200`` is not an ``H200``, an ``H100 PCIe``
not an SXM).  A GPU none names has no peak here: MFU asks for ``metrics.peakFlops``."""


@functools.lru_cache(maxsize=16)
def builtin_peak(profile: str) -> float:
    """``peak_flops`` of the built-in profile ``profile`` (never a user override)."""
    return profiles.load_file(profiles.BUILTIN_DIR / f"{profile}.yaml").peak_flops


def cpu_core_peak() -> float:
    """fp32 FLOP/s of one CPU core: the built-in ``cpu`` profile's ``peak_flops``."""
    return builtin_peak("cpu")


def gpu_profile(device_name: str) -> str | None:
    """The built-in profile of a GPU from its CUDA name (:data:`GPU_PROFILES`), or None."""
    for words, profile in GPU_PROFILES:
        if re.search(rf"(?<![\w-]){re.escape(words)}(?!\w)", device_name):
            return profile
    return None


def gpu_peak(device_name: str) -> float | None:
    """Dense peak FLOP/s of a GPU from its CUDA name (its built-in profile's), or None if unknown."""
    profile = gpu_profile(device_name)
    return builtin_peak(profile) if profile else None


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
