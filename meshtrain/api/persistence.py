"""Whether a job's checkpoints outlive its pods, and the warning when they do not.

Without ``checkpoint.claimName`` (or an ``s3://`` ``checkpoint.path``) checkpoints go to an emptyDir,
lost with the pods: every gang restart, suspend, preemption, re-placement or drain starts again from
step 0.  Every job takes checkpoints (at least of its last step), and most of those restarts are not
the run policy's to allow, so every such job is warned about.  The spec is valid all the same (a
short run may not care); ``meshtrain validate`` warns in one line (:func:`short_warning`; not with
``--local``, where ``meshtrain run`` keeps checkpoints on this machine's disk), and the operator sets
the condition ``CheckpointsNotPersistent`` with the whole reason (:func:`warning`).
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import checkpoint as api_checkpoint
from meshtrain.api.spec import run_policy as api_run_policy
from meshtrain.api.spec import urls


def persistent(checkpoint: api_checkpoint.Checkpoint) -> bool:
    """Whether checkpoints outlive the pods: a claim, or an object store."""
    return checkpoint.claim_name is not None or urls.is_url(checkpoint.path)


def restarts(run_policy: api_run_policy.RunPolicy) -> list[str]:
    """The settings of ``run_policy`` under which the gang may start again (none: it never restarts)."""
    found = []
    if run_policy.backoff_limit > 0:
        found.append(f"backoffLimit {run_policy.backoff_limit}")
    if run_policy.disruption_restart_limit > 0:
        found.append(f"disruptionRestartLimit {run_policy.disruption_restart_limit}")
    if run_policy.elastic is not None:
        found.append("elastic")
    if run_policy.straggler_policy.action == "replace":
        found.append("stragglerPolicy replace")
    return found


def warning(spec: api_spec.TrainingJobSpec) -> str | None:
    """Why the job's checkpoints would be lost when its pods are replaced; None when they outlive them."""
    if persistent(spec.checkpoint):
        return None
    allowed = restarts(spec.run_policy)
    policy = f"a gang restart that runPolicy allows ({', '.join(allowed)}), " if allowed else ""
    return (
        f"spec.checkpoint.claimName is not set: checkpoints go to an emptyDir that is lost with the "
        f"pods, so {policy}runPolicy.suspend, a preemption (Kueue), a re-placement after a spec "
        f"change or a node drain starts training again from step 0; set checkpoint.claimName to a "
        f"PersistentVolumeClaim every node can mount, or checkpoint.path to an s3:// URL"
    )


def short_warning(spec: api_spec.TrainingJobSpec) -> str | None:
    """:func:`warning` in one short line (what ``meshtrain validate`` prints); None when persistent."""
    if persistent(spec.checkpoint):
        return None
    return (
        "spec.checkpoint.claimName is not set: on a cluster a restart, preemption or drain loses "
        "the checkpoints (an emptyDir); set checkpoint.claimName or an s3:// checkpoint.path"
    )
