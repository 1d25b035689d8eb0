"""The profile a job is planned on when none is named: ``meshtrain plan`` and the trackers'
``plan.txt`` both choose it here, so the two never disagree.

Without a device name: ``cpu`` for an fp32 job, else ``h100-sxm``.  A rank on a GPU passes what
``torch.cuda.get_device_name`` says, and a known product picks its own profile (the same
lookup MFU's peak uses, :func:`mfu.gpu_profile`).  A local run
(``meshtrain run``, every rank on this host) prices the built-in CPU profile over the host's
cores (:func:`host_model.on_host`).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from meshtrain.api import spec as api_spec
from meshtrain.planner import host_model, mfu, profiles


def profile_name(job: api_spec.TrainingJobSpec, device_name: str | None = None) -> str:
    """The built-in profile for ``job`` on ``device_name`` (None or unknown: by the job's precision)."""
    known = mfu.gpu_profile(device_name) if device_name else None
    if known is not None:
        return known
    return "cpu" if job.training.precision == "fp32" else "h100-sxm"


def profile(
    job: api_spec.TrainingJobSpec,
    *,
    device_name: str | None = None,
    local_cores: int | None = None,
    extra_dirs: Iterable[str | Path] = (),
) -> profiles.Profile:
    """The default profile, on ``local_cores`` shared by the ranks when the job runs on this host."""
    chosen = profiles.get(profile_name(job, device_name), extra_dirs)
    return host_model.on_host(chosen, local_cores) if local_cores else chosen
