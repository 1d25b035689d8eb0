"""The pod tier of in-place recovery: a pod lost from a running gang is replaced alone.

A pod is lost when it is deleted, evicted or disrupted, its node is gone, it vanished, or its
node's container runtime lost its trainer container (``PodState.runtime_lost``: containerd
restarted under it; the node is Ready again and may take the replacement), or its supervisor
left one of its GPUs for bad (``PodState.left_bad_gpu``: the replacement avoids the node, which
``bad_gpus`` excludes from the job).  A node
that stops reporting is tainted ``unreachable``/``not-ready`` (NoExecute) by the node lifecycle
controller; a rejoining gang's pods tolerate that only ``replacement.node_loss_seconds`` (a third
of the rejoin window, at most 30 s), then the taint manager evicts them (deleted, with a
``DisruptionTarget`` condition): a lost node is seen well within the window.  A pod whose own
trainer failed is not lost (the kubelet's container tier and the gang rebuild answer that).  When
every lost pod is lost that way, none is pod 0 when its supervisor hosts the rendezvous store
(``rendezvousStore: pod0``; with a store pod of its own pod 0 is replaced like the others), every
other pod of the gang still runs and can rejoin (``naming.LABEL_REJOINS``), and the gang attempt
has in-place recoveries left (``runPolicy.recovery.inPlaceLimit``), the reconciler replaces only
the lost pods (``job_actions.ReplacePods``); where no node takes them it does what
``failure.GANG_FAILED`` would (the gang rebuilt, or shrunk when elastic).  Pure.
"""

from __future__ import annotations

from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import (
    bad_gpus,
    failure,
    job_actions,
    job_state,
    kubelet_tier,
    pod_failure,
    pod_state,
    replacement,
    situation,
)


def _cause(pod: pod_state.PodState, nodes_gone: frozenset[str]) -> str | None:
    """Why ``pod`` is lost, or None when it is not (its own trainer failed, or it is healthy)."""
    if pod.node is not None and pod.node in nodes_gone:
        return "node deleted"
    if pod.phase == "Unknown":
        return "node lost"
    if pod_failure.disrupted(pod):
        return f"disrupted ({pod.reason or pod.disruption_reason or 'DisruptionTarget'})"
    if pod.deleting and not pod.terminal:
        return "pod deleted"
    if pod.runtime_lost and pod.terminal:
        return "container runtime lost it"
    if pod.left_bad_gpu:
        return "a GPU taken for bad"
    return None


def _node_lost_it(pod: pod_state.PodState, nodes_gone: frozenset[str]) -> bool:
    """Whether the node, not a deletion, lost the pod: a replacement must not go back there."""
    return pod.node is not None and (
        pod.node in nodes_gone
        or pod.phase == "Unknown"
        or pod_failure.disrupted(pod)
        or pod.left_bad_gpu
    )


def _trainer_runs(spec: api_spec.TrainingJobSpec, pod: pod_state.PodState) -> bool:
    """Whether a surviving pod's trainer runs, or is about to again: not exited (a sidecar keeps a
    pod Running after its trainer left), or exited with a code the kubelet restarts it on."""
    if pod.exit_code is None:
        return True
    restarts = kubelet_tier.enabled(spec) and not kubelet_tier.hosts_store(spec, pod.index)
    return restarts and pod.exit_code in kubelet_tier.RESTART_CODES


def lost(seen: situation.Situation) -> job_actions.ReplacePods | None:
    """The replacement of the gang's lost pods, or None when this tier does not apply."""
    spec = seen.spec
    if seen.phase != job_state.Phase.RUNNING.value or not replacement.rejoins(spec):
        return None
    if seen.store_loss is not None:  # every rank lost the store: the gang is rebuilt
        return None
    failures = seen.failures
    if any(f.permanent for f in failures):
        return None
    failed = {f.pod for f in failures}
    causes: list[tuple[int, str, str]] = []
    survivors: list[pod_state.PodState] = []
    for pod in seen.current:
        if pod.name not in failed:
            survivors.append(pod)
            continue
        cause = _cause(pod, seen.nodes_gone)
        if cause is None:
            return None  # its own trainer failed: not this tier
        causes.append((pod.index, pod.name, cause))
    for index in seen.missing:
        causes.append((index, "", "pod vanished"))
    indices = tuple(sorted(index for index, _, _ in causes))
    if not indices or any(kubelet_tier.hosts_store(spec, i) for i in indices):
        return None
    if not all(
        p.rejoins and not p.terminal and not p.gated and _trainer_runs(spec, p) for p in survivors
    ):
        return None
    limit = spec.run_policy.recovery.in_place_limit
    placed = replacement.entries(seen.job.status)
    new = [i for i in indices if not replacement.pending(placed.get(i))]  # pending: counted
    if replacement.attempt_restarts(seen.job.status, seen.attempt, seen.now) + len(new) > limit:
        return None
    lost_pods = [p for p in seen.current if p.index in indices]
    return job_actions.ReplacePods(
        attempt=seen.attempt,
        indices=indices,
        causes=tuple(sorted(causes)),
        avoid=tuple(
            sorted({p.node for p in lost_pods if p.node and _node_lost_it(p, seen.nodes_gone)})
        ),
        doomed=pod_state.undeleted(lost_pods),
        flavors=seen.flavors,
        # the nodes' Events are recorded before the replacement is tried (_replace), not again
        otherwise=tuple(
            a
            for a in failure.restart_or_fail(seen, failures).actions
            if not isinstance(a, job_actions.EmitOnNode)
        ),
        topology=seen.topology,
    )


def _replace(seen: situation.Situation) -> job_actions.Decision:
    replace = seen.once(lost)
    assert replace is not None
    # After a rebuild instead (no room), look again as a repeated disruption's wait says; never
    # "at once": a rebuild's own writes bring the next pass, and a replacement waiting for its
    # lost pod to stop is woken by that pod's events (a zero here spun ~18 passes a second).
    again = failure.restart_or_fail(seen, seen.failures).requeue_after
    bad = bad_gpus.newly_bad(seen.job.status, seen.current, seen.now)
    excluded = bad_gpus.excluded_after(seen.job.status, bad)
    written = (
        () if excluded is None else (job_actions.set_status(seen.job, excludedNodes=excluded),)
    )
    told = bad_gpus.node_events(bad)
    return job_actions.Decision((*written, *told, replace), requeue_after=again or None)


REPLACE_LOST = situation.PLACED.rule(
    "pods lost from a running gang that rejoins, pod 0 not among them unless a store pod hosts the "
    "rendezvous: replace only them",
    lambda seen: bool(seen.failures) and seen.once(lost) is not None,
    _replace,
)
