"""Admission by plan: does a TrainingJob fit the memory of the GPUs it would run on?

The pure policy the operator applies before it places a gang: the candidate nodes, the device
profile to judge by (the smallest GPU among them) and the verdict, with the numbers for
``status.plan``.  The arithmetic is the planner's (:mod:`meshtrain.planner.admission`);
``admitting`` reads the profile files and remembers the verdicts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from meshtrain import placement
from meshtrain.api import spec as api_spec
from meshtrain.operator.policy import node_affinity
from meshtrain.planner import admission, estimate, profiles


@dataclasses.dataclass(frozen=True)
class Choice:
    """The profile a job is judged by, and why that one."""

    profile: profiles.Profile | None
    """The profile, or None (no node names its GPU and no default is configured)."""
    source: str
    """Where it comes from, for messages: the node label or the operator default."""


@dataclasses.dataclass(frozen=True)
class Admitted:
    """The job fits every GPU it may be placed on."""

    choice: Choice
    """The profile judged by, and where it came from (``status.plan.profileSource``)."""
    summary: dict[str, Any]
    """``status.plan``: the planner's key numbers (``admission.status_summary``) and ``profileSource``."""


@dataclasses.dataclass(frozen=True)
class Refused:
    """The job's worst rank needs more memory than the GPU has."""

    choice: Choice
    """The profile judged by, and where it came from (``status.plan.profileSource``)."""
    reason: str
    """Condition reason: ``WontFit``."""
    message: str
    """The planner's message with the numbers, and where the profile comes from."""
    summary: dict[str, Any]
    """``status.plan`` of the refused job (``fits`` is false), so the numbers stay visible."""


def candidates(
    spec: api_spec.TrainingJobSpec, nodes: Sequence[placement.Node]
) -> list[placement.Node]:
    """Nodes matching the job's node selector and required node affinity
    (``podTemplateOverride``) that offer at least one GPU of its resource.

    Cordoned nodes count: their hardware is what it is.
    """
    selector = tuple(spec.resources.node_selector.items())
    terms = node_affinity.required_terms({"spec": spec.pod_template_override.spec})
    return [
        node
        for node in nodes
        if node.allocatable_gpus > 0
        and all(node.labels.get(key) == value for key, value in selector)
        and (
            not terms
            or node_affinity.any_term_matches(
                terms, {"metadata": {"name": node.name, "labels": node.labels}}
            )
        )
    ]


def choose_profile(
    node_profiles: Sequence[tuple[str, admission.NodeProfile | None]],
    default: profiles.Profile | None,
) -> Choice:
    """The GPU with the least memory for tensors among ``(node name, its profile)`` candidates,
    else ``default`` (no candidate names a GPU).

    Placement may use any candidate, so the job must fit the smallest.  Each node's profile is
    :func:`meshtrain.planner.admission.node_profile`: its product's, or the operator's default
    (``--gpu-profile``), at the memory the node's labels report.

    Ties on memory go to the profile name, then the node name, so the answer
    does not depend on the order nodes are listed in.
    """
    known = [
        (p.profile.tensor_memory_bytes, p.profile.name, node, p)
        for node, p in node_profiles
        if p is not None
    ]
    if known:
        _, _, node, smallest = min(known, key=lambda item: item[:3])
        kinds = sorted({item[1] for item in known})
        others = f" (smallest of {', '.join(kinds)})" if len(kinds) > 1 else ""
        return Choice(smallest.profile, f"node {node}: {smallest.why}{others}")
    if default is not None:
        return Choice(
            default,
            f"operator default --gpu-profile {default.name}: "
            f"no candidate node names a known GPU in {admission.PRODUCT_LABEL}",
        )
    return Choice(
        None,
        f"no candidate node names a known GPU in {admission.PRODUCT_LABEL} and --gpu-profile is none",
    )


def admit(spec: api_spec.TrainingJobSpec, choice: Choice) -> Admitted | Refused | None:
    """Judge ``spec`` on ``choice``'s profile; None when there is no profile or the program is the
    user's own (meshtrain knows neither its model nor its memory: nothing is checked)."""
    if choice.profile is None or spec.trainer.type == "custom":
        return None
    summary = {
        **admission.status_summary(estimate.make_plan(spec, choice.profile)),
        "profileSource": choice.source,
    }
    verdict = admission.check(spec, choice.profile)
    if verdict is None:
        return Admitted(choice=choice, summary=summary)
    return Refused(
        choice=choice,
        reason=verdict.reason,
        message=f"{verdict.message} (profile from {choice.source}{_file_of(choice.profile)})",
        summary=summary,
    )


def _file_of(profile: profiles.Profile) -> str:
    """Where a profile that is not built in was read from (a calibrated one the chart mounted)."""
    if not profile.path or profiles.is_builtin(profile):
        return ""
    return f", read from {profile.path}"
