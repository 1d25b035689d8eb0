"""The kubelet tier of in-place recovery: what the trainer container carries so that the kubelet
restarts it in place when it dies, and the program it runs.

The built-in trainer runs its per-pod supervisor (``meshtrain.trainer.supervise``), which restarts
failed worker processes itself (the process tier).  When the supervisor's container dies (SIGKILL,
a crash in native code), the kubelet restarts it on the same pod, node and volumes, by the
container's ``restartPolicyRules`` (KEP-5307, beta and on by default since Kubernetes 1.35): no
pod is deleted and nothing is placed again; the operator counts it (``in_place``).  Not on pod 0
when its supervisor hosts the rendezvous store (``rendezvousStore: pod0``), which a restart would
lose (the other pods then exit 75 anyway), so its container dying is a gang rebuild; with a store
pod (:func:`store_pod`) pod 0 restarts in place like the others.  An API server before 1.35 refuses
``restartPolicy`` on a regular container (1.34 only with the alpha gate): the operator asks the
server's version once (:func:`rules_served`, ``--container-restart-rules``) and leaves the rules
out there; the supervisor still recovers processes in place.

A custom trainer keeps torchrun (elastic with ``torchrun_tier``).  When its torchrun agent itself
dies (killed by a signal: the container's PID 1 is gone), the kubelet restarts every container of
the pod in place (KEP-5532: the rule action ``RestartAllContainers``, feature gate
``RestartAllContainersOnContainerExits``, alpha in 1.35, beta and on by default since 1.36): the
same pod, node, IP and volumes, init containers run again, sidecars restart; the other pods'
agents meet the restarted one in a new rendezvous round.  Not on pod 0 (its agent hosts the
rendezvous store), only where the API server is 1.36 or newer (:func:`all_containers_served`) and
every node of the gang declares the feature in ``status.declaredFeatures`` (:func:`declares_all`:
the scheduler's NodeDeclaredFeatures filter keeps such a pod off a node that does not, and its
kubelet refuses it at admission; a 1.33-1.35 kubelet under a 1.36 server declares nothing), and
never on an OOM kill (:data:`POD_RESTART_CODES`).
Pure: manifests only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from meshtrain.api import exitcodes, limits
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import torchrun_tier

SUPERVISOR_COMMAND = ("python", "-m", "meshtrain.trainer.supervise")
"""The built-in trainer's command: the supervisor reads torchrun's environment (``PET_*``,
``MASTER_*``) and :func:`recovery_env`."""

RESTART_CODES = tuple(sorted(exitcodes.CONTAINER_DIED))
"""Exit codes the kubelet restarts the trainer container on (:data:`exitcodes.CONTAINER_DIED`)."""

RULES_SINCE = (1, 35)
"""Kubernetes version whose API server accepts ``restartPolicyRules`` by default (KEP-5307 beta)."""
ALL_CONTAINERS_SINCE = (1, 36)
"""Kubernetes version whose API server accepts the ``RestartAllContainers`` action by default
(KEP-5532 beta; 1.35 refuses it unless the alpha gate is on)."""
RESTART_ALL = "RestartAllContainers"
RESTARTING_ALL = "RestartingAllContainers"
"""The reason v1.36.3's kubelet writes in every container's ``lastState.terminated`` (with exit
code 137, whatever ended the one that fired the rule) when it restarts a pod in place."""
NODE_FEATURE = "RestartAllContainersOnContainerExits"
"""The feature a node lists in ``status.declaredFeatures`` when its kubelet runs the
``RestartAllContainers`` action (k8s.io/component-helpers nodedeclaredfeatures, v1.36.3)."""
OOM_KILLED = 128 + 9
"""137: SIGKILL, which is also what the kernel's (cgroup v2 group) OOM kill ends a container with."""
POD_RESTART_CODES = tuple(
    sorted(code for code in exitcodes.CONTAINER_DIED if code > 128 and code != OOM_KILLED)
)
"""Exit codes of a custom trainer's container that restart its whole pod in place: killed by a
signal (torchrun's agent is gone).  Not 1: torchrun exits 1 when its workers failed past
``--max-restarts``, which asks for the gang rebuild.  Not 137: after the rule fires the v1.36.3
kubelet overwrites every container's ``lastState.terminated`` with reason
``RestartingAllContainers``, so an OOM kill would be counted as an in-place restart and repeated
until CrashLoopBackOff; an agent SIGKILLed (137) therefore gets the gang rebuild, as an OOM kill."""

RestartAll = Literal["off", "on", "auto"]
"""``--restart-all-containers``: never; always (no version or node check); where the API server
serves the action and every node of the gang declares :data:`NODE_FEATURE`."""
POD_WITHOUT_RULES = 0
"""Pod index whose container never restarts in place when its supervisor hosts the rendezvous store."""

ENV_IN_PLACE = "MESHTRAIN_RECOVERY_IN_PLACE"
ENV_IN_PLACE_LIMIT = "MESHTRAIN_RECOVERY_IN_PLACE_LIMIT"
ENV_WARM_SPARES = "MESHTRAIN_RECOVERY_WARM_SPARES"
ENV_REJOIN_TIMEOUT = "MESHTRAIN_RECOVERY_REJOIN_TIMEOUT_SECONDS"
ENV_RENDEZVOUS_STORE = "MESHTRAIN_RECOVERY_RENDEZVOUS_STORE"
"""Where the pod's gang meets its rendezvous store (``pod0`` or :data:`DEDICATED`): the supervisor
follows it, as ``MASTER_ADDR`` was built with it."""
DEDICATED = "dedicated"


def store_pod(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the job's rendezvous store runs in a pod of its own (``rendezvousStore: dedicated``
    for the built-in trainer in place): ``MASTER_ADDR`` names that pod, and pod 0 is recovered in
    place and replaced alone like any other pod."""
    return spec.trainer.type == "builtin" and spec.run_policy.recovery.dedicated_store


def hosts_store(spec: api_spec.TrainingJobSpec, index: int) -> bool:
    """Whether pod ``index``'s supervisor hosts the rendezvous store (pod 0 without a store pod):
    losing it loses the store, so it is never restarted nor replaced alone."""
    return index == POD_WITHOUT_RULES and not store_pod(spec)


def enabled(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the gang restarts in place: the built-in trainer, ``inPlace`` and a budget above 0."""
    recovery = spec.run_policy.recovery
    return spec.trainer.type != "custom" and recovery.in_place and recovery.in_place_limit > 0


def command(spec: api_spec.TrainingJobSpec) -> tuple[list[str], list[str]]:
    """(command, args) of the trainer container: the supervisor, or the job's own program."""
    if spec.trainer.type == "custom":
        return list(spec.trainer.command), list(spec.trainer.args)
    return list(SUPERVISOR_COMMAND), []


def _served(version: Mapping[str, Any], since: tuple[int, int]) -> bool:
    try:
        major = int(re.sub(r"\D+$", "", str(version.get("major") or ""))[:8])
        minor = int(re.sub(r"\D+$", "", str(version.get("minor") or ""))[:8])
    except ValueError:
        return False
    return (major, minor) >= since


def rules_served(version: Mapping[str, Any]) -> bool:
    """Whether an API server of ``version`` (its ``/version`` document) accepts container restart
    rules: :data:`RULES_SINCE` or newer (``minor`` may carry a ``+``, e.g. ``"35+"`` on managed
    clusters).  An unreadable version: False (pods without rules are accepted everywhere)."""
    return _served(version, RULES_SINCE)


def all_containers_served(version: Mapping[str, Any]) -> bool:
    """Whether an API server of ``version`` accepts the ``RestartAllContainers`` action:
    :data:`ALL_CONTAINERS_SINCE` or newer; unreadable: False."""
    return _served(version, ALL_CONTAINERS_SINCE)


def declares(node: Mapping[str, Any] | None) -> bool:
    """Whether ``node`` (a Node object) lists :data:`NODE_FEATURE` in ``status.declaredFeatures``;
    an unknown node, or a list that is no list of strings (bounded read): False."""
    status = (node or {}).get("status")
    features = status.get("declaredFeatures") if isinstance(status, Mapping) else None
    if not isinstance(features, list):
        return False
    return NODE_FEATURE in (
        f for f in features[: limits.MAX_DECLARED_FEATURES] if isinstance(f, str)
    )


def declares_all(mode: RestartAll, nodes: Iterable[Mapping[str, Any] | None]) -> bool:
    """Whether a gang placed on ``nodes`` carries the ``RestartAllContainers`` rule: ``on`` always,
    ``off`` never, ``auto`` (the API server serves it) when every node :func:`declares` it: else
    no pod of the gang does (the gang rebuild, as before)."""
    if mode == "auto":
        return all(declares(node) for node in nodes)
    return mode == "on"


def restart_fields(
    spec: api_spec.TrainingJobSpec, index: int, *, rules: bool = True, all_containers: bool = False
) -> dict[str, Any]:
    """The trainer container's ``restartPolicy`` and ``restartPolicyRules`` for pod ``index``: none
    when not :func:`enabled`, on pod :data:`POD_WITHOUT_RULES`, or where the API server serves no
    rules (``rules`` False).  A custom trainer's (``torchrun_tier.enabled``): the whole pod
    restarts in place on :data:`POD_RESTART_CODES` where the server serves it (``all_containers``).

    ``Never`` stays the policy for every other code (rules need an explicit container policy):
    the pod then fails as before and the operator decides (permanent code, gang restart, done).
    """
    if torchrun_tier.enabled(spec) and index != POD_WITHOUT_RULES and all_containers:
        codes = {"operator": "In", "values": list(POD_RESTART_CODES)}
        return {
            "restartPolicy": "Never",
            "restartPolicyRules": [{"action": RESTART_ALL, "exitCodes": codes}],
        }
    if not enabled(spec) or hosts_store(spec, index) or not rules:
        return {}
    rule = {"action": "Restart", "exitCodes": {"operator": "In", "values": list(RESTART_CODES)}}
    return {"restartPolicy": "Never", "restartPolicyRules": [rule]}


def recovery_env(spec: api_spec.TrainingJobSpec) -> dict[str, int | str]:
    """``runPolicy.recovery`` for the supervisor (``IN_PLACE`` is 0 when :func:`enabled` is not)."""
    recovery = spec.run_policy.recovery
    return {
        ENV_IN_PLACE: int(enabled(spec)),
        ENV_IN_PLACE_LIMIT: recovery.in_place_limit,
        ENV_WARM_SPARES: recovery.warm_spares,
        ENV_REJOIN_TIMEOUT: recovery.rejoin_timeout_seconds,
        ENV_RENDEZVOUS_STORE: DEDICATED if store_pod(spec) else "pod0",
    }
