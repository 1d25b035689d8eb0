"""A graceful stop: SIGTERM or SIGINT -> every rank stops after the same step, with a checkpoint of it.

Kubernetes sends SIGTERM when it deletes a gang's pods (suspend, spec change, drain) and kills them
after the grace period; stopping at once would lose every step since the last checkpoint.  The
signal only sets a flag, which the step's world all-reduce sums, so every rank stops after the same
step (:meth:`~meshtrain.trainer.engine.Engine.train_step`).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

SIGNALS = (signal.SIGTERM, signal.SIGINT)
"""Signals that ask for a graceful stop."""


class StopRequest:
    """Set by SIGTERM or SIGINT once :meth:`install` ran; read at every step."""

    def __init__(self) -> None:
        self.requested = False
        """A stop signal arrived."""
        self.signal_name: str | None = None
        """Name of the first stop signal (for the log line)."""

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    def install(self) -> StopRequest:
        """Handle the stop signals in this process (main thread only; elsewhere a no-op)."""
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                signal.signal(signum, self._on_signal)
        return self
