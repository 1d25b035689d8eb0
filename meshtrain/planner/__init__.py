"""The planner: what a TrainingJob will need and do, predicted before it runs.

``meshtrain plan JOB.yaml`` (see docs/planner.md) reports parameters, memory
per GPU by component with headroom, bytes per process group per step,
predicted step time, pipeline bubble, the computation-to-communication
ratio, the global batch against a critical batch size and, given nodes, the
placement the operator would make.

Modules, by meaning: ``profiles`` (device data files), ``memory``, ``comm``
and ``cost`` (the models, pure), ``estimate`` (runs them and the placement
planner into one :class:`~meshtrain.planner.estimate.Plan`), ``plan_report``
(text and the ``meshtrain.plan/v1`` JSON), ``admission`` (what the operator
calls: ``check``, ``status_summary``, ``profile_for_labels``), ``cluster``
(cluster YAML files), ``cluster_live`` (the only Kubernetes I/O) and
``placement_request`` (a spec as a placement request) and ``plan_command``
(the CLI glue).  Not a measurement; the trainer's
telemetry measures, and tests hold the two against each other.
"""
