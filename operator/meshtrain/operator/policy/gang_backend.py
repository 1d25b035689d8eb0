"""Which scheduler binds a gang all or nothing, chosen per cluster (``--gang-backend``).

Every backend keeps the operator's own gang gate and node pinning; the backend decides who makes
the binding atomic once the gates are lifted: kube-scheduler's native Workload API
(``scheduling.k8s.io`` PodGroup, alpha), scheduler-plugins' Coscheduling plugin in a second
scheduler (``scheduling.x-k8s.io`` PodGroup), or nobody (``none``: half a gang can bind).
docs/operator.md, "Gang backends", says how to pick one.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Literal

from meshtrain.api import limits
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import builders, identity

Kind = Literal["auto", "native", "coscheduling", "volcano", "none"]
KINDS: tuple[Kind, ...] = ("auto", "native", "coscheduling", "volcano", "none")
"""The values of ``--gang-backend`` (chart value ``gang.backend``)."""
Resolved = Literal["native", "coscheduling", "none"]
"""What a backend comes to on one cluster (``auto``: native where it is served, else none)."""

NATIVE_API = "scheduling.k8s.io/v1alpha2"
COSCHEDULING_API = "scheduling.x-k8s.io/v1alpha1"
"""scheduler-plugins' PodGroup (its CRD must be installed)."""
COSCHEDULING_LABEL = "scheduling.x-k8s.io/pod-group"
"""The label that makes a pod a member of a scheduler-plugins PodGroup of its namespace."""
DEFAULT_SCHEDULER_NAME = "scheduler-plugins-scheduler"
"""The second scheduler's name in scheduler-plugins' own install manifests and chart."""
DEFAULT_SCHEDULE_TIMEOUT_SECONDS = 60
"""How long a coscheduled pod waits in Permit for its siblings (the plugin's own default)."""
VOLCANO_REFUSED = (
    "--gang-backend volcano (gang.backend) is not supported: Volcano's scheduler has not been "
    "built or tested with meshtrain; use coscheduling (scheduler-plugins' Coscheduling plugin as "
    "a second scheduler), native (the Workload API where served) or auto"
)
_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclasses.dataclass(frozen=True)
class GangBackend:
    """The operator's gang backend and its settings (flags of ``meshtrain operator``)."""

    kind: Kind = "auto"
    """``--gang-backend``: who binds the gang all or nothing."""
    scheduler_name: str = DEFAULT_SCHEDULER_NAME
    """``--gang-scheduler-name``: the ``schedulerName`` of every pod under ``coscheduling``, the
    second scheduler that runs the Coscheduling plugin."""
    schedule_timeout_seconds: int = DEFAULT_SCHEDULE_TIMEOUT_SECONDS
    """``--gang-schedule-timeout-seconds``: the PodGroup's ``scheduleTimeoutSeconds`` under
    ``coscheduling`` (how long bound-to-be pods wait for their siblings before all are let go)."""


AUTO = GangBackend()
"""Today's behaviour: the native Workload API where it is served, else the gang gate alone."""


def invalid(backend: GangBackend) -> str | None:
    """Why the operator must not start with ``backend`` (naming the flag and the fix), or None."""
    if backend.kind == "volcano":
        return VOLCANO_REFUSED
    if backend.kind not in KINDS:
        known = ", ".join(KINDS)
        return f"--gang-backend (env MESHTRAIN_GANG_BACKEND) {backend.kind!r} is none of {known}"
    name = backend.scheduler_name
    if len(name) > 253 or not _SUBDOMAIN.fullmatch(name):
        return (
            f"--gang-scheduler-name {name!r} cannot be a schedulerName: give an RFC 1123 subdomain "
            "(lower-case letters, digits, '-' and '.', at most 253 characters)"
        )
    timeout = backend.schedule_timeout_seconds
    if not 0 < timeout <= limits.MAX_GANG_SCHEDULE_TIMEOUT_SECONDS:
        return (
            f"--gang-schedule-timeout-seconds {timeout} must be above 0 and at most "
            f"{limits.MAX_GANG_SCHEDULE_TIMEOUT_SECONDS}"
        )
    return None


def resolve(kind: Kind, native_served: bool) -> Resolved:
    """What ``kind`` comes to where the native gang API is served (``native_served``) or not."""
    if kind == "auto":
        return "native" if native_served else "none"
    if kind in ("native", "coscheduling"):
        return kind
    return "none"


def described(resolved: Resolved, backend: GangBackend) -> str:
    """One line for the operator's log: who binds gangs whole."""
    if resolved == "native":
        return f"native Workload API ({NATIVE_API} PodGroup) binds each gang whole"
    if resolved == "coscheduling":
        return (
            f"scheduler-plugins' Coscheduling ({COSCHEDULING_API} PodGroup, schedulerName "
            f"{backend.scheduler_name}) binds each gang whole"
        )
    return "no gang scheduler: the gang gate alone holds a gang until it exists (half may bind)"


def build_pod_group(
    resolved: Resolved,
    backend: GangBackend,
    job: identity.JobRef,
    spec: api_spec.TrainingJobSpec,
    attempt: int,
    stamped: str | None = None,
) -> dict[str, Any] | None:
    """The PodGroup of gang ``attempt`` under ``resolved`` (None: ``none`` has none).

    Both kinds share the name, labels and owner (``builders.build_pod_group``: a new one per
    attempt and spec); scheduler-plugins' asks for ``minMember`` = every pod of the gang.
    """
    if resolved == "none":
        return None
    group = builders.build_pod_group(job, spec, attempt, stamped)
    if resolved == "native":
        return group
    return {
        **group,
        "apiVersion": COSCHEDULING_API,
        "spec": {
            "minMember": spec.pods,
            "scheduleTimeoutSeconds": backend.schedule_timeout_seconds,
        },
    }


def native_group(group: dict[str, Any] | None) -> str | None:
    """The name a pod puts in ``spec.schedulingGroup`` (native PodGroups only)."""
    if group is None or group.get("apiVersion") != NATIVE_API:
        return None
    return str(group["metadata"]["name"])


def join(
    pod: dict[str, Any], resolved: Resolved, backend: GangBackend, group: str | None
) -> dict[str, Any]:
    """``pod`` as the backend schedules it: under ``coscheduling`` the second scheduler's name and,
    for a gang pod (``group``), the PodGroup label; a spare or a replacement (``group`` None) binds
    alone, its gang long bound, so a label the job's own settings carried is dropped. Other
    backends: unchanged (native membership is ``builders.build_pod``'s ``pod_group``)."""
    if resolved != "coscheduling":
        return pod
    labels = dict(pod["metadata"].get("labels") or {})
    labels.pop(COSCHEDULING_LABEL, None)
    if group is not None:
        labels[COSCHEDULING_LABEL] = group
    return {
        **pod,
        "metadata": {**pod["metadata"], "labels": labels},
        "spec": {**pod["spec"], "schedulerName": backend.scheduler_name},
    }


def missing_api(group: dict[str, Any]) -> str:
    """What to say when the API server has no PodGroups of ``group``'s kind (404 on create)."""
    if group.get("apiVersion") == COSCHEDULING_API:
        return (
            "gang backend coscheduling needs scheduler-plugins' PodGroup CRD "
            "(podgroups.scheduling.x-k8s.io) and its scheduler: install them, or pick another "
            "gang.backend"
        )
    return (
        "gang backend native needs the Workload API (scheduling.k8s.io/v1alpha2, feature gates "
        "GenericWorkload and GangScheduling): turn it on, or pick another gang.backend"
    )
