"""Experiment trackers (``spec.tracking``): TensorBoard, MLflow and Weights & Biases.

Global rank 0 hands each steps.jsonl record to every tracker the spec turns on (:mod:`.log`);
each runs on a thread of its own (:mod:`.runner`), so a slow or dead server never holds a step,
and a tracker that fails warns once and is off for the rest of the run (docs/tracking.md).
The backends' packages (the ``tracking`` extra) are imported on those threads, when used.
"""
