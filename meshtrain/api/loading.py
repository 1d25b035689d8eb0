"""Reading a TrainingJob: from a dict, a whole object, a YAML file or ``--set`` overrides.

Every entry point returns a :class:`~meshtrain.api.spec.TrainingJobSpec` that
passed both the model's field checks and every rule of :mod:`meshtrain.api.rules`,
or raises :class:`SpecError` listing each problem with its YAML field path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic.alias_generators import to_camel

from meshtrain.api import rules
from meshtrain.api import spec as api_spec


class SpecError(ValueError):
    """A spec that breaks one or more rules; ``problems`` lists every one."""

    def __init__(self, problems: list[rules.Problem], source: str = "spec") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(
            f"{source} is not a valid TrainingJob ({len(problems)} problem(s)):\n{lines}"
        )


def _location(loc: tuple[int | str, ...]) -> str:
    """Pydantic error location -> a YAML field path such as spec.parallelism.microBatches."""
    parts = ["spec"]
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
        elif item not in ("function-after", "literal"):
            parts.append(to_camel(str(item)))
    return ".".join(parts)


def parse_spec(raw: dict[str, Any] | None, source: str = "spec") -> api_spec.TrainingJobSpec:
    """Build a spec from a dict (the ``spec`` of a TrainingJob) and check every rule.

    Raises :class:`SpecError` listing all problems: type and range errors from
    the schema first, then the cross-field rules of :mod:`meshtrain.api.rules`.
    """
    try:
        spec = api_spec.TrainingJobSpec.model_validate(raw or {})
    except pydantic.ValidationError as err:
        problems = [
            rules.Problem(path=_location(e["loc"]), message=f"{e['msg']} (got {e.get('input')!r})")
            for e in err.errors()
        ]
        raise SpecError(problems, source) from None
    problems = rules.check(spec)
    if problems:
        raise SpecError(problems, source)
    return spec


def parse_manifest(
    document: dict[str, Any], source: str = "manifest"
) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """Validate a whole TrainingJob object; returns (metadata, spec)."""
    kind = document.get("kind")
    if kind != api_spec.KIND:
        raise SpecError(
            [rules.Problem(path="kind", message=f"expected {api_spec.KIND!r}, got {kind!r}")],
            source,
        )
    api_version = document.get("apiVersion")
    if api_version != f"{api_spec.API_GROUP}/{api_spec.API_VERSION}":
        raise SpecError(
            [
                rules.Problem(
                    path="apiVersion",
                    message=f"expected '{api_spec.API_GROUP}/{api_spec.API_VERSION}', got {api_version!r}",
                )
            ],
            source,
        )
    metadata = document.get("metadata") or {}
    named = rules.check_name(str(metadata.get("name") or "")) if "name" in metadata else []
    try:
        spec = parse_spec(document.get("spec"), source)
    except SpecError as err:
        raise SpecError([*named, *err.problems], source) from None
    if named:
        raise SpecError(named, source)
    return metadata, spec


def load_manifest(path: str | Path) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """Read a TrainingJob YAML file: the whole object, or just its spec."""
    path = Path(path)
    if not path.is_file():
        raise SpecError([rules.Problem(path=str(path), message="file not found")], str(path))
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise SpecError(
            [rules.Problem(path=str(path), message=f"not valid YAML: {err}")], str(path)
        ) from None
    if not isinstance(document, dict):
        raise SpecError(
            [rules.Problem(path=str(path), message="expected a YAML mapping (a TrainingJob)")],
            str(path),
        )
    if "kind" in document:
        return parse_manifest(document, str(path))
    return {}, parse_spec(document, str(path))


def load_spec_file(path: str | Path) -> api_spec.TrainingJobSpec:
    """Read a TrainingJob (or a bare spec) from YAML and validate it."""
    return load_manifest(path)[1]


def apply_overrides(
    spec: api_spec.TrainingJobSpec, assignments: list[str]
) -> api_spec.TrainingJobSpec:
    """Apply ``path=value`` overrides (camelCase or snake_case, YAML values) and revalidate.

    ``apply_overrides(spec, ["training.steps=5", "parallelism.microBatches=4"])``
    """
    raw = spec.model_dump(by_alias=True, exclude_none=True)
    for assignment in assignments:
        if "=" not in assignment:
            raise SpecError(
                [
                    rules.Problem(
                        path=assignment,
                        message="override must look like path=value, e.g. training.steps=5",
                    )
                ],
                "--set",
            )
        dotted, value = assignment.split("=", 1)
        keys = [to_camel(k) for k in dotted.strip().removeprefix("spec.").split(".")]
        node = raw
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise SpecError(
                    [rules.Problem(path=dotted, message=f"{key} is not a section")], "--set"
                )
        node[keys[-1]] = yaml.safe_load(value)
    return parse_spec(raw, "spec with --set overrides")
