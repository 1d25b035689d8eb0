"""Every rule of a TrainingJob, gathered from where each is stated, and the checks that apply them.

Each rule (:class:`~meshtrain.api.spec.base.Rule`) sits beside the section it judges, or in
:mod:`meshtrain.api.spec.cross_section` when it reads several; this module lists them, judges a
spec against all of them and holds the rules on ``metadata.name``.  The Python check sees the
resolved model shape (presets included); the CEL form in the CRD judges only explicit model
fields, so the operator checks preset-based shapes and reports the same message in the status.
Single-field constraints (minimums, enums) are on the models.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

import pydantic

from meshtrain.api import elastic
from meshtrain.api.spec import (
    TrainingJobSpec,
    base,
    checkpoint,
    cross_section,
    model,
    parallelism,
    pod,
    pod_template,
    resources,
    run_policy,
    topology,
    trainer,
    training,
)


class Problem(pydantic.BaseModel):
    """One broken rule: the field path, and a message with the values and the fix."""

    model_config = pydantic.ConfigDict(frozen=True)

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}"


SHAPE_RULE: base.Rule[TrainingJobSpec] = model.SHAPE_RULE.within(lambda spec: spec.model)
"""The model-shape rule on the whole spec: judged first, alone when broken (the others read the shape)."""

QUANTITY_RULES: tuple[base.Rule[TrainingJobSpec], ...] = tuple(
    rule.within(lambda spec: spec.resources) for rule in resources.RULES
)
"""The resources section's rules: quantities the pods carry and the GPUs left to gpusPerNode."""

RULES: tuple[base.Rule[TrainingJobSpec], ...] = (
    *cross_section.RULES,
    elastic.MIN_KEEPS_BATCH,
    *(rule.within(lambda spec: spec.parallelism) for rule in parallelism.RULES),
    *(rule.within(lambda spec: spec.checkpoint) for rule in checkpoint.RULES),
    *(rule.within(lambda spec: spec.model) for rule in model.RULES),
    *(rule.within(lambda spec: spec.training) for rule in training.RULES),
    *(rule.within(lambda spec: spec.run_policy) for rule in run_policy.RULES),
    *(rule.within(lambda spec: spec.trainer) for rule in trainer.RULES),
    *(rule.within(lambda spec: spec.pod) for rule in pod.RULES),
    *(rule.within(lambda spec: spec.topology) for rule in topology.RULES),
    *(rule.within(lambda spec: spec.pod_template_override.metadata) for rule in pod_template.RULES),
    *QUANTITY_RULES,
)
"""Every rule but :data:`SHAPE_RULE`, in the order their problems are listed."""

MAX_NAME_LENGTH = 40
"""Longest TrainingJob name: pod names ``<job>-r<restarts>-<index>`` are pod hostnames and must
stay inside the 63-character DNS label limit."""
DNS_1035_LABEL = "^[a-z]([-a-z0-9]*[a-z0-9])?$"
"""A Service name (the job's headless Service is named like the job): a DNS-1035 label."""


@dataclasses.dataclass(frozen=True)
class NameRule:
    """A rule on metadata.name, judged by CEL at the root of the object and by Python."""

    name: str
    """Short identifier used in tests and docs."""
    cel: str
    """CEL over the whole object (``self.metadata.name``)."""
    message: str
    """What the API server and the Python check print."""
    check: Callable[[str], bool]
    """True when the name keeps the rule."""


NAME_RULES: tuple[NameRule, ...] = (
    NameRule(
        "name-length",
        f"size(self.metadata.name) <= {MAX_NAME_LENGTH}",
        f"metadata.name must be at most {MAX_NAME_LENGTH} characters (pod hostnames "
        "<name>-r<restarts>-<index> must fit a DNS label)",
        lambda name: len(name) <= MAX_NAME_LENGTH,
    ),
    NameRule(
        "name-dns-1035-label",
        f"self.metadata.name.matches('{DNS_1035_LABEL}')",
        "metadata.name must be a DNS-1035 label: lower-case letters, digits and '-', starting "
        "with a letter and ending with a letter or digit (it names the job's headless Service); "
        "e.g. llama-7b-run2, not llama.7b or 7b-run",
        lambda name: re.fullmatch(DNS_1035_LABEL.strip("^$"), name) is not None,
    ),
)


def check_name(name: str) -> list[Problem]:
    """Every rule ``metadata.name`` breaks, each with the message the API server gives."""
    return [
        Problem(path="metadata.name", message=f"{rule.message}; got {name!r}")
        for rule in NAME_RULES
        if not rule.check(name)
    ]


def check(spec: TrainingJobSpec) -> list[Problem]:
    """Every broken rule of ``spec`` (empty when valid)."""
    shape_message = SHAPE_RULE.check(spec)
    if shape_message:
        return [Problem(path=SHAPE_RULE.path, message=shape_message)]
    problems = []
    for rule in RULES:
        message = rule.check(spec)
        if message:
            problems.append(Problem(path=rule.path, message=message))
    return problems
