"""The kubelet tier of in-place recovery: what the trainer container carries so that the kubelet
restarts it in place when it dies, and the program it runs.

The built-in trainer runs its per-pod supervisor (``meshtrain.trainer.supervise``), which restarts
failed worker processes itself (the process tier).  When the supervisor's container dies (SIGKILL,
a crash in native code), the kubelet restarts it on the same pod, node and volumes, by the
container's ``restartPolicyRules`` (KEP-5307, beta and on by default since Kubernetes 1.35): no
pod is deleted and nothing is placed again; the operator counts it (``in_place``).  A custom
trainer keeps torchrun and the gang rebuild.  Pure: manifests only.
"""

from __future__ import annotations

from typing import Any

from meshtrain.api import exitcodes
from meshtrain.api import spec as api_spec

SUPERVISOR_COMMAND = ("python", "-m", "meshtrain.trainer.supervise")
"""The built-in trainer's command: the supervisor reads torchrun's environment (``PET_*``,
``MASTER_*``) and :func:`recovery_env`."""

RESTART_CODES = tuple(sorted(exitcodes.CONTAINER_DIED))
"""Exit codes the kubelet restarts the trainer container on (:data:`exitcodes.CONTAINER_DIED`)."""

ENV_IN_PLACE = "MESHTRAIN_RECOVERY_IN_PLACE"
ENV_IN_PLACE_LIMIT = "MESHTRAIN_RECOVERY_IN_PLACE_LIMIT"
ENV_WARM_SPARES = "MESHTRAIN_RECOVERY_WARM_SPARES"
ENV_REJOIN_TIMEOUT = "MESHTRAIN_RECOVERY_REJOIN_TIMEOUT_SECONDS"


def enabled(spec: api_spec.TrainingJobSpec) -> bool:
    """Whether the gang restarts in place: the built-in trainer, ``inPlace`` and a budget above 0."""
    recovery = spec.run_policy.recovery
    return spec.trainer.type != "custom" and recovery.in_place and recovery.in_place_limit > 0


def command(spec: api_spec.TrainingJobSpec) -> tuple[list[str], list[str]]:
    """(command, args) of the trainer container: the supervisor, or the job's own program."""
    if spec.trainer.type == "custom":
        return list(spec.trainer.command), list(spec.trainer.args)
    return list(SUPERVISOR_COMMAND), []


def restart_fields(spec: api_spec.TrainingJobSpec) -> dict[str, Any]:
    """The trainer container's ``restartPolicy`` and ``restartPolicyRules`` (none when not :func:`enabled`).

    ``Never`` stays the policy for every other code (rules need an explicit container policy):
    the pod then fails as before and the operator decides (permanent code, gang restart, done).
    """
    if not enabled(spec):
        return {}
    rule = {"action": "Restart", "exitCodes": {"operator": "In", "values": list(RESTART_CODES)}}
    return {"restartPolicy": "Never", "restartPolicyRules": [rule]}


def recovery_env(spec: api_spec.TrainingJobSpec) -> dict[str, int]:
    """``runPolicy.recovery`` for the supervisor (``IN_PLACE`` is 0 when :func:`enabled` is not)."""
    recovery = spec.run_policy.recovery
    return {
        ENV_IN_PLACE: int(enabled(spec)),
        ENV_IN_PLACE_LIMIT: recovery.in_place_limit,
        ENV_WARM_SPARES: recovery.warm_spares,
        ENV_REJOIN_TIMEOUT: recovery.rejoin_timeout_seconds,
    }
