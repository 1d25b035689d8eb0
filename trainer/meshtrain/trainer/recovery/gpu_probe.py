"""Asking the driver whether this pod's GPUs are still there, after a rank failed without saying why.

A GPU that falls off the bus mid-kernel reaches torch and NCCL as "unknown error", "unspecified
launch failure" or a dead process, none of which :mod:`.device_fault` may count (a program's own
bug reads the same).  NVML, the driver's management library, knows: a GPU gone answers
``NVML_ERROR_GPU_IS_LOST``, at the latest when its handle is asked for.  So after a failure the
supervisor, which holds no CUDA context of its own, asks NVML (through NVIDIA's ``nvidia-ml-py``)
about the GPUs its container sees (:func:`probe`).

Only ``NVML_ERROR_GPU_IS_LOST`` counts as lost: any other error (a call the GPU does not support,
no permission, as a MIG parent answers an unprivileged container) says nothing of the device.
Where the device plugin named the pod's GPUs (``NVIDIA_VISIBLE_DEVICES`` as UUIDs), a GPU lost
counts only when one of those is missing from the GPUs that answer: a privileged pod sees every
GPU of its node, and another pod's lost GPU is not this pod's.  No NVML library, the common case
off a GPU node (the NVIDIA container runtime mounts it only into containers given GPUs), is no
verdict.  A driver that does not answer within :data:`TIMEOUT_S` is :data:`HUNG`, which the
supervisor counts as a device error; the probe runs in a daemon thread, and while an earlier
probe's thread is still blocked in the driver no new one starts (the answer is :data:`HUNG` at
once), so a hung driver costs the supervisor :data:`TIMEOUT_S` once, and one blocked thread.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import pynvml

TIMEOUT_S = 10.0
"""How long the supervisor waits for NVML's answer."""
HUNG = "hung"
""":func:`probe`'s answer when NVML did not answer in time (or an earlier probe is still blocked)."""


@dataclasses.dataclass
class _Asking:
    """One probe's thread and what it found so far (a GPU found lost counts even if a later call
    hangs: a driver call on a GPU gone can take seconds)."""

    thread: threading.Thread | None = None
    lost: list[str] = dataclasses.field(default_factory=list)
    answered: list[str] = dataclasses.field(default_factory=list)
    """UUIDs of the GPUs that answered."""
    done: bool = False
    failed: bool = False
    """NVML could not be asked at all (no library, not initialised): no verdict."""


_last = _Asking()


def probe(timeout_s: float = TIMEOUT_S) -> list[str] | str | None:
    """The pod's GPUs NVML reports lost (named by the pod's UUID where the device plugin gave
    them, else by NVML's index, which is PCI order, not CUDA's); [] when every GPU answered;
    :data:`HUNG`; None when NVML could not be asked (see the module)."""
    global _last
    if _last.thread is not None and _last.thread.is_alive():
        return _named(_last) if _last.lost else HUNG  # still blocked in the driver: ask no more
    asking = _last = _Asking()
    asking.thread = threading.Thread(target=_ask, args=(asking,), daemon=True)
    asking.thread.start()
    asking.thread.join(timeout_s)
    if asking.lost:
        return _named(asking)
    if asking.failed:
        return None
    return _named(asking) if asking.done else HUNG


def _named(asking: _Asking) -> list[str]:
    """The lost GPUs this pod has: where the pod's UUIDs are known, those that did not answer (a
    lost GPU none of them is another pod's); else NVML's names of the lost ones."""
    ours = _pod_uuids()
    if not ours or not asking.lost:
        return list(asking.lost)
    if not asking.done:  # cut short after a GPU was found lost: it cannot be told apart
        return list(asking.lost)
    missing = [uuid for uuid in ours if uuid not in asking.answered]
    return [f"GPU {uuid}" for uuid in missing]


def _pod_uuids() -> list[str]:
    listed = [d.strip() for d in os.environ.get("NVIDIA_VISIBLE_DEVICES", "").split(",")]
    uuids = [d for d in listed if d]
    return uuids if uuids and all(d.startswith(("GPU-", "MIG-")) for d in uuids) else []


def _ask(asking: _Asking) -> None:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        asking.failed = True  # no driver library, no GPU, no permission: no verdict
        return
    try:
        for index in range(pynvml.nvmlDeviceGetCount()):
            _ask_one(asking, index)
        asking.done = True
    except pynvml.NVMLError:
        asking.failed = True
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _ask_one(asking: _Asking, index: int) -> None:
    """Ask NVML device ``index`` for its handle and UUID, noting it lost or answering."""
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        found = pynvml.nvmlDeviceGetUUID(handle)
    except pynvml.NVMLError as err:
        if getattr(err, "value", None) == pynvml.NVML_ERROR_GPU_IS_LOST:
            asking.lost.append(f"NVML device {index}")
        return
    asking.answered.append(found.decode() if isinstance(found, bytes) else str(found))
