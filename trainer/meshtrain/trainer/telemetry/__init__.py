"""Trainer observability: what a step cost, where the time went, and how it is shown.

A :class:`~meshtrain.trainer.telemetry.recording.StepRecorder`
implementation (:mod:`.recorder`) that summarises every step
(:mod:`.stepstats`: measured vs theoretical pipeline bubble, exposed
communication, bus bandwidth, MFU), a per-rank Prometheus exporter with the
``/progress`` endpoint of rank 0 (:mod:`.exporter`), the step log and event
trace (:mod:`.steplog`) and the pipeline timeline picture (:mod:`.timeline`,
``meshtrain timeline``).  The trainer builds it in one place with
:func:`.recorder.make_recorder`.

Not a timer wrapped around the engine.  The engine reports events;
nothing here patches it.  See docs/telemetry.md.
"""
