"""A graceful stop: SIGTERM or SIGINT -> every rank stops after the same step, with a checkpoint of it.

Why: Kubernetes deletes a gang's pods when the job is suspended, its spec
changes or a node is drained; it sends SIGTERM (torchrun passes it on to the
ranks) and kills what is still running after the pods' grace period
(``runPolicy.terminationGracePeriodSeconds``, 60 s by default).  Killing at once would lose every step since the last checkpoint.
Locally, Ctrl-C on ``meshtrain run`` reaches every rank as SIGINT.

How: the signal only sets :attr:`StopRequest.requested`.  Ranks see a signal
at different moments, so the engine adds the flag to the step's loss
all-reduce over the whole world (:meth:`~meshtrain.trainer.engine.Engine.train_step`):
every rank reads the same sum and the run stops after the same step on all
of them, which is what a collective checkpoint needs.

A stopped rank exits with :data:`meshtrain.api.exitcodes.STOPPED` (143 = 128 +
SIGTERM), never 0: a pod stopped this way must not read as finished.  Not a
checkpoint policy (the worker saves) or a launcher's signal handling
(:mod:`meshtrain.trainer.launch`).
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
