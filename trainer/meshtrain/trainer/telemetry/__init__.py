"""Trainer observability: what a step cost, where the time went, and how it is shown.

The engine's one recording interface (:mod:`.recording`, timed by
:mod:`.clocks`) and the recorder that summarises every step
(:mod:`.recorder`; :mod:`.stepstats`: measured vs theoretical pipeline
bubble, exposed communication, bus bandwidth, MFU), a per-rank Prometheus
exporter with the ``/progress`` endpoint of rank 0 (:mod:`.exporter`), the
step log and event trace (:mod:`.steplog`) and the pipeline timeline picture
(:mod:`.timeline`, ``meshtrain timeline``).  The trainer builds it in one
place with :func:`.recorder.make_recorder`.

Not a timer wrapped around the engine.  The engine reports events;
nothing here patches it.  See docs/telemetry.md.
"""
