"""What every tracker backend implements, and what it is given: the job, where its files go,
and the metrics of one step (the numeric fields of a steps.jsonl record)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, Protocol

from meshtrain.api import job_dir
from meshtrain.api import spec as api_spec

NOT_METRICS = frozenset({"step", "time"})
"""steps.jsonl fields that are no metric: the x axis, and the wall clock (the tracker's timestamp)."""
SPEC_SECTIONS = ("parallelism", "model", "training")
"""The spec's sections flattened into MLflow params."""
MAX_PARAM_CHARS = 6000
"""Longest MLflow param value (MLflow's limit); longer ones are cut."""
RUN_ID_BYTES = 4096
"""Most bytes of a stored run id file read."""


@dataclasses.dataclass(frozen=True)
class Context:
    """What a tracker knows of the job it logs."""

    job: api_spec.TrainingJobSpec
    """The spec the ranks train (overrides applied)."""
    namespace: str
    """The TrainingJob's namespace (``local`` for ``meshtrain run``)."""
    name: str
    """The TrainingJob's name."""
    home: Path | None
    """The job's checkpoint directory (its log directory when checkpoints go to a bucket): the
    default TensorBoard folder and the stored run ids; None: no local directory (a new run each time)."""
    first_step: int
    """The first step this process trains (after a restore: the restored step + 1)."""
    log_dir: Path | None
    """Where steps.jsonl and the traces are (the run report is drawn from it)."""
    device_name: str | None = None
    """The CUDA device rank 0 trains on (``torch.cuda.get_device_name``); None: a CPU run."""
    local: bool = False
    """Every rank runs on this host (``meshtrain run``, not a pod): the plan shares its cores."""

    @property
    def run_name(self) -> str:
        """The default run name: ``<namespace>/<name>``."""
        return f"{self.namespace}/{self.name}"

    def tracking_dir(self) -> Path | None:
        """``<home>/tracking``: the stored run ids and W&B's files."""
        return self.home / job_dir.TRACKING_SUBDIR if self.home is not None else None

    def stored_id(self, tracker: str) -> dict[str, str]:
        """The run a tracker stored for this job (empty: none, or unreadable)."""
        folder = self.tracking_dir()
        if folder is None:
            return {}
        try:
            with (folder / f"{tracker}.json").open("rb") as handle:
                raw: Any = json.loads(handle.read(RUN_ID_BYTES))
        except (OSError, ValueError):
            return {}
        if not isinstance(raw, dict):
            return {}
        return {str(k): v for k, v in raw.items() if isinstance(v, str)}

    def store_id(self, tracker: str, record: dict[str, str]) -> None:
        """Keep a tracker's run id beside the checkpoints, so a resumed job continues its run."""
        folder = self.tracking_dir()
        if folder is None:
            return
        folder.mkdir(parents=True, exist_ok=True)
        part = folder / f".{tracker}.json.part"
        part.write_text(json.dumps(record, sort_keys=True) + "\n", encoding="utf-8")
        part.replace(folder / f"{tracker}.json")

    def start_line(self) -> dict[str, Any]:
        """The first line the trackers' process reads (:func:`.child.context_of` reads it back): the
        job and where its files go.  Here, not in :mod:`.child`, so that the ranks need not import
        the child's run report and its plotting library."""
        return {
            "spec": self.spec_document(),
            "namespace": self.namespace,
            "name": self.name,
            "home": str(self.home) if self.home is not None else None,
            "first_step": self.first_step,
            "log_dir": str(self.log_dir) if self.log_dir is not None else None,
            "device_name": self.device_name,
            "local": self.local,
        }

    def spec_document(self) -> dict[str, Any]:
        """The spec as YAML writes it (camelCase, defaults included, nulls dropped)."""
        return self.job.model_dump(by_alias=True, exclude_none=True, mode="json")

    def params(self) -> dict[str, str]:
        """The spec's layout, model and training sections flattened: ``training.learningRate`` -> ``"0.003"``."""
        document = self.spec_document()
        flat = {"layout": self.job.parallelism.layout_string}
        for section in SPEC_SECTIONS:
            flat.update(_flatten(section, document.get(section, {})))
        return {key: value[:MAX_PARAM_CHARS] for key, value in flat.items()}


def _flatten(prefix: str, value: Any) -> dict[str, str]:
    """Dotted keys of the mappings in ``value``; lists and scalars as JSON (strings as they are)."""
    if isinstance(value, dict):
        out: dict[str, str] = {}
        for key, inner in value.items():
            out.update(_flatten(f"{prefix}.{key}", inner))
        return out
    return {prefix: value if isinstance(value, str) else json.dumps(value)}


def metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numbers of a steps.jsonl record a tracker plots, under the record's own field names."""
    return {
        key: float(value)
        for key, value in record.items()
        if key not in NOT_METRICS
        and isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


class Backend(Protocol):
    """One tracker.  Called on its own thread, in order: start, log per step, finish."""

    name: str
    """How warnings and docs name it (tensorboard, mlflow, wandb)."""

    def start(self) -> None:
        """Open (or resume) the job's run."""

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        """One step's metrics, stamped ``wall_time`` (Unix seconds)."""

    def finish(self, report: Path | None, finished: bool) -> None:
        """Attach the run report (None: none drawn) and close the run; ``finished``: the last step was trained."""
