"""The planner: what a TrainingJob will need and do, predicted before it runs.

``meshtrain plan JOB.yaml`` reports parameters, memory per GPU by component, bytes per process
group, step time, pipeline bubble, the computation-to-communication ratio, the batch against a
critical batch size and, given nodes, the operator's placement.  docs/planner.md lists the
modules.  The trainer's telemetry measures what this predicts; tests hold the two together.
"""
