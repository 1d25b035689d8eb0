"""Hardware profiles: the device figures the planner's formulas need.

The :class:`Profile` value (peak FLOP/s, memory, link bandwidths
and latencies of one accelerator model) and the loader of profile YAML files.
The built-in files live in ``meshtrain/planner/profiles/*.yaml``, one per
device, each with a ``source:`` note naming the datasheet its figures come
from.  Users add or override profiles with files of the same form in a
directory given by ``--profiles-dir`` or the ``MESHTRAIN_PROFILES_DIR``
environment variable (several directories separated by ``os.pathsep``); a user
file with a built-in's name replaces the built-in.

Not a detector of the hardware the code runs on.  Reading the
YAML files is the only I/O here.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml

BUILTIN_DIR = Path(__file__).with_name("profiles")
"""Directory of the profiles shipped with meshtrain."""

ENV_VAR = "MESHTRAIN_PROFILES_DIR"
"""Environment variable naming extra profile directories (``os.pathsep``-separated)."""

_REQUIRED_FLOATS = (
    "peak_flops",
    "achievable_fraction",
    "memory_bytes",
    "memory_bandwidth",
    "nvlink_bandwidth",
    "nvlink_latency",
    "nic_bandwidth",
    "nic_latency",
)


class ProfileError(ValueError):
    """A profile file is malformed or a requested profile does not exist."""


@dataclasses.dataclass(frozen=True)
class Profile:
    """One accelerator model as the planner sees it (SI units: bytes, seconds, FLOP/s)."""

    name: str
    """Profile name used on the command line, e.g. ``h100-sxm``."""
    description: str
    """One line saying what hardware this is."""
    source: str
    """Where the figures come from (datasheet names) and which ones are assumptions."""
    peak_flops: float
    """Peak dense FLOP/s per device in the training precision (bf16 on GPUs, fp32 on CPU)."""
    achievable_fraction: float
    """Share of ``peak_flops`` a dense transformer step reaches (model FLOPs utilisation)."""
    memory_bytes: float
    """Device memory per GPU (or per CPU worker) in bytes."""
    memory_bandwidth: float
    """Device memory bandwidth in bytes/s (prices the optimizer step)."""
    nvlink_bandwidth: float
    """Bytes/s per direction per GPU inside one NVLink domain (PCIe or loopback where there is none)."""
    nvlink_latency: float
    """Seconds per message step (alpha) inside one NVLink domain."""
    nic_bandwidth: float
    """Bytes/s per direction per GPU across the fabric between nodes."""
    nic_latency: float
    """Seconds per message step (alpha) across the fabric."""
    precision: str = "bf16"
    """Training precision the profile implies: ``bf16`` (GPUs) or ``fp32`` (CPU)."""
    path: str = ""
    """File the profile was read from (empty for profiles built in code)."""

    @property
    def achievable_flops(self) -> float:
        """FLOP/s the planner expects a step to run at: peak x achievable fraction."""
        return self.peak_flops * self.achievable_fraction


def from_mapping(data: Mapping[str, Any], origin: str = "<mapping>") -> Profile:
    """Build a profile from a parsed YAML mapping; errors name the file and the key."""
    if not isinstance(data, Mapping):
        raise ProfileError(
            f"{origin}: expected a mapping of profile fields, got {type(data).__name__}"
        )
    known = {f.name for f in dataclasses.fields(Profile)} - {"path"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ProfileError(
            f"{origin}: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    values: dict[str, Any] = {}
    for key in ("name", "source"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise ProfileError(f"{origin}: '{key}' must be a non-empty string")
        values[key] = data[key].strip()
    values["description"] = str(data.get("description", values["name"])).strip()
    for key in _REQUIRED_FLOATS:
        raw = data.get(key)
        if isinstance(raw, str):  # YAML 1.1 reads 989.0e12 (no exponent sign) as a string
            try:
                raw = float(raw)
            except ValueError:
                pass
        if (
            isinstance(raw, bool)
            or not isinstance(raw, (int, float))
            or not raw > 0
            or raw == float("inf")
        ):
            raise ProfileError(f"{origin}: '{key}' must be a positive number, got {raw!r}")
        values[key] = float(raw)
    if values["achievable_fraction"] > 1:
        raise ProfileError(
            f"{origin}: 'achievable_fraction' must be <= 1, got {values['achievable_fraction']}"
        )
    precision = data.get("precision", "bf16")
    if precision not in ("bf16", "fp32"):
        raise ProfileError(f"{origin}: 'precision' must be bf16 or fp32, got {precision!r}")
    values["precision"] = precision
    return Profile(path=origin, **values)


def load_file(path: str | Path) -> Profile:
    """Read one profile YAML file."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ProfileError(f"{path}: cannot read profile: {err}") from None
    return from_mapping(data, str(path))


def search_dirs(extra: Iterable[str | Path] = ()) -> list[Path]:
    """Profile directories in override order: built-in, then ``$MESHTRAIN_PROFILES_DIR``, then ``extra``."""
    dirs = [BUILTIN_DIR]
    env = os.environ.get(ENV_VAR, "")
    dirs += [Path(p) for p in env.split(os.pathsep) if p]
    dirs += [Path(p) for p in extra]
    return dirs


def load_all(extra_dirs: Iterable[str | Path] = ()) -> dict[str, Profile]:
    """Every profile by name; later directories override earlier ones."""
    found: dict[str, Profile] = {}
    for directory in search_dirs(extra_dirs):
        if not directory.is_dir():
            if directory != BUILTIN_DIR:
                raise ProfileError(f"profiles directory {directory} does not exist")
            continue
        for path in sorted(directory.glob("*.yaml")) + sorted(directory.glob("*.yml")):
            profile = load_file(path)
            found[profile.name] = profile
    return found


def get(name: str, extra_dirs: Iterable[str | Path] = ()) -> Profile:
    """The profile called ``name``; an unknown name raises an error listing the known ones."""
    known = load_all(extra_dirs)
    if name not in known:
        raise ProfileError(
            f"unknown GPU profile {name!r}; known profiles: {', '.join(sorted(known))}"
        )
    return known[name]


def calibrated(
    base: Profile,
    *,
    flops: float | None = None,
    link_bandwidth: float | None = None,
    link_latency: float | None = None,
    name: str | None = None,
) -> Profile:
    """A copy of ``base`` with measured figures: achievable FLOP/s and the intra-host link's beta/alpha.

    A measured FLOP/s becomes ``peak_flops`` with ``achievable_fraction`` 1, so
    the planner uses the measurement as is.
    """
    changes: dict[str, Any] = {"name": name or base.name}
    if flops is not None:
        changes.update(peak_flops=flops, achievable_fraction=1.0)
    if link_bandwidth is not None:
        changes["nvlink_bandwidth"] = link_bandwidth
    if link_latency is not None:
        changes["nvlink_latency"] = link_latency
    return dataclasses.replace(base, **changes)
