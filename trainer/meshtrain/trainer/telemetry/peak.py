"""The denominators: peak FLOP/s of a device (for MFU) and peak memory of this process.

The peak FLOP/s is ``metrics.peakFlops``, else a known GPU's dense bf16 peak, else a short fp32
matmul on this CPU thread at start-up (~0.1 s), so CPU MFU reads as "share of what this core does
on a large matmul".
"""

from __future__ import annotations

import resource
import sys
import time

import torch

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


def resolve_peak_flops(configured: float | None, device: torch.device | str | None = None) -> float:
    """Peak FLOP/s per device for MFU: configured, known GPU, or measured CPU."""
    if configured:
        return float(configured)
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        known = gpu_peak_flops(torch.cuda.get_device_name(dev))
        if known:
            return known
    return measure_cpu_flops()


def peak_memory_bytes(device: torch.device | str | None = None) -> int:
    """CUDA max_memory_allocated on a GPU rank, else this process' peak resident set."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated(dev))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)  # Linux reports KiB
