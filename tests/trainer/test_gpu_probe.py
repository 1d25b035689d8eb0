"""The GPU probe against a driver library answering as a lost, a healthy, a hung or no GPU would.

The library is ``fake_nvml.c`` (this machine has no GPU): the verdicts come from what NVML's calls
return, through NVIDIA's own ``nvidia-ml-py`` in a fresh process that finds the library as a pod
finds the driver's.  On a lent GPU, ``tests/trainer/test_on_device.py`` asks the real driver.
"""

from __future__ import annotations

import ctypes.util
import json
import os
import subprocess
import sys
import time

import pytest

PROBE = (
    "import json, sys; from meshtrain.trainer.recovery import gpu_probe; "
    "print(json.dumps([gpu_probe.probe(float(t)) for t in sys.argv[1:]]))"
)
FAKES = (
    "FAKE_NVML_DEVICES",
    "FAKE_NVML_LOST",
    "FAKE_NVML_CODE",
    "FAKE_NVML_AT",
    "FAKE_NVML_HANG_S",
)
LOST, NO_PERMISSION, NOT_SUPPORTED, UNKNOWN = "15", "4", "3", "999"  # nvml.h's return codes


def _uuid(index: int) -> str:
    return f"GPU-00000000-0000-0000-0000-{index:012d}"  # fake_nvml.c's


def _probes(library_dir: str, *timeouts: float, **env: str) -> list:
    """Each probe's answer, one after the other in one process (its driver library, its env)."""
    full = {k: v for k, v in os.environ.items() if k not in FAKES and k != "NVIDIA_VISIBLE_DEVICES"}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, *(str(t) for t in timeouts or (5.0,))],
        env={**full, "LD_LIBRARY_PATH": library_dir, **env},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return json.loads(done.stdout)


def _probe(library_dir: str, **env: str):
    (found,) = _probes(library_dir, **env)
    return found


@pytest.mark.parametrize("at", ["handle", "uuid"])
def test_a_gpu_the_driver_calls_lost_is_named_and_healthy_ones_are_not(
    fake_nvml: str, at: str
) -> None:
    """Lost at its handle (a GPU fallen off the bus) or only at a query on it."""
    assert _probe(fake_nvml, FAKE_NVML_DEVICES="8") == []
    found = _probe(fake_nvml, FAKE_NVML_DEVICES="8", FAKE_NVML_LOST="3,6", FAKE_NVML_AT=at)
    assert found == ["NVML device 3", "NVML device 6"]


@pytest.mark.parametrize("code", [NO_PERMISSION, NOT_SUPPORTED, UNKNOWN])
def test_an_error_that_is_not_gpu_is_lost_says_nothing_of_the_device(
    fake_nvml: str, code: str
) -> None:
    """No permission (a MIG parent to an unprivileged container), a call not supported, an
    unknown error: the GPU is not taken for lost."""
    assert _probe(fake_nvml, FAKE_NVML_DEVICES="2", FAKE_NVML_LOST="1", FAKE_NVML_CODE=code) == []


def test_only_the_pods_own_gpus_count_where_the_device_plugin_named_them(fake_nvml: str) -> None:
    """A privileged pod sees all eight GPUs of its node: another pod's lost GPU is not its own;
    its own lost GPU is named by the UUID the device plugin gave."""
    node = {"FAKE_NVML_DEVICES": "8", "FAKE_NVML_LOST": "6", "FAKE_NVML_AT": "handle"}
    ours = f"{_uuid(0)},{_uuid(1)}"
    assert _probe(fake_nvml, **node, NVIDIA_VISIBLE_DEVICES=ours) == []
    ours = f"{_uuid(5)},{_uuid(6)}"
    assert _probe(fake_nvml, **node, NVIDIA_VISIBLE_DEVICES=ours) == [f"GPU {_uuid(6)}"]


def test_a_driver_that_does_not_answer_is_hung_once_and_never_asked_again_meanwhile(
    fake_nvml: str,
) -> None:
    """The first probe waits its timeout; the second, while the first is still blocked in the
    driver, answers at once without asking."""
    began = time.monotonic()
    found = _probes(fake_nvml, 1.0, 1.0, FAKE_NVML_HANG_S="30", FAKE_NVML_LOST="0")
    assert found == ["hung", "hung"]
    assert time.monotonic() - began < 20  # the interpreter's start, then one second, not two hangs


@pytest.mark.skipif(
    ctypes.util.find_library("nvidia-ml") is not None, reason="this machine has a driver"
)
def test_no_driver_library_gives_no_verdict(tmp_path) -> None:
    assert _probe(str(tmp_path)) is None
