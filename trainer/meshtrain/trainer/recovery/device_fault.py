"""A GPU that keeps failing: which errors are the device's, and when a pod takes its GPU for bad.

A rank whose GPU fails under it raises a CUDA error through torch (``torch.AcceleratorError``, or
a ``RuntimeError`` in older releases and from NCCL).  Only the texts of :data:`HARDWARE_MARKS`
count as the device's: an uncorrectable ECC or NVLink error, the GPU gone from the bus.  An
illegal address, a device-side assert, running out of memory or a cuBLAS refusal are the
program's as often as not (a GPU the pod cannot see is its configuration's), and a replayed step
repeats a deterministic bug on any node, so they never send a pod away.  Such an error leaves the
CUDA context unusable (it is sticky), so the rank's process ends with
:data:`exitcodes.DEVICE_ERROR` and its supervisor recovers it in place like any failure.  The same
local rank, so the same GPU, failing so again within :data:`SUSPECT_WINDOW_S` is a bad device or
node (a healthy GPU does so about once in months): its supervisor leaves with
:data:`exitcodes.DEVICE_SUSPECT`, and the operator replaces the pod on another node, excluding
this one.  A device error of the job on this node before the pod started (a previous gang's or
pod's, which the operator keeps in ``status.deviceErrors`` and passes in
:data:`exitcodes.DEVICE_ERROR_AT_ENV`) counts as the first strike of every GPU of the pod: the
GPUs a new pod gets need not be the ones that failed, and two uncorrectable errors on one node
within the window are the node's as much as a GPU's.  A GPU gone from the bus (:data:`LOST_MARKS`)
ends its rank with :data:`exitcodes.DEVICE_LOST` and is taken for bad at once: no step replayed
on it can succeed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from meshtrain.api import exitcodes

SUSPECT_WINDOW_S = exitcodes.DEVICE_SUSPECT_WINDOW_S
"""Two device errors of one GPU (or of the job on one node) within this long take it for bad."""
LOST_MARKS = ("gpu is lost", "fallen off the bus")
"""Lower-case texts of a GPU gone: NVML's ``NVML_ERROR_GPU_IS_LOST`` and the driver's Xid 79."""
HARDWARE_MARKS = ("uncorrectable ecc error", "uncorrectable nvlink error", *LOST_MARKS)
"""Lower-case texts of the CUDA runtime's, NVML's and the driver's errors that only a failing
device (or its node) causes: ``cudaErrorECCUncorrectable``, ``cudaErrorNvlinkUncorrectable``, and
a GPU gone.  Not "hardware stack error" (a kernel's own stack overflow reads so), "unknown error"
or "no CUDA-capable device" (a pod without its GPUs, a wrong runtime class, reads so on every
node): each would send a healthy pod from node to node."""


def is_device_error(err: BaseException) -> bool:
    """Whether ``err`` says the GPU failed, not the program (see the module)."""
    if not isinstance(err, RuntimeError):
        return False
    text = str(err).lower()
    return any(mark in text for mark in HARDWARE_MARKS)


def is_device_lost(err: BaseException) -> bool:
    """Whether ``err`` says the GPU is gone (a device error no replay on it survives)."""
    text = str(err).lower()
    return is_device_error(err) and any(mark in text for mark in LOST_MARKS)


class DeviceFailures:
    """The newest device error of each local rank (each GPU) of one pod, and the job's newest on
    the pod's node before it started (``on_node``), on its supervisor's monotonic clock."""

    def __init__(self, window_s: float = SUSPECT_WINDOW_S, on_node: float | None = None) -> None:
        self.window_s = window_s
        self.last: dict[int, float] = {}
        self.on_node = on_node
        self.struck_by_node = False
        """The last :meth:`failed` that took a GPU for bad counted the node's earlier error."""

    def failed(self, local_rank: int, now: float) -> bool:
        """Note a device error of ``local_rank``; whether its GPU is now taken for bad."""
        before = self.last.get(local_rank)
        self.last[local_rank] = now
        own = before is not None and now - before <= self.window_s
        self.struck_by_node = (
            not own and self.on_node is not None and now - self.on_node <= self.window_s
        )
        return own or self.struck_by_node


def node_error_since(
    environ: Mapping[str, str], monotonic_now: float, wall_now: float
) -> float | None:
    """The job's newest device error on this node before the pod started
    (:data:`exitcodes.DEVICE_ERROR_AT_ENV`, unix seconds) on the monotonic clock of
    ``monotonic_now``; None when unset or unreadable.  A time ahead of this node's clock (skew
    between nodes) counts as now."""
    raw = environ.get(exitcodes.DEVICE_ERROR_AT_ENV, "").strip()
    try:
        at = float(raw)
    except ValueError:
        return None
    if not math.isfinite(at) or at <= 0:
        return None
    return monotonic_now - max(wall_now - at, 0.0)


def which_gpu(local_rank: int, environ: Mapping[str, str]) -> str:
    """The GPU of ``local_rank`` as far as the container's environment tells it, for the node's
    administrator.  CUDA numbers the devices of ``CUDA_VISIBLE_DEVICES`` in its order, so where
    set its entry is the GPU: exact when the entry is a UUID, an index only counts within the
    container.  The device plugin's ``NVIDIA_VISIBLE_DEVICES`` lists the pod's GPUs by UUID in an
    order CUDA need not follow, so it narrows the GPU to the pod's set.  Nothing names it where
    neither holds UUIDs (CDI and DRA allocations set neither): the local rank alone."""
    own = f"local rank {local_rank}"
    cuda = environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if cuda:  # CUDA's own numbering: never the plugin's list once this is set
        visible = [d.strip() for d in cuda.split(",")]
        if local_rank >= len(visible):
            return own
        entry = visible[local_rank]
        return f"{own}, GPU {entry}" if _is_uuid(entry) else f"{own}, CUDA_VISIBLE_DEVICES {entry}"
    pods = [d.strip() for d in environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    if pods and all(_is_uuid(d) for d in pods):
        return f"{own}, one of the pod's GPUs {','.join(pods)}"
    return own


def _is_uuid(device: str) -> bool:
    return device.startswith(("GPU-", "MIG-"))
