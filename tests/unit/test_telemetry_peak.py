"""The trainer's MFU peak is the planner profiles' (one table), and a GPU no profile names gets no
MFU and one warning asking for ``metrics.peakFlops`` instead of a figure against another peak."""

from __future__ import annotations

import logging

import pytest
import torch
import yaml

from meshtrain.planner import mfu, profiles
from meshtrain.trainer.telemetry import peak

# CUDA names as torch.cuda.get_device_name reports them -> the built-in profile file of that GPU
CUDA_NAMES = {
    "NVIDIA H200": "h200",
    "NVIDIA H100 80GB HBM3": "h100-sxm",
    "NVIDIA A100-SXM4-80GB": "a100-80g",
    "NVIDIA A100 80GB PCIe": "a100-80g",
    "NVIDIA A100-SXM4-40GB": "a100-40g",
    "NVIDIA A100-PCIE-40GB": "a100-40g",
    "NVIDIA L40S": "l40s",
}


def _yaml_peak(profile: str) -> float:
    """``peak_flops`` as the profile file states it (read here, not through the planner's loader)."""
    document = yaml.safe_load((profiles.BUILTIN_DIR / f"{profile}.yaml").read_text())
    return float(document["peak_flops"])


@pytest.mark.parametrize("name", list(CUDA_NAMES))
def test_the_trainers_peak_of_a_known_gpu_is_its_profiles(name):
    assert peak.gpu_peak_flops(name) == _yaml_peak(CUDA_NAMES[name])


def test_every_gpu_the_table_names_has_a_profile_with_that_peak():
    for _, profile in mfu.GPU_PROFILES:
        assert mfu.builtin_peak(profile) == _yaml_peak(profile)


@pytest.mark.parametrize("name", ["NVIDIA GH200 480GB", "NVIDIA H100 PCIe", "NVIDIA B200"])
def test_a_gpu_no_profile_names_has_no_peak(name):
    assert peak.gpu_peak_flops(name) is None


def test_an_unknown_gpu_gets_no_mfu_and_one_warning(monkeypatch, caplog):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA Future X1")
    with caplog.at_level(logging.WARNING, logger=peak.log.name):
        assert peak.resolve_peak_flops(None, "cuda") == 0.0
        assert peak.resolve_peak_flops(None, "cuda") == 0.0
        assert peak.resolve_peak_flops(5e14, "cuda") == 5e14  # metrics.peakFlops still wins
    warned = [r.getMessage() for r in caplog.records if "NVIDIA Future X1" in r.getMessage()]
    assert len(warned) == 1 and "spec.metrics.peakFlops" in warned[0], warned
