"""A GPU that keeps failing: which errors are the device's, and when a pod takes its GPU for bad
(the supervisor's end of it runs in ``tests/trainer/test_supervise.py``).

The CUDA texts come from the CUDA runtime itself (``cudaGetErrorString`` of the libcudart that
torch's wheels bring; it needs no GPU), wrapped as torch and NCCL wrap them.
"""

from __future__ import annotations

import ctypes
import pathlib

import pytest
import torch
import torch.distributed as dist

from meshtrain.trainer.guards import faults
from meshtrain.trainer.recovery import device_fault, generations


def _cuda_text(code: int) -> str:
    """``cudaGetErrorString(code)`` of the CUDA runtime torch ships with."""
    found = sorted(pathlib.Path(torch.__file__).parents[1].glob("nvidia/*/lib/libcudart.so.*"))
    assert found, (
        "no libcudart beside torch: install the project's torch (make venv), with its CUDA wheels"
    )
    runtime = ctypes.CDLL(str(found[0]))
    runtime.cudaGetErrorString.restype = ctypes.c_char_p
    return runtime.cudaGetErrorString(code).decode()


CUDA_ERRORS = {
    214: True,  # cudaErrorECCUncorrectable
    220: True,  # cudaErrorNvlinkUncorrectable
    700: False,  # cudaErrorIllegalAddress: a program's bug as often as not
    710: False,  # cudaErrorAssert: the program's own check
    2: False,  # cudaErrorMemoryAllocation
    100: False,  # cudaErrorNoDevice: a pod without its GPUs reads so on every node
    714: False,  # cudaErrorHardwareStackError: a kernel's own stack overflow
    999: False,  # cudaErrorUnknown
}
"""CUDA runtime error codes -> whether they send a pod away (the policy under test)."""


@pytest.mark.parametrize(("code", "device"), sorted(CUDA_ERRORS.items()))
def test_the_cuda_runtimes_own_texts(code: int, device: bool) -> None:
    text = _cuda_text(code)
    assert device_fault.is_device_error(_accelerator_error(f"CUDA error: {text}")) is device, text
    nccl = f"NCCL error: unhandled cuda error; Last error: Cuda failure '{text}'"
    assert device_fault.is_device_error(RuntimeError(nccl)) is device, text


def _accelerator_error(text: str) -> RuntimeError:
    """torch's ``AcceleratorError`` where this torch has it (a RuntimeError), else a RuntimeError."""
    kind = getattr(torch, "AcceleratorError", RuntimeError)
    try:
        return kind(text)
    except TypeError:  # a constructor that wants more than the text
        return RuntimeError(text)


@pytest.mark.parametrize(
    ("err", "device"),
    [
        (RuntimeError("CUDA error: uncorrectable ECC error encountered"), True),  # older torch
        (
            RuntimeError(
                "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version "
                "2.21.5; Last error: Cuda failure 'uncorrectable NVLink error detected during "
                "the execution'"
            ),
            True,
        ),
        (RuntimeError("NVML error: GPU is lost"), True),  # nvmlErrorString(NVML_ERROR_GPU_IS_LOST)
        (RuntimeError(faults.DEVICE_ERROR_TEXT), True),
        # the program's own errors, or either's: a replayed step would repeat them anywhere
        (RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling `cublasGemmEx`"), False),
        (ValueError("CUDA error: uncorrectable ECC error encountered"), False),
    ],
)
def test_only_the_hardwares_own_errors_count(err: BaseException, device: bool) -> None:
    assert device_fault.is_device_error(err) is device


def test_nccls_report_of_a_device_error_is_a_communication_error_too() -> None:
    """Why the generation loop asks :func:`device_fault.is_device_error` first: NCCL raises the
    GPU's failure as a ``DistError``, which alone would read as a peer gone and keep the rank
    (on its bad GPU) for the next round."""
    err = dist.DistBackendError("NCCL error: Cuda failure 'uncorrectable ECC error encountered'")
    assert generations.communication_error(err) and device_fault.is_device_error(err)


def test_the_same_gpu_failing_twice_within_the_window_is_taken_for_bad() -> None:
    seen = device_fault.DeviceFailures(window_s=3600)
    assert not seen.failed(1, now=0.0)
    assert not seen.failed(0, now=10.0)  # another GPU of the pod: its own count
    assert seen.failed(1, now=3600.0)
    spaced = device_fault.DeviceFailures(window_s=3600)
    assert not spaced.failed(1, now=0.0)
    assert not spaced.failed(1, now=3601.0)  # an hour apart: each a chance event
    assert spaced.failed(1, now=3602.0)


@pytest.mark.parametrize(
    ("err", "lost"),
    [
        (RuntimeError("NVML error: GPU is lost"), True),  # nvmlErrorString(NVML_ERROR_GPU_IS_LOST)
        (RuntimeError(faults.DEVICE_LOST_TEXT), True),  # the kernel log's words for Xid 79
        (RuntimeError(faults.DEVICE_ERROR_TEXT), False),  # a GPU that may still run: replayed
        (RuntimeError(f"CUDA error: {_cuda_text(214)}"), False),
        (ValueError("GPU is lost"), False),  # not the runtime's error
    ],
)
def test_only_a_gpu_gone_reads_as_lost(err: BaseException, lost: bool) -> None:
    """A GPU gone comes back only with a reset of it or its node: its rank exits DEVICE_LOST and
    the supervisor takes it for bad at once (``tests/trainer/test_supervise.py``)."""
    assert device_fault.is_device_lost(err) is lost


def test_the_gpu_is_named_by_cudas_own_list_where_the_pod_has_one():
    """``CUDA_VISIBLE_DEVICES`` is in CUDA's order: its entry is the GPU.  The device plugin's
    ``NVIDIA_VISIBLE_DEVICES`` is the pod's set in the plugin's order: named as the set."""
    uuids = "GPU-7f3a,GPU-91c2"
    name = device_fault.which_gpu
    assert name(1, {"CUDA_VISIBLE_DEVICES": uuids}) == "local rank 1, GPU GPU-91c2"
    assert name(1, {"CUDA_VISIBLE_DEVICES": "4,5"}) == "local rank 1, CUDA_VISIBLE_DEVICES 5"
    assert name(1, {"NVIDIA_VISIBLE_DEVICES": uuids}) == (
        f"local rank 1, one of the pod's GPUs {uuids}"
    )
    # CUDA's list rules once set; the plugin's volume-mounts strategy holds a path, not GPUs
    for environ in (
        {},
        {"NVIDIA_VISIBLE_DEVICES": "all"},
        {"NVIDIA_VISIBLE_DEVICES": "/var/run/nvidia-container-devices"},
        {"CUDA_VISIBLE_DEVICES": "0", "NVIDIA_VISIBLE_DEVICES": uuids},
    ):
        assert name(1, environ) == "local rank 1", environ
