"""The priority of a job's pods, as the reservation orders waiting jobs: :class:`Priorities`.

The value is derived as Kueue derives a Workload's from the pods (``workloads.priority_of``):
``spec.pod.priorityClassName``'s PriorityClass, else the cluster's globalDefault one, else 0.
Each class name is read at most once per :data:`TTL_SECONDS` (one GET, or one LIST of the few
PriorityClasses for the default), and no more than :data:`MAX_CLASSES` names are remembered.
"""

from __future__ import annotations

import logging
import time

from meshtrain.api import spec as api_spec
from meshtrain.operator.cluster import kube, workloads
from meshtrain.operator.policy import kueue_workload

logger = logging.getLogger("meshtrain.operator")

TTL_SECONDS = 60.0
"""A class's value is read again after this long (a PriorityClass's value is immutable; a
deleted and re-created one may differ)."""
MAX_CLASSES = 256
"""Class names remembered at most; beyond, the memory starts afresh."""
NO_QUEUE = kueue_workload.Queue("", None)
"""No LocalQueue and no WorkloadPriorityClass: the pods' class decides."""


class Priorities:
    """PriorityClass values by class name, read through ``client`` and remembered a while."""

    def __init__(self, client: kube.Client) -> None:
        self.client = client
        self._known: dict[str, tuple[int, float]] = {}
        """Class name ("" for none) -> (value, monotonic time it was read)."""

    async def of(self, spec: api_spec.TrainingJobSpec) -> int:
        """The priority of ``spec``'s pods (0 when the class is missing or cannot be read)."""
        name, now = spec.pod.priority_class_name or "", time.monotonic()
        known = self._known.get(name)
        if known is not None and now - known[1] < TTL_SECONDS:
            return known[0]
        try:
            found = await workloads.priority_of(self.client, NO_QUEUE, spec)
        except kube.ApiError as err:
            logger.info("priority class %r not read (HTTP %s): counted as 0", name, err.status)
            found = None
        value = found.value if isinstance(found, kueue_workload.Priority) else 0
        if len(self._known) >= MAX_CLASSES:
            self._known.clear()
        self._known[name] = (value, now)
        return value
