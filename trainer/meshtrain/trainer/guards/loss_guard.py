"""The loss guard: skip an optimizer update whose loss or gradient norm is bad, stop after K in a row.

Pure policy on the global loss and gradient norm every rank already agrees on, so all ranks decide
alike without a collective.  A skipped step keeps weights and optimizer state and still counts
(its batch is consumed), as Megatron-LM counts a skipped iteration.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
from typing import Any

from meshtrain.api.spec import training as api_training


class LossGuardTripped(RuntimeError):
    """``maxConsecutiveSkips`` updates in a row were skipped; the message says why."""


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The guard's decision on one step."""

    skip: bool
    """Do not apply this step's update."""
    reason: str = ""
    """Why (empty when the step is applied)."""


class LossGuard:
    """Decides, step by step, whether an update is applied."""

    def __init__(self, *, spike_factor: float, window: int, max_consecutive_skips: int) -> None:
        self.spike_factor = spike_factor
        """0 disables the spike test (non-finite values are always skipped)."""
        self.max_consecutive_skips = max_consecutive_skips
        self.recent: collections.deque[float] = collections.deque(maxlen=window)
        """Losses of the last accepted steps."""
        self.skipped_total = 0
        """Steps skipped by this process so far."""
        self.consecutive = 0
        """Skips in a row, up to the current step."""

    @classmethod
    def from_spec(cls, guard: api_training.LossGuard) -> LossGuard:
        return cls(
            spike_factor=guard.spike_factor,
            window=guard.window,
            max_consecutive_skips=guard.max_consecutive_skips,
        )

    def judge(self, loss: float, grad_norm: float) -> Verdict:
        """The verdict on a step; raises :class:`LossGuardTripped` at the K-th skip in a row.

        Skipped: a loss or gradient norm that is not finite, or a loss above ``spikeFactor`` x
        the median of the last ``window`` accepted losses (once ``window`` of them exist).
        """
        verdict = self._verdict(loss, grad_norm)
        if not verdict.skip:
            self.consecutive = 0
            self.recent.append(loss)
            return verdict
        self.skipped_total += 1
        self.consecutive += 1
        if self.max_consecutive_skips and self.consecutive >= self.max_consecutive_skips:
            raise LossGuardTripped(
                f"training.lossGuard: {self.consecutive} consecutive updates skipped "
                f"(maxConsecutiveSkips={self.max_consecutive_skips}); last: {verdict.reason}"
            )
        return verdict

    def _verdict(self, loss: float, grad_norm: float) -> Verdict:
        if not math.isfinite(loss):
            return Verdict(True, f"loss is {loss}")
        if not math.isfinite(grad_norm):
            return Verdict(True, f"gradient norm is {grad_norm}")
        if self.spike_factor and len(self.recent) == self.recent.maxlen:
            median = statistics.median(self.recent)
            if loss > self.spike_factor * median:
                return Verdict(
                    True,
                    f"loss {loss:.4g} > spikeFactor {self.spike_factor} x median {median:.4g} "
                    f"of the last {len(self.recent)} steps",
                )
        return Verdict(False)

    def state_dict(self) -> dict[str, Any]:
        """For checkpoints: the window and the counters."""
        return {
            "recent": list(self.recent),
            "skipped_total": self.skipped_total,
            "consecutive": self.consecutive,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.recent.clear()
        self.recent.extend(state.get("recent", []))
        self.skipped_total = int(state.get("skipped_total", 0))
        self.consecutive = int(state.get("consecutive", 0))
