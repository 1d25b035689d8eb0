"""The gradient noise scale (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

``B_noise = tr(Sigma) / |G|^2``, in sequences: the batch size at which a gradient estimate's noise
is as large as the gradient itself; well beyond it, more data parallelism buys little.  Data
parallelism measures it for free: each replica's gradient is a small-batch estimate and the
all-reduced one a large-batch estimate (:func:`estimate`).
"""

from __future__ import annotations

import dataclasses
import math

SMOOTHING = 0.05
"""Weight of a new step in the moving averages (an effective window of about 20 steps)."""


@dataclasses.dataclass(frozen=True)
class Estimate:
    """One step's unbiased estimates."""

    gradient_square: float
    """|G|^2: squared norm of the true gradient."""
    trace: float
    """S = tr(Sigma): per-sequence gradient noise."""


def estimate(small_square: float, large_square: float, small: int, large: int) -> Estimate:
    """The unbiased |G|^2 and S from squared norms of a ``small``- and a ``large``-batch gradient.

    Data parallelism gives both: each replica's gradient before the all-reduce is the small
    batch (``b = microBatch x microBatches`` sequences), the all-reduced one the large batch
    (``B = b x data``).  From their squared norms (the paper's appendix A.1)::

        |G|^2 = (B |G_B|^2 - b |G_b|^2) / (B - b)
        S     = (|G_b|^2 - |G_B|^2) / (1/b - 1/B)
    """
    if not 0 < small < large:
        raise ValueError(f"need 0 < small batch < large batch, got {small} and {large}")
    gradient_square = (large * large_square - small * small_square) / (large - small)
    trace = (small_square - large_square) / (1.0 / small - 1.0 / large)
    return Estimate(gradient_square, trace)


class Tracker:
    """Moving averages of |G|^2 and S over steps; :attr:`value` is their ratio.

    Each step's estimates are noisy, so, as the paper does, both are averaged over steps and the
    noise scale is the ratio of the averages.
    """

    def __init__(self, small: int, large: int, smoothing: float = SMOOTHING) -> None:
        self.small, self.large, self.smoothing = small, large, smoothing
        self._gradient_square: float | None = None
        self._trace: float | None = None

    def update(self, small_square: float, large_square: float) -> float | None:
        """Add one step (``small_square`` the mean over replicas); returns the current noise scale."""
        if not (math.isfinite(small_square) and math.isfinite(large_square)):
            return self.value  # a step the loss guard skips says nothing about the noise
        step = estimate(small_square, large_square, self.small, self.large)
        if self._gradient_square is None or self._trace is None:
            self._gradient_square, self._trace = step.gradient_square, step.trace
        else:
            a = self.smoothing
            self._gradient_square += a * (step.gradient_square - self._gradient_square)
            self._trace += a * (step.trace - self._trace)
        return self.value

    @property
    def gradient_square(self) -> float | None:
        """Moving average of |G|^2 (None before the first step)."""
        return self._gradient_square

    @property
    def trace(self) -> float | None:
        """Moving average of S = tr(Sigma) (None before the first step)."""
        return self._trace

    @property
    def value(self) -> float | None:
        """The noise scale in sequences, or None while the averages give no positive ratio."""
        if self._gradient_square is None or self._trace is None or self._gradient_square <= 0:
            return None
        ratio = self._trace / self._gradient_square
        return ratio if ratio > 0 else None
