"""``spec.checkpoint``: where and how often training state is saved (resume is automatic)."""

from __future__ import annotations

from pydantic import Field

from meshtrain.api.spec import base


class Checkpoint(base.SpecModel):
    """Where and how often training state is saved; resume is automatic."""

    path: str = Field(
        "/checkpoints",
        min_length=1,
        description="Directory for checkpoints inside the pod (or on this machine for meshtrain run).",
    )
    claim_name: str | None = Field(
        None,
        description="PersistentVolumeClaim mounted at path; empty uses an emptyDir (lost with the pod).",
    )
    interval_steps: int = Field(
        100, ge=0, description="Save every N optimizer steps (0: only at the end)."
    )
    keep: int = Field(3, ge=1, description="Complete checkpoints to keep; older ones are pruned.")
    async_save: bool = Field(
        True,
        description="Write a due checkpoint in the background while training goes on (the step waits only "
        "for the copy of the state to host memory); false writes it before the next step.",
    )
