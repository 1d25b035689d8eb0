"""The large-batch warning: a global batch far above the measured gradient noise scale.

Beyond the noise scale ``B_noise`` a larger batch buys little progress per step (McCandlish et
al., 2018), so a global batch many times the measured ``B_noise`` spends GPUs (or accumulation)
for almost nothing: the condition ``BatchAboveNoiseScale`` says so, with the numbers.  Pure.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.operator.policy import conditions
from meshtrain.planner import estimate

FAR_ABOVE = estimate.NOISE_SCALE_FAR_ABOVE
"""A global batch this many times the noise scale is "far above" it (the planner's threshold too)."""

BACK_BELOW = 0.8 * FAR_ABOVE
"""A True condition turns False only below this ratio, so an estimate near the threshold does not flap."""

WARMUP_STEPS = 20
"""Steps before the estimate is judged: its first few steps' running averages are noise themselves."""


def changes(
    current: Sequence[Mapping[str, Any]],
    global_batch: int,
    noise_scale: float | None,
    step: int | None,
    now: datetime.datetime,
) -> tuple[list[dict[str, Any]], str | None]:
    """The conditions with ``BatchAboveNoiseScale`` judged, and a warning to emit when it turns True."""
    conds = [dict(c) for c in current]
    if noise_scale is None or noise_scale <= 0 or step is None or step < WARMUP_STEPS:
        return conds, None
    ratio = global_batch / noise_scale
    before = conditions.find(conds, conditions.BATCH_ABOVE_NOISE_SCALE) or {}
    far = before.get("status") == conditions.TRUE
    if ratio > FAR_ABOVE or (far and ratio >= BACK_BELOW):
        message = (
            f"global batch {global_batch} is {ratio:.0f}x the measured gradient noise scale "
            f"{noise_scale:.3g} sequences: beyond it a larger batch buys little per step "
            f"(McCandlish et al. 2018); fewer data-parallel replicas or less accumulation would "
            f"train about as fast per step at a fraction of the GPUs"
        )
        conds = conditions.set(
            conds,
            conditions.BATCH_ABOVE_NOISE_SCALE,
            conditions.TRUE,
            conditions.GLOBAL_BATCH_FAR_ABOVE_NOISE_SCALE,
            message,
            now,
        )
        return conds, message if before.get("status") != conditions.TRUE else None
    message = (
        f"global batch {global_batch} is {ratio:.2g}x the measured gradient noise scale "
        f"{noise_scale:.3g} sequences"
    )
    conds = conditions.set(
        conds,
        conditions.BATCH_ABOVE_NOISE_SCALE,
        conditions.FALSE,
        conditions.GLOBAL_BATCH_NEAR_NOISE_SCALE,
        message,
        now,
    )
    return conds, None
