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

Judged = TypeVar("Judged")
Whole = TypeVar("Whole")


class SpecModel(pydantic.BaseModel):
    """Base for every spec and status section: camelCase in YAML, frozen, no unknown keys."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        frozen=True,
        extra="forbid",
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
