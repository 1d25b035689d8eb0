"""MLflow tracking through ``MlflowClient`` (``mlflow-skinny``): one run per job.

The run's id is stored beside the checkpoints, so a resumed job continues the same run.  A new
run gets the spec's layout, model and training sections as params, the namespace and job as
tags and ``meshtrain plan``'s report as ``plan.txt``; every step its metrics; the end the run
report (``meshtrain report``'s page) as ``report.html``.  The client's HTTP retries and timeout
are bounded (:data:`HTTP_ENV`) unless the environment sets them.
"""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import tracking as api_tracking
from meshtrain.planner import estimate, profiles
from meshtrain.planner import report as plan_report
from meshtrain.trainer.telemetry.tracking import backend

HTTP_ENV = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_MAX_BACKOFF": "10",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
"""MLflow's own variables, bounded (its defaults retry for minutes); the environment may override."""
DEFAULT_EXPERIMENT = "meshtrain"
"""The experiment when neither the spec nor MLFLOW_EXPERIMENT_NAME names one."""
PARAMS_PER_BATCH = 100
"""Params in one request (MLflow's limit)."""
PLAN_FILE = "plan.txt"
"""The plan's artifact."""


class MLflowRun:
    """The job's MLflow run."""

    name = "mlflow"

    def __init__(self, settings: api_tracking.MLflow, context: backend.Context) -> None:
        self.settings = settings
        self.context = context
        self._client: Any = None
        self._entities: Any = None
        self.run_id = ""

    def tracking_uri(self) -> str | None:
        """The spec's URI, else MLFLOW_TRACKING_URI (None: MLflow's own default)."""
        return self.settings.tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None

    def start(self) -> None:
        for key, value in HTTP_ENV.items():
            os.environ.setdefault(key, value)
        uri = self.tracking_uri()
        if uri is not None and uri.startswith(
            "file:"
        ):  # MLflow keeps its file store behind a switch
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._entities = importlib.import_module("mlflow.entities")
        client_module = importlib.import_module("mlflow.tracking")
        self._client = client_module.MlflowClient(tracking_uri=uri)
        stored = self.context.stored_id(self.name)
        if stored.get("run_id") and stored.get("tracking_uri", "") == (uri or ""):
            self.run_id = stored["run_id"]
            self._client.update_run(self.run_id, status="RUNNING")
            return
        self.run_id = self._create_run()
        self.context.store_id(self.name, {"run_id": self.run_id, "tracking_uri": uri or ""})
        params = [self._entities.Param(k, v) for k, v in sorted(self.context.params().items())]
        for first in range(0, len(params), PARAMS_PER_BATCH):
            self._client.log_batch(self.run_id, params=params[first : first + PARAMS_PER_BATCH])
        self._client.log_text(self.run_id, plan_text(self.context.job), PLAN_FILE)

    def _create_run(self) -> str:
        experiment = (
            self.settings.experiment_name
            or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or DEFAULT_EXPERIMENT
        )
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id if found is not None else self._client.create_experiment(experiment)
        )
        tags = {"namespace": self.context.namespace, "trainingjob": self.context.name}
        run = self._client.create_run(
            experiment_id, run_name=self.settings.run_name or self.context.run_name, tags=tags
        )
        return str(run.info.run_id)

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        stamp = int(wall_time * 1000)
        batch = [self._entities.Metric(k, v, stamp, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def finish(self, report: Path | None, finished: bool) -> None:
        if report is not None:
            self._client.log_artifact(self.run_id, str(report))
        self._client.set_terminated(
            self.run_id, "FINISHED" if finished else "KILLED", int(time.time() * 1000)
        )


def plan_text(job: api_spec.TrainingJobSpec) -> str:
    """``meshtrain plan``'s report of the job on its default profile (or why there is none)."""
    profile = "cpu" if job.training.precision == "fp32" else "h100-sxm"  # as `meshtrain plan`
    try:
        return plan_report.to_text(estimate.make_plan(job, profiles.get(profile)))
    except (ValueError, KeyError, OSError) as err:
        return f"meshtrain plan could not plan this job: {err}\n"
