"""The denominators: peak FLOP/s of the devices a rank uses (for MFU) and peak memory of this process.

MFU has one definition (:mod:`meshtrain.planner.mfu`, shared with ``meshtrain plan``): the peak
FLOP/s per device is ``metrics.peakFlops``, else a known GPU's dense bf16 peak, else (CPU ranks)
the built-in ``cpu`` profile's per-core peak; the devices are the GPUs, or the cores the ranks of
this host get.  A GPU the table does not know is measured with a short fp32 matmul (~0.1 s).
"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

from meshtrain.planner import mfu

# Dense (no sparsity) bf16 tensor-core peaks, FLOP/s, from the vendors' data sheets.
GPU_BF16_PEAK: tuple[tuple[str, float], ...] = (
    ("H200", 989.4e12),
    ("H100 PCIe", 756.5e12),
    ("H100", 989.4e12),
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("L40S", 362.05e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def gpu_peak_flops(name: str) -> float | None:
    """bf16 dense peak of a GPU from its marketing name, or None if unknown."""
    for key, flops in GPU_BF16_PEAK:
        if key in name:
            return flops
    return None


def measure_cpu_flops(size: int = 512, repeats: int = 5) -> float:
    """Best fp32 matmul FLOP/s of ``repeats`` ``size``-cubed products on this thread."""
    a = torch.randn(size, size)
    b = torch.randn(size, size)
    torch.mm(a, b)  # warm up the kernel choice
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * size**3 / best


def _on_gpu(device: torch.device | str | None) -> bool:
    return device is not None and torch.device(device).type == "cuda" and torch.cuda.is_available()


def resolve_peak_flops(configured: float | None, device: torch.device | str | None = None) -> float:
    """Peak FLOP/s per device for MFU: configured, a known GPU's, a CPU core's (the ``cpu`` profile's),
    or an unknown GPU's measured."""
    if configured:
        return float(configured)
    if not _on_gpu(device):
        return mfu.cpu_core_peak()
    known = gpu_peak_flops(torch.cuda.get_device_name(torch.device(device or "cuda")))
    return known if known else measure_cpu_flops()


def mfu_devices(world: int, device: torch.device | str | None = None) -> float:
    """Devices MFU counts for a job of ``world`` ranks: its GPUs, or on CPU the cores of this host
    its ``LOCAL_WORLD_SIZE`` ranks share (:func:`meshtrain.planner.mfu.devices`)."""
    if _on_gpu(device):
        return float(world)
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)
    return mfu.devices(world, ranks_per_host=local, host_cores=os.cpu_count() or 1)


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """CUDA max_memory_allocated on a GPU rank, else this process' peak resident set."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(dev))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
