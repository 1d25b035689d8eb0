"""Node selector terms as kube-scheduler reads them, and the operator's pin of a pod to one node.

A gang pod's required node affinity is the job's own terms (``podTemplateOverride``) ANDed with
the pin to the node the operator planned: terms are ORed and the requirements within a term
ANDed, so the pin is appended to every term (``(A or B) and P == (A and P) or (B and P)``), last
in its ``matchFields``.  :func:`unpinned` takes it off again, giving what a placement must
honour on every node.  Pure; the matching is ``component-helpers/scheduling/corev1/nodeaffinity``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

NODE_NAME_FIELD = "metadata.name"
_INTEGER = re.compile(r"[+-]?[0-9]+")
"""What Go's ``strconv.ParseInt`` reads (Python's ``int`` also takes spaces and underscores)."""
_INT64 = 2**63


def _integer(text: str) -> int | None:
    if not _INTEGER.fullmatch(text):
        return None
    value = int(text)
    return value if -_INT64 <= value < _INT64 else None


def expression_matches(expression: Mapping[str, Any], value: str | None) -> bool:
    """One NodeSelectorRequirement against a label's (or field's) value, None when absent."""
    operator = expression.get("operator")
    values = [str(v) for v in expression.get("values") or []]
    if operator == "In":
        return value is not None and value in values
    if operator == "NotIn":
        return value is None or value not in values
    if operator == "Exists":
        return value is not None
    if operator == "DoesNotExist":
        return value is None
    if operator in ("Gt", "Lt") and value is not None and len(values) == 1:
        left, right = _integer(value), _integer(values[0])
        if left is None or right is None:
            return False
        return left > right if operator == "Gt" else left < right
    return False


def term_matches(term: Mapping[str, Any], node: Mapping[str, Any]) -> bool:
    """core/v1 NodeSelectorTerm: every expression and field holds (an empty term matches nothing)."""
    metadata = node.get("metadata") or {}
    labels = metadata.get("labels") or {}
    expressions = term.get("matchExpressions") or []
    fields = term.get("matchFields") or []
    if not expressions and not fields:
        return False
    return all(expression_matches(e, labels.get(e.get("key"))) for e in expressions) and all(
        f.get("key") == NODE_NAME_FIELD and expression_matches(f, metadata.get("name"))
        for f in fields
    )


def any_term_matches(terms: Sequence[Mapping[str, Any]], node: Mapping[str, Any]) -> bool:
    """A NodeSelector: the terms are ORed."""
    return any(term_matches(term, node) for term in terms)


def pin(node: str) -> dict[str, Any]:
    """The operator's requirement that a pod run on ``node`` alone."""
    return {"key": NODE_NAME_FIELD, "operator": "In", "values": [node]}


def pinned(terms: Sequence[Mapping[str, Any]], node: str) -> list[dict[str, Any]]:
    """``terms`` (none: any node) ANDed with the pin to ``node``."""
    requirement = pin(node)
    return [
        {**term, "matchFields": [*(term.get("matchFields") or []), requirement]}
        for term in (terms or [{}])
    ]


def required_terms(pod: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The pod's required node selector terms as written (empty: none)."""
    affinity = ((pod.get("spec") or {}).get("affinity") or {}).get("nodeAffinity") or {}
    required = affinity.get("requiredDuringSchedulingIgnoredDuringExecution") or {}
    return list(required.get("nodeSelectorTerms") or [])


def unpinned(terms: Sequence[Mapping[str, Any]]) -> tuple[Mapping[str, Any], ...]:
    """``terms`` less the pin :func:`pinned` appended (empty: the pod asks for no node but the pin).

    The pin is the last ``matchFields`` entry of every term, the same in each, on one node.
    """
    lasts = [(t.get("matchFields") or [None])[-1] for t in terms]
    first = lasts[0] if lasts else None
    if not (
        isinstance(first, Mapping)
        and first.get("key") == NODE_NAME_FIELD
        and first.get("operator") == "In"
        and len(first.get("values") or []) == 1
        and all(last == first for last in lasts)
    ):
        return tuple(terms)
    stripped = []
    for term in terms:
        rest = {k: v for k, v in term.items() if k != "matchFields"}
        fields = list(term.get("matchFields") or [])[:-1]
        if fields:
            rest["matchFields"] = fields
        stripped.append(rest)
    if all(not (t.get("matchExpressions") or t.get("matchFields")) for t in stripped):
        return ()
    return tuple(stripped)
