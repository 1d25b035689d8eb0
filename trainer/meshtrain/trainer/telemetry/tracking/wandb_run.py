"""Weights & Biases through ``wandb``: a run per attempt, grouped by job, the spec as config.

The key (WANDB_API_KEY), server (WANDB_BASE_URL) and the rest come from the environment, as
W&B documents them; the spec says project, entity and mode.  Each attempt (the first start and
every resume) is a run of its own in the job's group (``group=``, stored beside the
checkpoints), named ``<run name> attempt <n>``: resuming one run would keep the crashed
attempt's values of the steps the resume trains again (W&B drops steps below its current one),
and offline mode ignores resuming.  Files (offline runs, for ``wandb sync``) go to
``<checkpoint dir>/tracking/wandb``.
"""

from __future__ import annotations

import importlib
import os
import uuid
from pathlib import Path
from typing import Any

from meshtrain.api.spec import tracking as api_tracking
from meshtrain.trainer.telemetry.tracking import backend

DEFAULT_PROJECT = "meshtrain"
"""The project when neither the spec nor WANDB_PROJECT names one."""
JOB_TYPE = "train"
"""Every attempt's ``job_type``."""
INIT_SECONDS = 60.0
"""How long ``wandb.init`` may take to reach the server."""


class WandbRun:
    """This attempt's W&B run."""

    name = "wandb"

    def __init__(self, settings: api_tracking.WandB, context: backend.Context) -> None:
        self.settings = settings
        self.context = context
        self._run: Any = None

    def start(self) -> None:
        wandb = importlib.import_module("wandb")
        stored = self.context.stored_id(self.name)
        group = stored.get("group") or f"{self.context.run_name}-{uuid.uuid4().hex[:8]}"
        count = stored.get("attempts", "")
        attempt = int(count) + 1 if count.isdigit() else 1
        folder = self.context.tracking_dir()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=self.settings.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            entity=self.settings.entity or None,
            mode=self.settings.mode,
            id=uuid.uuid4().hex[:16],
            group=group,
            job_type=JOB_TYPE,
            name=f"{self.context.run_name} attempt {attempt}",
            dir=str(folder) if folder is not None else None,
            config=self.context.spec_document(),
            tags=[f"namespace:{self.context.namespace}", f"trainingjob:{self.context.name}"],
            settings=wandb.Settings(console="off", silent=True, init_timeout=INIT_SECONDS),
        )
        self.context.store_id(
            self.name,
            {
                "group": group,
                "attempts": str(attempt),
                "run_id": str(self._run.id),
                "run_dir": str(Path(self._run.dir).parent),
            },
        )

    def log(self, step: int, values: dict[str, float], wall_time: float) -> None:
        self._run.log(values, step=step)

    def finish(self, report: Path | None, finished: bool) -> None:
        self._run.finish(exit_code=0 if finished else 1)
