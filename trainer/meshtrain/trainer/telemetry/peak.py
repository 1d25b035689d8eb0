"""The denominators: peak FLOP/s of the devices a rank uses (for MFU) and peak memory of this process.

MFU has one definition (:mod:`meshtrain.planner.mfu`, shared with ``meshtrain plan``): the peak
FLOP/s per device is ``metrics.peakFlops``, else a known GPU's dense bf16 peak, else (CPU ranks)
the built-in ``cpu`` profile's per-core peak; the devices are the GPUs, or the cores the ranks of
this host get.  Every peak is a built-in planner profile's (:func:`meshtrain.planner.mfu.gpu_peak`),
so ``plan`` and the run agree; a GPU no profile names gets no MFU (NaN) and one warning asking
for ``metrics.peakFlops``, rather than a figure against some other peak.
"""

from __future__ import annotations

import functools
import logging
import os
import resource
import sys

import torch

from meshtrain.planner import host_model, mfu

log = logging.getLogger(__name__)


def gpu_peak_flops(name: str) -> float | None:
    """Dense peak FLOP/s of a GPU from its CUDA name: its built-in profile's, or None if unknown."""
    return mfu.gpu_peak(name)


@functools.lru_cache(maxsize=8)
def _refuse_mfu(name: str) -> None:
    """Say once per GPU model that MFU is not reported and what to set."""
    log.warning(
        "MFU is not reported: no built-in profile names the GPU %r (known: %s); set "
        "spec.metrics.peakFlops to its dense peak FLOP/s in the training precision",
        name,
        ", ".join(words for words, _ in mfu.GPU_PROFILES),
    )


def _on_gpu(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def resolve_peak_flops(configured: float | None, device: torch.device | str | None = None) -> float:
    """Peak FLOP/s per device for MFU: configured, a known GPU's, a CPU core's (the ``cpu`` profile's);
    0.0 for a GPU no built-in profile names (MFU not reported, one warning naming the setting)."""
    if configured:
        return float(configured)
    if not _on_gpu(device):
        return mfu.cpu_core_peak()
    name = torch.cuda.get_device_name(torch.device(device or "cuda"))
    known = gpu_peak_flops(name)
    if known is None:
        _refuse_mfu(name)
        return 0.0
    return known


def mfu_devices(world: int, device: torch.device | str | None = None) -> float:
    """Devices MFU counts for a job of ``world`` ranks: its GPUs, or on CPU the cores of this host
    its ``LOCAL_WORLD_SIZE`` ranks share (:func:`meshtrain.planner.mfu.devices`)."""
    if _on_gpu(device):
        return float(world)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return mfu.devices(world, ranks_per_host=local, host_cores=host_model.host_cores())


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """CUDA max_memory_allocated on a GPU rank, else this process' peak resident set."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(dev))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
