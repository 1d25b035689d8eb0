"""The memory admission verdicts of one operator process, remembered per job.

A waiting job is placed again on every node change, so its verdict is kept until what it
depends on changes (UID, generation, spec, chosen profile), and each GPU label set is resolved
to a profile (its file read) once.  Not policy, since it remembers across passes and reads
files; not ``cluster``, since it talks to no API server.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain import placement
from meshtrain.operator.policy import identity, job_state, memory_admission
from meshtrain.planner import admission, profiles

logger = logging.getLogger("meshtrain.operator")

Verdict = memory_admission.Admitted | memory_admission.Refused | None


class Admissions:
    """Verdicts per job (namespace, name); ``default`` judges jobs whose nodes name no known GPU."""

    def __init__(self, default: profiles.Profile | None) -> None:
        self._default = default
        self._products: dict[tuple[str, ...], admission.NodeProfile | None] = {}
        """GPU resource, product and memory label values -> profile."""
        self._verdicts: dict[tuple[str, str], tuple[Any, Verdict]] = {}

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

    def admit(self, job: job_state.JobState, nodes: Sequence[placement.Node]) -> Verdict:
        """Admission by plan on the profile of the job's candidate nodes (see ``memory_admission``)."""
        assert job.spec is not None
        candidates = memory_admission.candidates(job.spec, list(nodes))
        choice = memory_admission.choose_profile(
            [
                (n.name, self._profile_of(n.labels, job.spec.resources.gpu_resource_name))
                for n in candidates
            ],
            self._default,
        )
        key = (job.ref.uid, job.generation, choice, identity.spec_hash(job.spec))
        cached = self._verdicts.get((job.ref.namespace, job.ref.name))
        if cached is not None and cached[0] == key:
            return cached[1]
        verdict = memory_admission.admit(job.spec, choice)
        self._verdicts[(job.ref.namespace, job.ref.name)] = (key, verdict)
        return verdict

    def forget(self, namespace: str, name: str) -> None:
        self._verdicts.pop((namespace, name), None)
