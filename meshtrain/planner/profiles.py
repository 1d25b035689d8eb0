"""Hardware profiles: the device figures the planner's formulas need, and their YAML files.

The built-in files are ``meshtrain/planner/profiles/*.yaml``, one per device, each with a
``source:`` naming its datasheet; files of the same form in ``--profiles-dir`` or
``$MESHTRAIN_PROFILES_DIR`` add profiles or replace a built-in of the same name.
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

GPU_RESERVE_BYTES = 2 * 2**30
"""``reserved_bytes`` of a GPU (bf16) profile that names none, such as one calibrated before the
key existed; CPU profiles reserve nothing."""

REQUIRED_NUMBERS = (
    "peak_flops",
    "achievable_fraction",
    "memory_bytes",
    "memory_bandwidth",
    "nvlink_bandwidth",
    "nvlink_latency",
    "nic_bandwidth",
    "nic_latency",
)
"""Numbers every profile file must give (``name`` and ``source`` are required too)."""


COLLECTIVE_OPS = ("all_reduce", "all_gather", "reduce_scatter", "send")
"""Operations a calibration measures (``send``: one point-to-point message)."""


class ProfileError(ValueError):
    """A profile file is malformed or a requested profile does not exist."""


@dataclasses.dataclass(frozen=True)
class CollectiveFit:
    """``T(M) = calls x alpha_steps x alpha + M / bandwidth`` as measured for one op and group size.

    ``alpha`` is per message step of the ring (``2(n-1)`` per all-reduce,
    ``n-1`` per all-gather or reduce-scatter, 1 per send) and ``bandwidth``
    the bus bandwidth (nccl-tests convention), so the fit plugs into the same
    ring formulas as the datasheet figures.
    """

    op: str
    """``all_reduce``, ``all_gather``, ``reduce_scatter`` or ``send``."""
    members: int
    """Ranks in the group (2 for ``send``)."""
    alpha: float
    """Seconds per message step."""
    bandwidth: float
    """Bus bytes/s per rank."""
    processes: int = 0
    """Processes running on the host while it was measured (their contention is in the figures)."""
    cpu_call_seconds: float = 0.0
    """CPU seconds one member spends per call of the smallest message (0: unmeasured; CPU hosts)."""
    cpu_bandwidth: float = 0.0
    """Payload bytes per CPU second a member moves past the smallest message (0: unmeasured)."""


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
    """Share of ``peak_flops`` an eager dense transformer step reaches (model FLOPs utilisation);
    compiled, a datasheet GPU profile's step runs faster (:mod:`.device_rate`)."""
    memory_bytes: float
    """Device memory per GPU (or per CPU worker) in bytes: ``nvidia-smi``'s ``memory.total`` on the
    built-in GPU profiles, CUDA's total (a little less) on calibrated ones."""
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
    fp8_peak_flops: float = 0.0
    """Peak dense float8 FLOP/s per device (``training.float8``'s linears); 0: no float8 tensor cores.
    MFU stays against ``peak_flops`` (:mod:`.mfu`)."""
    reserved_bytes: float = 0.0
    """Of ``memory_bytes``, what a training process's tensors cannot use: the CUDA context, NCCL's
    buffers and library workspaces outside PyTorch's allocator, and on the built-in profiles also
    the driver's share that CUDA does not expose.  An assumption (:data:`GPU_RESERVE_BYTES` where
    a GPU profile gives none); ``--calibrate`` measures it on a GPU and keeps the larger."""
    path: str = ""
    """File the profile was read from (empty for profiles built in code)."""
    op_overhead: float = 0.0
    """Seconds of fixed cost per tensor operation (dispatch, kernel launch); 0 where unmeasured."""
    cores: int = 0
    """CPU cores the ranks of one host share (0: every rank has its own device)."""
    flops_by_ranks: dict[int, float] = dataclasses.field(default_factory=dict)
    """Matmul FLOP/s of one rank measured while this many ranks ran at once on the host (CPU profiles)."""
    collectives: tuple[CollectiveFit, ...] = ()
    """Measured alpha-beta fits inside one host, by op and group size."""
    calibration: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Where and when the figures were measured (host, device, backend, load); empty: not measured."""
    core_flops: float = 0.0
    """FLOP/s of the job's block per CPU second of one rank (CPU hosts; 0: unmeasured): load-independent work."""
    core_op_overhead: float = 0.0
    """CPU seconds per small tensor operation, forward and backward (CPU hosts; 0: unmeasured)."""
    available_cores: float = 0.0
    """Cores the job's ranks together received while all computed at calibration (0: unmeasured, use ``cores``)."""
    rank_step_cpu_seconds: float = 0.0
    """CPU seconds each rank spends per step beyond its tensor work and collectives (Python step loop, telemetry, gloo threads), measured with ``calibration.processes`` ranks on the host (CPU hosts; 0: unmeasured)."""
    step_loop_between_share: float = 1.0
    """Share of ``rank_step_cpu_seconds`` a rank spends between its pipeline actions (outside every recorded event), measured in calibration's step-loop run; the rest runs inside the actions."""
    tp_collectives: tuple[CollectiveFit, ...] = ()
    """Tensor-parallel collectives as the trainer's own calls cost them in calibration's step-loop run, by op and group size: ``alpha`` from their wall time (used where such a call blocks its rank's core), ``cpu_call_seconds`` from the CPU their process spent over them (the work bound's price of a call)."""
    activation_message_seconds: float = 0.0
    """Wall seconds from a pipeline stage's forward ending to the next stage holding its activations, where they were still in flight when it asked: the mean over calibration's step-loop run of the job's layout, the receiver's wake-up included (CPU hosts; 0: unmeasured, the ``send`` fit prices the message).  It replaces the fit in the pipeline replay."""
    gradient_message_seconds: float = 0.0
    """The same for a backward's input gradients on their way to the stage before."""

    @property
    def cpu_time_model(self) -> bool:
        """Whether steps are priced as CPU work over the host's available cores (calibrated CPU hosts)."""
        return self.cores > 0 and self.core_flops > 0

    @property
    def tensor_memory_bytes(self) -> float:
        """Device memory the planner lets a rank's tensors fill: ``memory_bytes`` less ``reserved_bytes``."""
        return self.memory_bytes - self.reserved_bytes

    @property
    def achievable_flops(self) -> float:
        """FLOP/s the planner expects a step to run at: peak x achievable fraction."""
        return self.peak_flops * self.achievable_fraction

    @property
    def calibrated(self) -> bool:
        """Whether the figures were measured by ``meshtrain plan --calibrate``."""
        return bool(self.calibration)

    def collective_fit(self, op: str, members: int) -> CollectiveFit | None:
        """The measured fit of ``op`` closest in group size to ``members`` (None when unmeasured)."""
        fits = [f for f in self.collectives if f.op == op]
        if not fits:
            return None
        return min(fits, key=lambda f: (abs(f.members - members), -f.members))


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
    for key in REQUIRED_NUMBERS:
        raw = _numeric(data.get(key))
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
    values["reserved_bytes"] = float(GPU_RESERVE_BYTES if precision == "bf16" else 0)
    if "reserved_bytes" in data:
        values["reserved_bytes"] = _number(data, "reserved_bytes", origin)
    if values["reserved_bytes"] >= values["memory_bytes"]:
        raise ProfileError(
            f"{origin}: 'reserved_bytes' ({values['reserved_bytes']:g}) must be less than "
            f"'memory_bytes' ({values['memory_bytes']:g})"
        )
    if "fp8_peak_flops" in data:
        values["fp8_peak_flops"] = _number(data, "fp8_peak_flops", origin)
    values.update(_measured(data, origin))
    return Profile(path=origin, **values)


def _numeric(raw: Any) -> Any:
    """``raw``, or the float a string spells.

    YAML 1.1 (PyYAML) reads ``989.0e12`` (no exponent sign) and ``1e-05``
    (no dot: how Helm's ``toYaml`` prints small floats) as strings.
    """
    if isinstance(raw, str):
        try:
            return float(raw)
        except ValueError:
            return raw
    return raw


def _number(data: Mapping[str, Any], key: str, origin: str, *, minimum: float = 0.0) -> float:
    raw = _numeric(data.get(key))
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not raw >= minimum:
        raise ProfileError(f"{origin}: '{key}' must be a number >= {minimum:g}, got {raw!r}")
    return float(raw)


def _measured(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    """The optional measured keys a calibration writes."""
    out: dict[str, Any] = {}
    if "op_overhead" in data:
        out["op_overhead"] = _number(data, "op_overhead", origin)
    if "cores" in data:
        out["cores"] = int(_number(data, "cores", origin))
    for key in (
        "core_flops",
        "core_op_overhead",
        "available_cores",
        "rank_step_cpu_seconds",
        "step_loop_between_share",
        "activation_message_seconds",
        "gradient_message_seconds",
    ):
        if key in data:
            out[key] = _number(data, key, origin)
    table = data.get("flops_by_ranks") or {}
    if not isinstance(table, Mapping):
        raise ProfileError(f"{origin}: 'flops_by_ranks' must map rank counts to FLOP/s")
    out["flops_by_ranks"] = {
        int(ranks): _number({"flops": flops}, "flops", f"{origin}: flops_by_ranks[{ranks}]")
        for ranks, flops in table.items()
    }
    out["collectives"] = _fits(data, "collectives", origin)
    out["tp_collectives"] = _fits(data, "tp_collectives", origin)
    calibration = data.get("calibration") or {}
    if not isinstance(calibration, Mapping):
        raise ProfileError(f"{origin}: 'calibration' must be a mapping (host, device, measured_at)")
    out["calibration"] = dict(calibration)
    return out


def _fits(data: Mapping[str, Any], key: str, origin: str) -> tuple[CollectiveFit, ...]:
    """The collective fits listed under ``key``."""
    fits = []
    for index, entry in enumerate(data.get(key) or []):
        where = f"{origin}: {key}[{index}]"
        if not isinstance(entry, Mapping) or entry.get("op") not in COLLECTIVE_OPS:
            raise ProfileError(f"{where}: 'op' must be one of {', '.join(COLLECTIVE_OPS)}")
        fits.append(
            CollectiveFit(
                op=entry["op"],
                members=int(_number(entry, "members", where, minimum=2)),
                alpha=_number(entry, "alpha", where),
                bandwidth=_number(entry, "bandwidth", where, minimum=1.0),
                processes=int(entry.get("processes", 0)),
                cpu_call_seconds=_number(
                    {"v": entry.get("cpu_call_seconds", 0.0)}, "v", f"{where}: cpu_call_seconds"
                ),
                cpu_bandwidth=_number(
                    {"v": entry.get("cpu_bandwidth", 0.0)}, "v", f"{where}: cpu_bandwidth"
                ),
            )
        )
    return tuple(fits)


def is_builtin(profile: Profile) -> bool:
    """Whether ``profile`` was read from the profiles shipped with meshtrain."""
    return bool(profile.path) and Path(profile.path).parent == BUILTIN_DIR


def to_mapping(profile: Profile) -> dict[str, Any]:
    """The YAML form of a profile (what :func:`from_mapping` reads back)."""
    out = {
        f.name: getattr(profile, f.name)
        for f in dataclasses.fields(Profile)
        if f.name not in ("path", "collectives", "tp_collectives")
    }
    out["collectives"] = [dataclasses.asdict(fit) for fit in profile.collectives]
    out["tp_collectives"] = [dataclasses.asdict(fit) for fit in profile.tp_collectives]
    return out


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


def write(profile: Profile, directory: str | Path) -> Path:
    """Write ``profile`` as ``DIRECTORY/<name>.yaml``, which ``--profiles-dir DIRECTORY`` reads back."""
    path = Path(directory) / f"{profile.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    header = (
        f"# Written by `meshtrain plan --calibrate` on {profile.calibration.get('host')} "
        f"at {profile.calibration.get('measured_at')}; read with --profiles-dir {path.parent}\n"
    )
    path.write_text(header + yaml.safe_dump(to_mapping(profile), sort_keys=False))
    return path
