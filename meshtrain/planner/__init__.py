"""The planner: what a TrainingJob will need and do, predicted before it runs.

``meshtrain plan JOB.yaml`` (see docs/planner.md) reports parameters, memory
per GPU by component with headroom, bytes per process group per step,
predicted step time, pipeline bubble, the computation-to-communication
ratio, the global batch against a critical batch size and, given nodes, the
placement the operator would make.

docs/planner.md lists the modules and what each holds.  Not a measurement;
the trainer's telemetry measures, and tests hold the two against each other.
"""
