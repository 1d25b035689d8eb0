"""What a run resumed at another global batch does to its learning rate (pure).

Under ``lrScaling: none`` the rates follow the batch ratio (Goyal et al. 2017, the checkpoint's
batch as the reference); a rate that goes up is ramped in at the slope of the run's own warmup,
one that goes down drops at once (docs/trainer.md, "Optimizer, clipping, precision").
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from meshtrain.api.spec import parallelism as api_parallelism
from meshtrain.api.spec import training as api_training


@dataclasses.dataclass(frozen=True)
class LrPlan:
    """The multiplier on the spec's learning rates, step by step, since the run resumed."""

    scale: float = 1.0
    """Multiplier once any ramp is over."""
    ramp_from: float = 1.0
    """Share of ``scale`` the ramp starts from (1: no ramp)."""
    start: int = 0
    """The step the run resumed after (the ramp's first step is ``start + 1``)."""
    steps: int = 0
    """Length of the ramp in steps (0: none)."""

    def multiplier(self, step: int) -> float:
        """What the rates of optimizer step ``step`` are multiplied by."""
        if self.steps <= 0 or step >= self.start + self.steps:
            return self.scale
        done = max(0, step - self.start) / self.steps
        return self.scale * (self.ramp_from + (1.0 - self.ramp_from) * done)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """A run resumed at another batch, or mid-ramp: the plan, a step-log record and a sentence."""

    plan: LrPlan
    record: dict[str, Any]
    message: str


def saved_record(
    training: api_training.Training, par: api_parallelism.Parallelism, plan: LrPlan, step: int
) -> dict[str, Any]:
    """What a checkpoint taken after ``step`` keeps of the batch and the learning-rate multiplier."""
    batch = training.effective_global_batch(par)
    return {
        "global_batch": batch,
        "data": par.data,
        "micro_batches": par.micro_batches,
        "lr_factor": training.lr_scaling.factor(batch),
        "lr_scale": plan.scale,
        "lr_now": plan.multiplier(step),
    }


def on_resume(
    training: api_training.Training,
    par: api_parallelism.Parallelism,
    saved: Mapping[str, Any] | None,
    step: int,
) -> Resumed | None:
    """The plan of a run restoring a checkpoint of ``step`` (None: same batch, nothing to ramp,
    or a checkpoint that recorded no batch)."""
    if not saved:
        return None
    before, after = int(saved["global_batch"]), training.effective_global_batch(par)
    scale = float(saved["lr_scale"]) * training.lr_scaling.carried_scale(before, after)
    was = float(saved["lr_factor"]) * float(saved["lr_now"])  # relative to learningRate
    will = training.lr_scaling.factor(after) * scale
    ramp_from = was / will if will > 0 else 1.0
    steps = (
        math.ceil(round(training.warmup_steps * (1.0 - ramp_from), 9))
        if ramp_from < 1.0 - 1e-9 and training.warmup_steps > 0
        else 0
    )
    plan = LrPlan(scale, ramp_from if steps else 1.0, step, steps)
    if before == after and int(saved["data"]) == par.data and not steps:
        return None
    peak = training.learning_rate
    head = (
        f"resumed step {step} at data-parallel degree {par.data} (checkpoint: {saved['data']}), "
        f"microBatches {saved['micro_batches']} -> {par.micro_batches}"
    )
    if before == after and int(saved["data"]) == par.data:
        head, batch = f"resumed step {step} during a learning-rate ramp", f"global batch {after}"
    elif before == after:
        batch = f"global batch kept at {after}"
    else:
        rule = training.lr_scaling.rule
        why = (
            "the batch ratio (training.lrScaling none)"
            if rule == "none"
            else f"training.lrScaling {rule}"
        )
        batch = f"global batch {before} -> {after}; learning rate follows {why}"
    rates = f"peak learning rate {peak * was:.4g} -> {peak * will:.4g}"
    if steps:
        rates += f", ramped linearly over steps {step + 1}..{step + steps}"
    record = {
        "from_global_batch": before,
        "global_batch": after,
        "from_data": int(saved["data"]),
        "data": par.data,
        "micro_batches": par.micro_batches,
        "lr_scale": scale,
        "ramp_steps": steps,
        "peak_learning_rate": peak * will,
    }
    return Resumed(plan, record, f"{head}: {batch}; {rates}")
