"""Trainer observability: what a step cost, where the time went, and how it is shown.

A :class:`~meshtrain.trainer.parallel.recording.StepRecorder`
implementation (:mod:`.recorder`) that summarises every step
(:mod:`.stepstats`: measured vs theoretical pipeline bubble, exposed
communication, bus bandwidth, MFU), a per-rank Prometheus exporter with the
``/progress`` endpoint of rank 0 (:mod:`.exporter`), the step log and event
trace (:mod:`.steplog`) and the pipeline timeline picture (:mod:`.timeline`,
``meshtrain timeline``).  The trainer builds it in one place with
:func:`make_recorder`.

Not a timer wrapped around the engine.  The engine reports events;
nothing here patches it.  See docs/telemetry.md.
"""

from meshtrain.trainer.telemetry.recorder import TelemetryRecorder, make_recorder

__all__ = ["TelemetryRecorder", "make_recorder"]
