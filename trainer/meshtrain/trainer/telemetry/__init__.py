"""Trainer observability: what a step cost, where its time went, and how it is shown.

The engine reports events to one interface (:mod:`.recording`, timed by :mod:`.clocks`) and is
never wrapped or patched; :func:`.recorder.make_recorder` builds the recorder that turns each
step into metrics, ``/progress``, the step log and the event trace (docs/telemetry.md).
"""
