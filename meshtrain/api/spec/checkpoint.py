"""``spec.checkpoint``: where and how often training state is saved (resume is automatic)."""

from __future__ import annotations

import re

from pydantic import Field

from meshtrain.api import limits
from meshtrain.api.spec import base, kube_names, urls


class InMemoryCheckpoint(base.SpecModel):
    """Snapshots of every rank's training state in the pod's memory (``/dev/shm``) and a peer's.

    A process or node failure restores from them when every rank's copy survives somewhere,
    else from storage (docs/checkpoints.md, "In-memory checkpoints").
    """

    interval_steps: int = Field(
        0,
        ge=0,
        le=limits.MAX_STEPS,
        description="Copy every rank's training state to host memory every N optimizer steps "
        "(0: off). The copies count against resources.shmSize and resources.memory.",
    )
    peer: bool = Field(
        True,
        description="Also keep each rank's copy on its buddy rank in the next pod, so that losing "
        "one node loses no shard (jobs of one pod have no peer).",
    )


class Checkpoint(base.SpecModel):
    """Where and how often training state is saved; resume is automatic."""

    path: str = Field(
        "/checkpoints",
        min_length=1,
        description="Directory for checkpoints inside the pod (or on this machine for meshtrain run), "
        "or an s3://bucket/prefix of spec.objectStorage.",
    )
    claim_name: kube_names.ClaimName | None = Field(
        None,
        description="PersistentVolumeClaim mounted at path; empty uses an emptyDir (lost with the pod).",
    )
    interval_steps: int = Field(
        100,
        ge=0,
        le=limits.MAX_STEPS,
        description="Save every N optimizer steps (0: only at the end).",
    )
    keep: int = Field(
        3,
        ge=1,
        le=limits.MAX_COUNT,
        description="Complete checkpoints to keep; older ones are pruned.",
    )
    async_save: bool = Field(
        True,
        description="Write a due checkpoint in the background while training goes on (the step waits only "
        "for the copy of the state to host memory); false writes it before the next step.",
    )
    in_memory: InMemoryCheckpoint = Field(
        default_factory=InMemoryCheckpoint,
        description="In-memory checkpoints: fast restores after a process or node failure; "
        "storage checkpoints (intervalSteps) can then be rarer.",
    )


CHECKPOINT_PATH = r"^(/[^/\x00-\x1f\x7f]+)+/?$"
"""An absolute path below ``/``: no empty segment (``//``) and no control character."""
DOT_SEGMENT = r"/\.\.?(/|$)"
"""A ``.`` or ``..`` segment: the path is not normalised, or climbs out of its directory."""
PATH_MESSAGE = (
    "checkpoint.path must be an absolute, normalised directory below /, without '.' or '..' "
    "segments, '//' or control characters, e.g. /checkpoints, or an s3://bucket/prefix URL"
)


def _path_normalised(checkpoint: Checkpoint) -> str | None:
    path = checkpoint.path
    shape = urls.PREFIX_PATTERN if urls.is_url(path) else CHECKPOINT_PATH
    if re.fullmatch(shape.strip("^$"), path) and not re.search(DOT_SEGMENT, path):
        return None
    return f"{PATH_MESSAGE}; got {base.quoted(path)}"


RULES: tuple[base.Rule[Checkpoint], ...] = (
    base.Rule(
        "checkpoint-path-normalised",
        "spec.checkpoint.path",
        f"(self.checkpoint.path.matches(r'{CHECKPOINT_PATH}') || "
        f"self.checkpoint.path.matches(r'{urls.PREFIX_PATTERN}')) && "
        f"!self.checkpoint.path.matches(r'{DOT_SEGMENT}')",
        PATH_MESSAGE,
        _path_normalised,
    ),
)
"""Rules on the checkpoint section alone."""
