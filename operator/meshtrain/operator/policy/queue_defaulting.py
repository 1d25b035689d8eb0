"""Kueue for every TrainingJob: the LocalQueue a job that names none is put in.

With ``meshtrain operator --default-queue NAME`` (the chart's ``kueue.requireQueue: default``)
a job without the ``kueue.x-k8s.io/queue-name`` label is labelled with NAME before anything
places it: Kueue's LocalQueueDefaulting for its built-in jobs, which its webhooks cannot do for
TrainingJob.  From then on it is an ordinary queued job; a NAME the namespace has no LocalQueue
of keeps it ``Queued`` with Kueue's own reason, never placed around Kueue.  A job placed before
the requirement and never queued is left to run as it was admitted.  Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from meshtrain.operator.policy import job_state, kueue_workload

KUEUE_DEFAULT = "default"
"""The LocalQueue Kueue's own defaulting uses, and the chart's."""
DEFAULTED = "QueueDefaulted"
"""The Event reason of a job the operator labelled."""


def label_patch(body: Mapping[str, Any], default_queue: str | None) -> dict[str, Any] | None:
    """The metadata patch that queues ``body`` in ``default_queue``, or None when none is due.

    Guarded by the resourceVersion it was decided on: a job that changed meanwhile (placed,
    labelled by its owner) is decided again rather than labelled blind.
    """
    if not default_queue:
        return None
    metadata = body.get("metadata") or {}
    if (metadata.get("labels") or {}).get(kueue_workload.QUEUE_LABEL):
        return None
    status = body.get("status") or {}
    if status.get("phase") in job_state.FINAL:
        return None
    if status.get("placement") and not kueue_workload.was_queued(status):
        return None  # placed before the requirement, never queued: it runs as admitted
    return {
        "metadata": {
            "labels": {kueue_workload.QUEUE_LABEL: default_queue},
            "resourceVersion": metadata.get("resourceVersion"),
        }
    }


def message(default_queue: str) -> str:
    """The Event of a labelled job: what was set, why, and what the user may do instead."""
    return (
        f'metadata.labels["{kueue_workload.QUEUE_LABEL}"] set to "{default_queue}": this cluster '
        f"queues every TrainingJob in Kueue, and a job that names no LocalQueue goes to the "
        f'namespace\'s LocalQueue "{default_queue}"; set the label to choose another LocalQueue'
    )
