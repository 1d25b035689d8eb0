"""runPolicy.stragglerPolicy in the operator: the trainer's straggler report -> status, Events, a new gang.

:func:`observed` puts the ranks rank 0's /progress flags (the trainer's
``guards/stragglers.py``) on their pods and nodes in ``status.straggler``; :func:`react` sets
the ``Straggler`` condition and, under ``action: replace``, excludes the node and stops the
gang so that the next pass places it elsewhere.  Not a restart: the pods did not fail.  Pure.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Mapping, Sequence
from typing import Any

from meshtrain.api import spec as api_spec
from meshtrain.api.spec import run_policy as api_run_policy
from meshtrain.api.spec import status as api_status
from meshtrain.operator.policy import (
    conditions,
    excluded_nodes,
    job_actions,
    pod_state,
    running,
    situation,
)

REASON = "Straggler"
"""``excludedNodes[].reason`` of a replaced straggler's node."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _located(
    spec: api_spec.TrainingJobSpec, nodes: Mapping[int, Any], rank: int, slowdown: float
) -> dict[str, Any]:
    """A flagged rank with its pod (by the rank layout) and that pod's node (by the placement)."""
    pod = spec.parallelism.layout.pod_of(rank, spec.resources.gpus_per_node)
    entry: dict[str, Any] = {"rank": rank, "podIndex": pod, "slowdown": round(slowdown, 4)}
    if nodes.get(pod):
        entry["node"] = nodes[pod]
    return entry


def observed(
    spec: api_spec.TrainingJobSpec,
    status: Mapping[str, Any],
    report: Mapping[str, Any],
    now: datetime.datetime,
) -> dict[str, Any]:
    """``status.straggler`` from one /progress report (empty: nothing to change).

    ``since`` is kept while the same rank on the same node stays flagged.
    A report without the key (an older trainer, a custom program) changes nothing.
    """
    if "straggler" not in report:
        return {}
    found = report.get("straggler")
    current = status.get("straggler")
    if not isinstance(found, Mapping):
        return {"straggler": None} if current else {}
    rank, slowdown = found.get("rank"), _number(found.get("slowdown"))
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 0 or slowdown is None:
        return {}
    if rank >= spec.world_size:
        return {}
    nodes = {
        int(p.get("podIndex", -1)): p.get("node")
        for p in status.get("placement") or []
        if isinstance(p, Mapping)
    }
    entry = _located(spec, nodes, rank, slowdown)
    others = [
        _located(spec, nodes, item["rank"], _number(item.get("slowdown")) or 0.0)
        for item in report.get("stragglers") or []
        if isinstance(item, Mapping)
        and isinstance(item.get("rank"), int)
        and not isinstance(item.get("rank"), bool)
        and 0 <= item["rank"] < spec.world_size
        and item["rank"] != rank
        and _number(item.get("slowdown")) is not None
    ]
    if others:
        entry["others"] = others
    since_step = found.get("since_step")
    if isinstance(since_step, int) and not isinstance(since_step, bool) and since_step >= 0:
        entry["sinceStep"] = since_step
    same = (
        isinstance(current, Mapping)
        and current.get("rank") == rank
        and current.get("node") == entry.get("node")
    )
    entry["since"] = (
        current.get("since") if same and isinstance(current, Mapping) else None
    ) or conditions.timestamp(now)
    return {"straggler": entry}


def _of_this_gang(straggler: Any, status: Mapping[str, Any]) -> bool:
    """Whether ``straggler`` was measured on the placed gang: its pod is on the node it names.

    A gang placed again (restart, resize, replacement) starts unjudged; an
    entry left over from the previous gang must not stop the new one.
    """
    if not isinstance(straggler, Mapping):
        return False
    if "node" not in straggler:
        return True
    nodes = {
        p.get("podIndex"): p.get("node")
        for p in status.get("placement") or []
        if isinstance(p, Mapping)
    }
    return bool(nodes.get(straggler.get("podIndex")) == straggler["node"])


def _replaced_before(status: Mapping[str, Any], rank: Any, any_rank: bool = False) -> list[str]:
    """The nodes a straggler replacement already moved ``rank`` (or any rank) off in this job."""
    return [
        entry["node"]
        for entry in status.get("excludedNodes") or []
        if isinstance(entry, Mapping)
        and entry.get("reason") == REASON
        and (any_rank or entry.get("rank") == rank)
        and isinstance(entry.get("node"), str)
    ]


def _nodes_to_leave(
    status: Mapping[str, Any], straggler: Mapping[str, Any], room: int, now: datetime.datetime
) -> dict[str, Mapping[str, Any]]:
    """The flagged ranks' nodes to exclude in one rebuild (node -> rank entry), slowest first: not
    already excluded, not a rank a replacement already moved, at most ``room`` (at least the
    slowest's)."""
    gone = excluded_nodes.excluded(status, now)
    others = [o for o in straggler.get("others") or [] if isinstance(o, Mapping)]
    chosen: dict[str, Mapping[str, Any]] = {straggler["node"]: straggler}
    for item in others:
        where = item.get("node")
        if (
            isinstance(where, str)
            and where not in gone
            and where not in chosen
            and not _replaced_before(status, item.get("rank"))
        ):
            chosen[where] = item
    return dict(list(chosen.items())[: max(1, room)])


def describe(straggler: Mapping[str, Any]) -> str:
    """``rank 3 (pod 1 on node gpu-2) is a straggler``: who only, so the condition message (which
    decides whether an Event is emitted) stays the same while that rank on that node is flagged;
    how much and since when go into the Event and ``status.straggler``."""
    return f"{_who(straggler)} is a straggler"


def _who(straggler: Mapping[str, Any]) -> str:
    where = f"pod {straggler.get('podIndex')}"
    if straggler.get("node"):
        where += f" on node {straggler['node']}"
    return f"rank {straggler.get('rank')} ({where})"


def _measured(straggler: Mapping[str, Any]) -> str:
    since = f" since step {straggler['sinceStep']}" if "sinceStep" in straggler else ""
    return f"computes {straggler.get('slowdown')}x its data-parallel peers' time{since}"


@dataclasses.dataclass(frozen=True)
class Reaction:
    """What the straggler policy does this pass."""

    status: dict[str, Any]
    """Status fields to merge (conditions included); empty: nothing."""
    events: tuple[tuple[str, str, str], ...]
    """(type, reason, message) of Events to emit."""
    replace: bool = False
    """Delete the gang's pods with their own grace period: it is placed again without the node."""
    otherwise: Reaction | None = None
    """With ``replace``: what to do instead when no placement without the nodes fits now."""
    nodes: tuple[str, ...] = ()
    """With ``replace``: the nodes to leave out (every flagged rank's, slowest first)."""


def _report(
    conds: Sequence[dict[str, Any]],
    previous: Mapping[str, Any],
    message: str,
    news: str,
    now: datetime.datetime,
    reason: str = conditions.STRAGGLER_DETECTED,
) -> Reaction:
    """Straggler=True with ``message`` and one Warning Event (``news``) when the message is new."""
    if previous.get("status") == conditions.TRUE and previous.get("message") == message:
        return Reaction({}, ())
    updated = conditions.set(conds, conditions.STRAGGLER, conditions.TRUE, reason, message, now)
    return Reaction({"conditions": updated}, (("Warning", reason, news),))


def _nodes_phrase(nodes: Mapping[str, Any]) -> str:
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(nodes)


def _cleared(
    conds: Sequence[dict[str, Any]], previous: Mapping[str, Any], now: datetime.datetime
) -> Reaction:
    """No straggler to act on (none, another gang's, or the policy ignores them): Straggler=False once."""
    if previous.get("status") != conditions.TRUE:
        return Reaction({}, ())
    message = "no rank is flagged as a straggler any more"
    updated = conditions.set(
        conds, conditions.STRAGGLER, conditions.FALSE, conditions.STRAGGLER_GONE, message, now
    )
    return Reaction({"conditions": updated}, (("Normal", conditions.STRAGGLER_GONE, message),))


def react(
    policy: api_run_policy.StragglerPolicy,
    status: Mapping[str, Any],
    conds: Sequence[dict[str, Any]],
    now: datetime.datetime,
) -> Reaction:
    """The Straggler condition, its Event, and under ``replace`` the rebuild without the slow node.

    A replacement stops the gang the way a spec change does (full grace period: the ranks
    finish the step, checkpoint it and exit), records the node in ``status.excludedNodes`` and
    clears the placement; the new gang resumes from the checkpoint.  ``conds`` are the
    conditions as this pass leaves them.
    """
    straggler = status.get("straggler")
    previous = conditions.find(conds, conditions.STRAGGLER) or {}
    if not _of_this_gang(straggler, status) or policy.action == "ignore":
        return _cleared(conds, previous, now)
    assert isinstance(straggler, Mapping)
    message = describe(straggler)
    others = [o for o in straggler.get("others") or [] if isinstance(o, Mapping)]
    if others:
        message += "; also flagged: " + ", ".join(_who(o) for o in others)
    news = f"{message}: {_measured(straggler)}"
    node = straggler.get("node")
    replacements = int(status.get("stragglerReplacements") or 0)
    left_out = max(replacements, len(_replaced_before(status, None, any_rank=True)))
    replace = (
        policy.action == "replace"
        and isinstance(node, str)
        and node not in excluded_nodes.excluded(status, now)
    )
    moved_from = _replaced_before(status, straggler.get("rank"))
    if replace and moved_from:
        message += (
            f"; not replaced: rank {straggler.get('rank')} was already moved off node(s) "
            f"{', '.join(moved_from)} and is slow again, so the cause follows the rank "
            "(its data, its share of the model), not the node"
        )
        return _report(conds, previous, message, news, now, conditions.STRAGGLER_FOLLOWS_RANK)
    if replace and left_out >= policy.max_replacements:
        message += (
            f"; not replaced: maxReplacements={policy.max_replacements} node(s) already excluded"
        )
        replace = False
    if not replace:
        return _report(conds, previous, message, news, now)
    slow = _nodes_to_leave(status, straggler, policy.max_replacements - left_out, now)
    stuck = f"{message}; not replaced: no placement without {_nodes_phrase(slow)} fits now at the running size"
    otherwise = _report(
        conds, previous, stuck, f"{news}; {stuck}", now, conditions.STRAGGLER_NO_REPLACEMENT
    )
    return _replacement(policy, status, conds, slow, news, otherwise, now)


def _replacement(
    policy: api_run_policy.StragglerPolicy,
    status: Mapping[str, Any],
    conds: Sequence[dict[str, Any]],
    slow: Mapping[str, Mapping[str, Any]],
    news: str,
    otherwise: Reaction,
    now: datetime.datetime,
) -> Reaction:
    """Stop the gang to place it again without the ``slow`` nodes (each excluded with its rank's numbers)."""
    replacements = int(status.get("stragglerReplacements") or 0)
    nodes_phrase = _nodes_phrase(slow)
    checkpoint = status.get("lastCheckpointStep")
    note = (
        f"{news}: stopping the gang (its ranks checkpoint the step they stop at) to place it "
        f"again without {nodes_phrase} (replacement {replacements + 1} of at most "
        f"{policy.max_replacements}); training resumes from that checkpoint"
        + (f" (last one so far: step {checkpoint})" if checkpoint else "")
    )
    updated = conditions.set(
        conds, conditions.STRAGGLER, conditions.FALSE, conditions.STRAGGLER_REPLACED, note, now
    )
    for type_ in (conditions.PLACED, conditions.RUNNING):
        updated = conditions.set(
            updated, type_, conditions.FALSE, conditions.STRAGGLER_REPLACED, note, now
        )
    entries = [
        {
            "node": where,
            "rank": item.get("rank"),
            "reason": REASON,
            "message": f"{describe(item)}: {_measured(item)}",
            "time": conditions.timestamp(now),
        }
        for where, item in slow.items()
    ]
    changes = {
        "phase": api_status.Phase.RESTARTING.value,
        "placement": [],
        "straggler": None,
        "excludedNodes": [*(status.get("excludedNodes") or []), *entries],  # maxReplacements bounds
        "stragglerReplacements": replacements + 1,
        "conditions": updated,
    }
    events = (("Warning", conditions.STRAGGLER_REPLACED, note),)
    return Reaction(changes, events, replace=True, otherwise=otherwise, nodes=tuple(slow))


def _reaction(seen: situation.Situation) -> Reaction:
    """The straggler policy's reaction to the running gang's report."""
    policy = seen.spec.run_policy.straggler_policy
    conds = seen.once(running.conditions_now)
    return react(policy, seen.job.status, conds, seen.now)


def _replaced(seen: situation.Situation) -> job_actions.Decision:
    """Stop the gang and place it again without the slow nodes, if a placement without them fits now."""
    reaction = seen.once(_reaction)
    assert reaction.nodes and reaction.otherwise is not None
    fallback = reaction.otherwise
    replace = job_actions.ReplaceStraggler(
        reaction.nodes,
        (
            job_actions.set_status(seen.job, **reaction.status),
            *(job_actions.Emit(*event) for event in reaction.events),
            job_actions.DeletePods(pod_state.undeleted(seen.current)),
        ),
        (
            *([job_actions.set_status(seen.job, **fallback.status)] if fallback.status else []),
            *(job_actions.Emit(*event) for event in fallback.events),
        ),
        seen.topology,
    )
    return job_actions.Decision((replace,), requeue_after=0)


def _reported(seen: situation.Situation) -> tuple[job_actions.Action, ...]:
    reaction = seen.once(_reaction)
    written = [job_actions.set_status(seen.job, **reaction.status)] if reaction.status else []
    return (*written, *(job_actions.Emit(*event) for event in reaction.events))


REPLACE = situation.GANG_RUNNING.rule(
    "stragglerPolicy replace flags a node: rebuild the gang without it if that fits now",
    lambda seen: seen.once(_reaction).replace,
    _replaced,
)
REPORTED = situation.GANG_RUNNING.note(
    "the Straggler condition and its Events as the report says", _reported
)
