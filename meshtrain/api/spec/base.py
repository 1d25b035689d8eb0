"""What every spec section is made of: the model base and the rule record.

A rule holds its Python check, its CEL expression and its message in one record,
so the operator, ``meshtrain validate`` and ``kubectl apply`` judge a job alike;
the CRD is generated from the records (:mod:`meshtrain.api.crd`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Generic, TypeVar

import pydantic
from pydantic import ConfigDict
from pydantic.alias_generators import to_camel

from meshtrain.api import limits

Judged = TypeVar("Judged")
Whole = TypeVar("Whole")


class StatusModel(pydantic.BaseModel):
    """Base for every status section: camelCase in YAML, frozen, no unknown keys."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
    )


class SpecModel(StatusModel):
    """Base for every spec section: as a status section, and strict as the API server is.

    A tenant writes the spec, so nothing is coerced: ``tensor: true`` or ``data: 2.0`` is
    not an integer, ``"1"`` not a number, ``.inf`` and ``.nan`` not a finite float, and no
    string is longer than :data:`~meshtrain.api.limits.MAX_STRING_LENGTH` unless its field
    says so (the CRD carries the same ``maxLength``).
    """

    model_config = ConfigDict(
        strict=True,
        allow_inf_nan=False,
        str_max_length=limits.MAX_STRING_LENGTH,
    )


@dataclasses.dataclass(frozen=True)
class Rule(Generic[Judged]):
    """A validation rule: its Python check, its CEL expression and its message together.

    A section's rule judges the section alone; a rule across sections judges the
    whole spec.  The CEL expression is always written over the whole spec (``self``
    is ``spec``), where the CRD attaches it; only the model-shape rule sits on
    ``spec.model``.  The CRD appends ``cel_message`` to the description of the field
    at ``path``, so a field's description never states a rule again.
    """

    name: str
    """Short identifier used in tests and docs."""
    path: str
    """Field the message points at (YAML path from ``spec``)."""
    cel: str | None
    """CEL expression for the CRD; None when only Python can judge it."""
    cel_message: str
    """Static message the API server prints when the CEL rule fails."""
    check: Callable[[Judged], str | None]
    """Returns a message with the values when the rule is broken, else None."""

    def within(self, part: Callable[[Whole], Judged]) -> Rule[Whole]:
        """This rule judging ``part(whole)``: a section's rule as a rule of the whole spec."""
        check = self.check
        return Rule(
            self.name, self.path, self.cel, self.cel_message, lambda whole: check(part(whole))
        )


def quoted(value: object) -> str:
    """``repr(value)``, elided to :data:`~meshtrain.api.limits.MAX_QUOTED` characters: an error
    message quotes a bounded part of what a user wrote, never the whole of a hostile input."""
    text = repr(value) if not isinstance(value, (dict, list)) else _shallow(value)
    if len(text) <= limits.MAX_QUOTED:
        return text
    return f"{text[: limits.MAX_QUOTED]}... ({len(text)} characters)"


def _shallow(value: dict[object, object] | list[object]) -> str:
    """A mapping or list named by its size, not walked (an alias bomb's expansion is huge)."""
    kind = "mapping" if isinstance(value, dict) else "list"
    return f"<a {kind} of {len(value)} item(s)>"
