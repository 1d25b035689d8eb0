"""The condition ``CheckpointsNotPersistent``: checkpoints on an emptyDir, lost with the pods.

True with the fix in its message while the spec keeps checkpoints only in the pods
(:func:`meshtrain.api.persistence.warning`: any claimless job whose ``checkpoint.path`` is not
``s3://``, since suspend, preemption, re-placement and drains restart it whatever its run policy);
False once it no longer does; never added to a job that never needed it.  Pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import persistence
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import conditions


def changes(
    current: Sequence[Mapping[str, Any]], spec: api_spec.TrainingJobSpec, now: datetime.datetime
) -> tuple[list[dict[str, Any]], str | None]:
    """The conditions with ``CheckpointsNotPersistent`` judged, and a warning to emit when it turns True."""
    conds = [dict(c) for c in current]
    before = conditions.find(conds, conditions.CHECKPOINTS_NOT_PERSISTENT)
    message = persistence.warning(spec)
    if message is not None:
        conds = conditions.set(
            conds,
            conditions.CHECKPOINTS_NOT_PERSISTENT,
            conditions.TRUE,
            conditions.EMPTY_DIR_CHECKPOINTS,
            message,
            now,
        )
        turned = (before or {}).get("status") != conditions.TRUE
        return conds, message if turned else None
    if before is None:
        return conds, None
    conds = conditions.set(
        conds,
        conditions.CHECKPOINTS_NOT_PERSISTENT,
        conditions.FALSE,
        conditions.PERSISTENT_CHECKPOINTS,
        "checkpoints outlive the pods (checkpoint.claimName or an s3:// checkpoint.path)",
        now,
    )
    return conds, None
