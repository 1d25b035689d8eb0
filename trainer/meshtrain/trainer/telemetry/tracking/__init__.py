"""Experiment trackers (``spec.tracking``): TensorBoard, MLflow and Weights & Biases.

Global rank 0 sends each steps.jsonl record (:mod:`.log`) to a process of the trackers' own
(:mod:`.child`), where each tracker runs on a thread (:mod:`.runner`): a slow or dead server never
holds a step, and a tracker that fails warns once and is off for the rest of the run.  The
backends' packages (the ``tracking`` extra) are imported there, when used (docs/tracking.md).
"""
