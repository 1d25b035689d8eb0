"""How far to trust a predicted step time: the profile's provenance and the measured error band.

``benchmarks/bench_planner_time.py`` runs several layouts with calibrated
profiles and writes, besides its results file, ``validation.json`` next to
this module: the spread of measured over predicted step time it saw, the
machine and the load.  :func:`confidence` combines that band with what the
profile says of itself (measured by ``--calibrate``, on this host or not;
or datasheet figures never checked against a run) into the statement the
plan report and ``--json`` carry.  Reading and writing that file is the only
I/O here.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from meshtrain.planner import profiles

BAND_FILE = Path(__file__).with_name("validation.json")
"""The error band of the last committed validation run."""


@dataclasses.dataclass(frozen=True)
class Band:
    """Measured over predicted step time in the last validation run."""

    results_file: str
    """Results file the band comes from (relative to the repository)."""
    measured_at: str
    """When the validation ran (UTC)."""
    machine: str
    """Host, CPU and cores it ran on."""
    layouts: int
    """Layouts compared."""
    min_ratio: float
    """Smallest measured / predicted."""
    max_ratio: float
    """Largest measured / predicted."""
    median_abs_error: float
    """Median of |measured / predicted - 1|."""
    load_average: tuple[float, float]
    """Lowest and highest 1-minute load average during the runs."""


@dataclasses.dataclass(frozen=True)
class Confidence:
    """What a plan's time rests on."""

    profile: str
    calibrated: bool
    """Figures measured by ``meshtrain plan --calibrate`` (else datasheet or placeholder figures)."""
    calibrated_here: bool
    """Measured on the host the plan runs on."""
    calibrated_on: str | None
    """Host and device the calibration measured (None when not calibrated)."""
    band: Band | None
    """The validation's error band (applies to calibrated profiles; None when no validation ran)."""

    @property
    def statement(self) -> str:
        """One line for the report."""
        if not self.calibrated:
            head = (
                f"profile {self.profile} is not calibrated (datasheet or placeholder figures): "
                "its step time was never checked against a run; "
                "measure this machine with meshtrain plan --calibrate"
            )
        else:
            where = (
                "this machine"
                if self.calibrated_here
                else f"another machine ({self.calibrated_on})"
            )
            head = f"profile {self.profile} calibrated on {where}"
        if self.band is None:
            return head + "; no validation run recorded"
        band = self.band
        scope = "" if self.calibrated else " (with calibrated profiles; not this one)"
        return (
            f"{head}; validation{scope}: measured/predicted {band.min_ratio:.2f}-{band.max_ratio:.2f}, "
            f"median error {band.median_abs_error:.0%} over {band.layouts} layouts, "
            "each predicted at the cores other tenants left it during the run "
            f"({band.machine}, load {band.load_average[0]:g}-{band.load_average[1]:g}, "
            f"{band.measured_at}; {band.results_file})"
        )

    def to_json(self) -> dict[str, Any]:
        """The ``confidence`` object of the plan JSON document."""
        return {
            "profile": self.profile,
            "calibrated": self.calibrated,
            "calibrated_here": self.calibrated_here,
            "calibrated_on": self.calibrated_on,
            "band": dataclasses.asdict(self.band) if self.band else None,
            "statement": self.statement,
        }


def load_band(path: Path = BAND_FILE) -> Band | None:
    """The committed band (None when the file is missing)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    data["load_average"] = tuple(data["load_average"])
    return Band(**data)


def band_from_results(results_path: Path, document: dict[str, Any]) -> Band:
    """The band of a ``planner_time`` results document."""
    results = document["results"]
    summary = results["summary"]
    loads = [
        load[0]
        for row in results["layouts"]
        for load in (row["load_average_before"], row["load_average_after"])
        if load
    ]
    host = document["machine"]
    try:
        shown = results_path.resolve().relative_to(Path(__file__).resolve().parents[2])
    except ValueError:
        shown = results_path
    return Band(
        results_file=str(shown),
        measured_at=document["time"],
        machine=f"{host['host']}, {host.get('cpu_model')}, {host['cpu_count']} cores",
        layouts=summary["layouts"],
        min_ratio=round(summary["min_ratio"], 3),
        max_ratio=round(summary["max_ratio"], 3),
        median_abs_error=round(summary["median_abs_error"], 3),
        load_average=(min(loads, default=0.0), max(loads, default=0.0)),
    )


def write_band(results_path: Path, summary: dict[str, Any], path: Path = BAND_FILE) -> Path:
    """Write the band of a just-written results file next to this module."""
    document = json.loads(Path(results_path).read_text())
    band = band_from_results(Path(results_path), document)
    path.write_text(json.dumps(dataclasses.asdict(band), indent=2) + "\n")
    return path


def confidence(profile: profiles.Profile, host: str, band: Band | None) -> Confidence:
    """The confidence statement of a plan made with ``profile`` on ``host``."""
    measured_on = profile.calibration.get("host")
    device = profile.calibration.get("device")
    return Confidence(
        profile=profile.name,
        calibrated=profile.calibrated,
        calibrated_here=profile.calibrated and measured_on == host,
        calibrated_on=f"{measured_on}, {device}" if profile.calibrated else None,
        band=band,
    )
