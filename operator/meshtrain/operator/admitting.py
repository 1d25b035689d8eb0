"""The device profile each job's memory admission judges it by, as one operator process resolves it.

A waiting job is placed again on every node change, so each GPU label set is resolved to a
profile (its file read) once and remembered.  Not policy, since it remembers across passes and
reads files; not ``cluster``, since it talks to no API server.  The verdicts are computed with the
plan, in the planning worker.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import memory_admission
from meshtrain.planner import admission, profiles

logger = logging.getLogger("meshtrain.operator")


class Admissions:
    """Profiles by GPU label set; ``default`` judges jobs whose nodes name no known GPU."""

    def __init__(self, default: profiles.Profile | None) -> None:
        self._default = default
        self._products: dict[tuple[str, ...], admission.NodeProfile | None] = {}
        """GPU resource, product and memory label values -> profile."""

    def _profile_of(self, labels: Mapping[str, str], resource: str) -> admission.NodeProfile | None:
        product = labels.get(admission.PRODUCT_LABEL, "")
        memory = (labels.get(admission.MEMORY_LABEL, ""), labels.get(f"{resource}.memory", ""))
        key = (resource, product, *memory)
        if key not in self._products:
            try:
                self._products[key] = admission.node_profile(labels, self._default, resource)
            except profiles.ProfileError as err:  # a file broken since start: not judged by it
                logger.warning(
                    "GPU profile of %s=%s unavailable: %s", admission.PRODUCT_LABEL, product, err
                )
                self._products[key] = None
        return self._products[key]

    def choice(
        self, spec: api_spec.TrainingJobSpec, nodes: Sequence[placement.Node]
    ) -> memory_admission.Choice:
        """The profile ``spec`` is judged by on its candidate nodes (see ``memory_admission``);
        the verdicts themselves are the planning worker's (``placement_outcome.plan_sizes``)."""
        candidates = memory_admission.candidates(spec, list(nodes))
        return memory_admission.choose_profile(
            [
                (n.name, self._profile_of(n.labels, spec.resources.gpu_resource_name))
                for n in candidates
            ],
            self._default,
        )
