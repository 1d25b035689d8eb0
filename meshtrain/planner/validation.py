"""How far to trust a predicted step time: the profile's provenance and the measured error band.

The band is ``validation.json`` beside this module, written by ``benchmarks/bench_planner_time.py``
from its runs' results; :func:`confidence` combines it with what the profile says of itself into
the statement the plan report and ``--json`` carry (docs/planner.md, "Confidence").
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from meshtrain.planner import profiles

BAND_FILE = Path(__file__).with_name("validation.json")
"""The error band of the committed validation runs."""


@dataclasses.dataclass(frozen=True)
class Band:
    """Measured over predicted step time, and the stage-0 bubble, over the committed validation runs."""

    results_files: tuple[str, ...]
    """Results files the band comes from (relative to the repository), one per run."""
    measured_at: str
    """When the last of the runs ran (UTC)."""
    machine: str
    """Host, CPU and cores it ran on."""
    layouts: int
    """Layouts compared, over all runs."""
    min_ratio: float
    """Smallest measured / predicted."""
    max_ratio: float
    """Largest measured / predicted."""
    median_abs_error: float
    """Median of |measured / predicted - 1|."""
    load_average: tuple[float, float]
    """Lowest and highest 1-minute load average during the runs."""
    max_bubble_error: float = 0.0
    """Largest |measured - predicted| stage-0 bubble of a pipeline layout."""


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
    calibrated_for: str | None = None
    """Layout of the job the calibration measured (``dp2·pp2·tp1``), where recorded."""
    layout: str | None = None
    """Layout of the plan."""

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
            if self.calibrated_for and self.layout and self.calibrated_for != self.layout:
                head += (
                    f" for layout {self.calibrated_for}, not this one ({self.layout}): its block "
                    "rate, step loop and tensor-parallel waits are that layout's; calibrate this job"
                )
        if self.band is None:
            return head + "; no validation run recorded"
        band = self.band
        scope = "" if self.calibrated else " (with calibrated profiles; not this one)"
        runs = len(band.results_files)
        return (
            f"{head}; validation{scope}: measured/predicted {band.min_ratio:.2f}-{band.max_ratio:.2f}, "
            f"median error {band.median_abs_error:.0%} over {band.layouts} layouts in {runs} "
            f"run{'s' if runs != 1 else ''}, pipeline bubble within {band.max_bubble_error:.2f}, "
            "each predicted at the cores other tenants left it during the run "
            f"({band.machine}, load {band.load_average[0]:g}-{band.load_average[1]:g}, "
            f"last {band.measured_at}; {', '.join(band.results_files)})"
        )

    @property
    def resolution(self) -> float | None:
        """Relative step-time difference the validation can tell apart: its median error (None: not validated for this profile)."""
        return self.band.median_abs_error if self.calibrated and self.band else None

    def to_json(self) -> dict[str, Any]:
        """The ``confidence`` object of the plan JSON document."""
        return {
            "profile": self.profile,
            "calibrated": self.calibrated,
            "calibrated_here": self.calibrated_here,
            "calibrated_on": self.calibrated_on,
            "calibrated_for": self.calibrated_for,
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
    data["results_files"] = tuple(data["results_files"])
    return Band(**data)


def band_from_results(results: Sequence[Path]) -> Band:
    """The band over every row of ``planner_time`` results files (one file per run)."""
    documents = [json.loads(Path(path).read_text()) for path in results]
    rows = [row for document in documents for row in document["results"]["layouts"]]
    ratios = [row["ratio_measured_over_predicted"] for row in rows]
    bubbles = [
        abs(row["measured_bubble"] - row["predicted_bubble"])
        for row in rows
        if row["spec_layout"].split("·")[1] != "pp1"
    ]
    loads = [
        load[0]
        for row in rows
        for load in (row["load_average_before"], row["load_average_after"])
        if load
    ]
    host = documents[-1]["machine"]
    return Band(
        results_files=tuple(_shown(Path(path)) for path in results),
        measured_at=max(document["time"] for document in documents),
        machine=f"{host['host']}, {host.get('cpu_model')}, {host['cpu_count']} cores",
        layouts=len(rows),
        min_ratio=round(min(ratios), 3),
        max_ratio=round(max(ratios), 3),
        median_abs_error=round(statistics.median(abs(x - 1) for x in ratios), 3),
        load_average=(min(loads, default=0.0), max(loads, default=0.0)),
        max_bubble_error=round(max(bubbles, default=0.0), 3),
    )


def _shown(path: Path) -> str:
    """``path`` relative to the repository where it lies inside it."""
    try:
        return str(path.resolve().relative_to(Path(__file__).resolve().parents[2]))
    except ValueError:
        return str(path)


def write_band(results: Sequence[Path], path: Path = BAND_FILE) -> Path:
    """Write the band of results files (the runs a release is validated by) next to this module."""
    band = band_from_results(results)
    path.write_text(json.dumps(dataclasses.asdict(band), indent=2) + "\n")
    return path


def confidence(
    profile: profiles.Profile, host: str, band: Band | None, layout: str | None = None
) -> Confidence:
    """The confidence statement of a plan of ``layout`` made with ``profile`` on ``host``."""
    measured_on = profile.calibration.get("host")
    device = profile.calibration.get("device")
    return Confidence(
        profile=profile.name,
        calibrated=profile.calibrated,
        calibrated_here=profile.calibrated and measured_on == host,
        calibrated_on=f"{measured_on}, {device}" if profile.calibrated else None,
        band=band,
        calibrated_for=profile.calibration.get("job_layout"),
        layout=layout,
    )
