"""The pod tier of in-place recovery: a pod lost from a running gang is replaced alone.

A pod is lost when it is deleted, evicted or disrupted, its node is gone, or it vanished.  A node
that stops reporting is tainted ``unreachable``/``not-ready`` (NoExecute) by the node lifecycle
controller; a rejoining gang's pods tolerate that only ``replacement.node_loss_seconds`` (a third
of the rejoin window, at most 30 s), then the taint manager evicts them (deleted, with a
``DisruptionTarget`` condition): a lost node is seen well within the window.  A pod whose own
trainer failed is not lost (the kubelet's container tier and the gang rebuild answer that).  When
every lost pod is lost that way, none is pod 0 (its supervisor hosts the rendezvous store), every
other pod of the gang still runs and can rejoin (``naming.LABEL_REJOINS``), and the gang attempt
has in-place recoveries left (``runPolicy.recovery.inPlaceLimit``), the reconciler replaces only
the lost pods (``job_actions.ReplacePods``); where no node takes them it does what
``failure.GANG_FAILED`` would (the gang rebuilt, or shrunk when elastic).  Pure.
"""

from __future__ import annotations

from meshtrain.operator.policy import (
    failure,
    job_actions,
    job_state,
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
    return None


def _node_lost_it(pod: pod_state.PodState, nodes_gone: frozenset[str]) -> bool:
    """Whether the node, not a deletion, lost the pod: a replacement must not go back there."""
    return pod.node is not None and (
        pod.node in nodes_gone or pod.phase == "Unknown" or pod_failure.disrupted(pod)
    )


def lost(seen: situation.Situation) -> job_actions.ReplacePods | None:
    """The replacement of the gang's lost pods, or None when this tier does not apply."""
    spec = seen.spec
    if seen.phase != job_state.Phase.RUNNING.value or not replacement.rejoins(spec):
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
    if not indices or 0 in indices:
        return None
    if not all(p.rejoins and not p.terminal and not p.gated for p in survivors):
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
        otherwise=failure.restart_or_fail(seen, failures).actions,
        topology=seen.topology,
    )


def _replace(seen: situation.Situation) -> job_actions.Decision:
    replace = seen.once(lost)
    assert replace is not None
    # After a rebuild instead (no room), look again as a repeated disruption's wait says; never
    # "at once": a rebuild's own writes bring the next pass, and a replacement waiting for its
    # lost pod to stop is woken by that pod's events (a zero here spun ~18 passes a second).
    again = failure.restart_or_fail(seen, seen.failures).requeue_after
    return job_actions.Decision((replace,), requeue_after=again or None)


REPLACE_LOST = situation.PLACED.rule(
    "pods lost from a running gang that rejoins, pod 0 not among them: replace only them",
    lambda seen: bool(seen.failures) and seen.once(lost) is not None,
    _replace,
)
