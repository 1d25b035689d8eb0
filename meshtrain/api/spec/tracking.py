"""``spec.tracking``: experiment trackers rank 0 logs each step to (TensorBoard, MLflow, W&B).

A sub-section present turns its tracker on (``tensorboard: {}`` writes to the default folder).
Credentials never go here: MLflow's and W&B's clients read them from the environment
(``spec.pod.env`` from a Secret), so only where to log and under which names is in the spec.
A tracker that fails warns once and the training goes on (docs/tracking.md).
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, field_validator

from meshtrain.api import limits
from meshtrain.api.spec import base

_SEGMENT = r"([^/.\x00-\x1f\x7f][^/\x00-\x1f\x7f]*|\.[^/.\x00-\x1f\x7f][^/\x00-\x1f\x7f]*|\.\.[^/\x00-\x1f\x7f]+)"
LOG_DIR = rf"^/?{_SEGMENT}(/{_SEGMENT})*/?$"
"""A normalised directory, absolute or relative (``meshtrain run``: to the working directory; in a
pod: to the job's checkpoint directory): no empty, ``.`` or ``..`` segment, no control character."""
TRACKING_URI = (
    r"^(https?://([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\])(:[0-9]{1,5})?(/[^\x00-\x20\x7f]*)?"
    r"|file:(//)?/[^\x00-\x20\x7f]*|sqlite:///[^\x00-\x20\x7f]+)$"
)
"""``http(s)://host[:port][/path]`` (no user or password: credentials come from the environment),
``file:///absolute/path`` or ``sqlite:///path.db`` (MLflow's recommended local store)."""
NAME = r"^[^\x00-\x1f\x7f]+$"
"""An experiment or run name: any printable text."""
WANDB_PROJECT = r"^[^/\\#?%:\x00-\x1f\x7f]+$"
"""A W&B project name: no ``/ \\ # ? % :`` (W&B refuses them)."""
WANDB_ENTITY = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
"""A W&B user or team name."""


def _matching(value: str | None, pattern: str, fix: str) -> str | None:
    """``value`` when it matches ``pattern`` (None passes), else a ValueError naming the fix."""
    if value is not None and not re.fullmatch(pattern.strip("^$"), value):
        raise ValueError(f"{fix} (got {base.quoted(value)})")
    return value


class TensorBoard(base.SpecModel):
    """TensorBoard event files (one scalar series per steps.jsonl field)."""

    log_dir: str | None = Field(
        None,
        max_length=limits.MAX_STRING_LENGTH,
        json_schema_extra={"pattern": LOG_DIR},
        description="Directory of the event files inside the pod (or on this machine for meshtrain "
        "run); a relative one is taken from the job's checkpoint directory in a pod and from the "
        "working directory for meshtrain run; empty: tensorboard/ in the job's checkpoint "
        "directory, so they outlive the pod and a resumed job adds to the same run.",
    )

    @field_validator("log_dir")
    @classmethod
    def _log_dir_absolute(cls, value: str | None) -> str | None:
        return _matching(
            value,
            LOG_DIR,
            "logDir must be a normalised directory (absolute, or relative to the checkpoint or "
            "working directory) without '.' or '..' segments, '//' or control characters, e.g. "
            "/checkpoints/tensorboard or tensorboard/lr-3e-4",
        )


class MLflow(base.SpecModel):
    """An MLflow tracking server: one run per job, its params, metrics, plan and report."""

    tracking_uri: str | None = Field(
        None,
        max_length=limits.MAX_URL_LENGTH,
        json_schema_extra={"pattern": TRACKING_URI},
        description="The tracking server, e.g. http://mlflow.mlflow:5000 (or file:///path, or "
        "sqlite:///path.db: MLflow's local database store); empty: "
        "MLFLOW_TRACKING_URI of the environment. Credentials (MLFLOW_TRACKING_USERNAME, "
        "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN) come from spec.pod.env, never the URI.",
    )
    experiment_name: str | None = Field(
        None,
        max_length=limits.MAX_TRACKER_NAME_LENGTH,
        json_schema_extra={"pattern": NAME},
        description="Experiment the run goes to (created if missing); empty: MLFLOW_EXPERIMENT_NAME, "
        "else meshtrain.",
    )
    run_name: str | None = Field(
        None,
        max_length=limits.MAX_TRACKER_NAME_LENGTH,
        json_schema_extra={"pattern": NAME},
        description="Name of the job's run; empty: <namespace>/<job name>.",
    )

    @field_validator("tracking_uri")
    @classmethod
    def _uri_shape(cls, value: str | None) -> str | None:
        return _matching(
            value,
            TRACKING_URI,
            "trackingUri must be an http://, https:// or file:/// URL without user or password, or "
            "sqlite:///path.db, e.g. http://mlflow.mlflow:5000 (credentials go in spec.pod.env "
            "from a Secret)",
        )

    @field_validator("experiment_name", "run_name")
    @classmethod
    def _printable(cls, value: str | None) -> str | None:
        return _matching(value, NAME, "use printable text without control characters")


class WandB(base.SpecModel):
    """Weights & Biases: one run per job, the spec as its config, metrics per step."""

    project: str | None = Field(
        None,
        max_length=limits.MAX_WANDB_PROJECT_LENGTH,
        json_schema_extra={"pattern": WANDB_PROJECT},
        description="W&B project; empty: WANDB_PROJECT of the environment, else meshtrain.",
    )
    entity: str | None = Field(
        None,
        max_length=limits.MAX_WANDB_ENTITY_LENGTH,
        json_schema_extra={"pattern": WANDB_ENTITY},
        description="W&B user or team; empty: WANDB_ENTITY of the environment, else the API key's "
        "default entity. The key itself (WANDB_API_KEY) comes from spec.pod.env from a Secret.",
    )
    mode: Literal["online", "offline"] = Field(
        "online",
        description="online: send to the W&B server (WANDB_BASE_URL, default wandb.ai); offline: "
        "write the run under the job's checkpoint directory for a later `wandb sync`.",
    )

    @field_validator("project")
    @classmethod
    def _project_shape(cls, value: str | None) -> str | None:
        return _matching(
            value, WANDB_PROJECT, "a W&B project name has no / \\ # ? % : or control characters"
        )

    @field_validator("entity")
    @classmethod
    def _entity_shape(cls, value: str | None) -> str | None:
        return _matching(
            value,
            WANDB_ENTITY,
            "a W&B entity is a user or team name: letters, digits, '_', '-' and '.'",
        )


class Tracking(base.SpecModel):
    """Experiment trackers; each sub-section present is on. Only global rank 0 logs."""

    tensorboard: TensorBoard | None = Field(
        None, description="TensorBoard event files; {} writes them to the default directory."
    )
    mlflow: MLflow | None = Field(
        None,
        description="MLflow tracking: params (the spec), metrics per step, the plan and the run "
        "report as artifacts.",
    )
    wandb: WandB | None = Field(
        None, description="Weights & Biases: the spec as config, metrics per step."
    )
