"""MLflow tracking through ``MlflowClient`` (``mlflow-skinny``): a run per job, a nested run per attempt.

The job's run id is stored beside the checkpoints.  It gets the spec's layout, model and
training sections as params, the namespace and job as tags and ``meshtrain plan``'s report as
``plan.txt``.  Each attempt (the first start and every resume) gets a run of its own nested
under it (``mlflow.parentRunId``) with its steps' metrics, so steps a crashed attempt trained
past its checkpoint and the resume trained again are two clean series, never two values of one
step.  The end puts the run report (``meshtrain report``'s page) as ``report.html`` on both.
A stored run that was deleted, or lives on another server, is replaced by a new one.  The client's HTTP retries and timeout
are bounded (:data:`HTTP_ENV`) unless the environment sets them.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from meshtrain.api.spec import tracking as api_tracking
from meshtrain.planner import default_plan, estimate
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
PARENT_TAG = "mlflow.parentRunId"
"""MLflow's tag that nests a run under another (its UI groups an attempt under the job's run)."""
SQLITE_PREFIX = "sqlite:///"
"""How a ``sqlite:///`` store's URI starts (the database path follows)."""
SQLITE_ARTIFACTS = "mlartifacts"
"""The folder beside a sqlite database where its experiments' artifacts go."""
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
        self._errors: Any = None
        self.parent_id = ""
        """The job's run: params, ``plan.txt``, the latest report; every attempt's run nests under it."""
        self.run_id = ""
        """This attempt's run: its steps' metrics."""

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
        if uri is not None and uri.startswith(SQLITE_PREFIX):
            _require_database_store()
        self._entities = importlib.import_module("mlflow.entities")
        self._errors = importlib.import_module("mlflow.exceptions")
        client_module = importlib.import_module("mlflow.tracking")
        self._client = client_module.MlflowClient(tracking_uri=uri)
        stored = self.context.stored_id(self.name)
        if stored.get("tracking_uri", "") == (uri or "") and self._active(stored.get("run_id", "")):
            self.parent_id = stored["run_id"]
            self._client.update_run(self.parent_id, status="RUNNING")
            attempt = (
                int(stored.get("attempts", "1")) + 1 if stored.get("attempts", "").isdigit() else 2
            )
        else:  # a new job, or its run was deleted or lives on another server
            self.parent_id = self._create_run(self.settings.run_name or self.context.run_name, {})
            self._log_params(self.parent_id)
            self._client.log_text(self.parent_id, plan_text(self.context), PLAN_FILE)
            attempt = 1
        self.run_id = self._create_run(
            f"{self.settings.run_name or self.context.run_name} attempt {attempt}",
            {PARENT_TAG: self.parent_id, "attempt": str(attempt)},
        )
        self._log_params(self.run_id)
        self.context.store_id(
            self.name,
            {
                "run_id": self.parent_id,
                "tracking_uri": uri or "",
                "attempts": str(attempt),
                "attempt_run_id": self.run_id,
            },
        )

    def _active(self, run_id: str) -> bool:
        """Whether ``run_id`` is a live run on this server (not deleted, not someone else's)."""
        if not run_id:
            return False
        try:
            run = self._client.get_run(run_id)
        except self._errors.MlflowException:
            return False
        return str(run.info.lifecycle_stage) == "active"

    def _log_params(self, run_id: str) -> None:
        params = [self._entities.Param(k, v) for k, v in sorted(self.context.params().items())]
        for first in range(0, len(params), PARAMS_PER_BATCH):
            self._client.log_batch(run_id, params=params[first : first + PARAMS_PER_BATCH])

    def _create_run(self, run_name: str, extra_tags: dict[str, str]) -> str:
        experiment = (
            self.settings.experiment_name
            or os.environ.get("MLFLOW_EXPERIMENT_NAME")
            or DEFAULT_EXPERIMENT
        )
        found = self._client.get_experiment_by_name(experiment)
        experiment_id = (
            found.experiment_id
            if found is not None
            else self._client.create_experiment(
                experiment, artifact_location=artifact_location(self.tracking_uri())
            )
        )
        tags = {"namespace": self.context.namespace, "trainingjob": self.context.name, **extra_tags}
        run = self._client.create_run(experiment_id, run_name=run_name, tags=tags)
        return str(run.info.run_id)

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        stamp = int(wall_time * 1000)
        batch = [self._entities.Metric(k, v, stamp, step) for k, v in values.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def finish(self, report: Path | None, finished: bool) -> None:
        status = "FINISHED" if finished else "KILLED"
        for run_id in (self.run_id, self.parent_id):
            if report is not None:
                self._client.log_artifact(run_id, str(report))
            self._client.set_terminated(run_id, status, int(time.time() * 1000))


def plan_text(context: backend.Context) -> str:
    """``meshtrain plan``'s report of the job on the profile ``meshtrain plan`` picks for it: the
    device rank 0 sees, and for ``meshtrain run`` this host's cores (or why there is none)."""
    try:
        chosen = default_plan.profile(
            context.job,
            device_name=context.device_name,
            local_cores=(os.cpu_count() or 1) if context.local else None,
        )
        return plan_report.to_text(estimate.make_plan(context.job, chosen))
    except (ValueError, KeyError, OSError) as err:
        return f"meshtrain plan could not plan this job: {err}\n"


def artifact_location(uri: str | None) -> str | None:
    """Where a new experiment's artifacts go: beside a ``sqlite:///`` database, in
    :data:`SQLITE_ARTIFACTS` (MLflow's own default is ``./mlruns`` of whatever directory the
    trainer runs in); None: the server's or store's own default."""
    if uri is None or not uri.startswith(SQLITE_PREFIX):
        return None
    database = Path(uri[len(SQLITE_PREFIX) :]).absolute()
    return (database.parent / SQLITE_ARTIFACTS).as_uri()


def _require_database_store() -> None:
    """A ``sqlite:///`` store needs SQLAlchemy and Alembic, which ``mlflow-skinny`` leaves out."""
    for module in ("sqlalchemy", "alembic"):
        if importlib.util.find_spec(module) is None:
            raise RuntimeError(
                f"a sqlite:/// trackingUri needs {module}: pip install sqlalchemy alembic "
                "(or the full mlflow) where the trainer runs, or use an MLflow server (http://)"
            )
