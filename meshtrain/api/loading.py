"""Reading a TrainingJob: from a dict, a whole object, a YAML file or ``--set`` overrides.

Every entry point returns a :class:`~meshtrain.api.spec.TrainingJobSpec` that
passed both the model's field checks and every rule of :mod:`meshtrain.api.rules`,
or raises :class:`SpecError` listing each problem with its YAML field path.

A file is read as hostile input: its size, nesting and alias expansion are bounded
(:mod:`meshtrain.api.limits`) before anything is built from it, a duplicate key is an
error rather than a silent overwrite, and a message quotes only a bounded part of it.
"""

from __future__ import annotations

import re
import typing
from pathlib import Path
from typing import Any

import pydantic
import yaml
from pydantic.alias_generators import to_camel

from meshtrain.api import limits, rules, suggest
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import base, kube_names

MAX_LISTED = 20
"""Problems a :class:`SpecError` lists one by one; the rest are counted."""


class SpecError(ValueError):
    """A spec that breaks one or more rules; ``problems`` lists every one."""

    def __init__(self, problems: list[rules.Problem], source: str = "spec") -> None:
        self.problems = problems
        self.source = source
        lines = "\n".join(f"  - {p}" for p in problems[:MAX_LISTED])
        if len(problems) > MAX_LISTED:
            lines += f"\n  - ... and {len(problems) - MAX_LISTED} more"
        super().__init__(
            f"{source} is not a valid TrainingJob ({len(problems)} problem(s)):\n{lines}"
        )


def _refused(source: str, message: str) -> SpecError:
    return SpecError([rules.Problem(path=source, message=message)], source)


class _BoundedLoader(yaml.SafeLoader):  # type: ignore[misc]  # PyYAML ships no types
    """PyYAML's safe loader, refusing duplicate keys and nesting deeper than the limit."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent: yaml.Node | None, index: object) -> yaml.Node:
        self.depth += 1
        try:
            if self.depth > limits.MAX_DOCUMENT_DEPTH:
                raise yaml.YAMLError(
                    f"nested deeper than {limits.MAX_DOCUMENT_DEPTH} mappings or lists "
                    f"(line {self.peek_event().start_mark.line + 1}); a TrainingJob nests six deep"
                )
            node: yaml.Node = super().compose_node(parent, index)
            return node
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[tuple[str, str], int] = {}
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                key = (key_node.tag, key_node.value)
                line = key_node.start_mark.line + 1
                if key in seen:
                    raise yaml.YAMLError(
                        f"duplicate key {base.quoted(key_node.value)} at line {line} "
                        f"(first at line {seen[key]}): YAML keeps only the last, so say it once"
                    )
                seen[key] = line
        mapping: dict[Any, Any] = super().construct_mapping(node, deep)
        return mapping


class _Dumper(yaml.SafeDumper):  # type: ignore[misc]  # PyYAML ships no types
    """PyYAML's safe dumper, quoting every string the bounded loader would read as a number."""


for _reader_or_writer in (_BoundedLoader, _Dumper):
    _reader_or_writer.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
        list("-+.0123456789"),
    )
"""``3e-4`` is a number, as kubectl's YAML 1.2 reader and every user read it (PyYAML's YAML 1.1
wants ``3.0e-4`` and would read a string); so the dumper quotes a string ``1e5``."""


def dump_yaml(document: object) -> str:
    """``document`` as YAML that :func:`load_yaml` reads back unchanged (keys in order)."""
    text: str = yaml.dump(document, Dumper=_Dumper, sort_keys=False, allow_unicode=True)
    return text


def _json_numbers(node: Any) -> Any:
    """``node`` with every integral float as an int: the API server reads ``2.0`` as the integer
    2 (JSON has one number type), so ``data: 2.0`` is a degree and ``2.5`` is not."""
    if isinstance(node, float) and node.is_integer():
        return int(node)
    if isinstance(node, dict):
        return {key: _json_numbers(value) for key, value in node.items()}
    if isinstance(node, list):
        return [_json_numbers(value) for value in node]
    return node


def _expanded_nodes(root: yaml.Node, budget: int) -> int:
    """Nodes of ``root`` with its aliases expanded, counted up to ``budget + 1`` (stops there)."""
    stack, count = [root], 0
    while stack and count <= budget:
        node = stack.pop()
        count += 1
        if isinstance(node, yaml.MappingNode):
            stack.extend(part for pair in node.value for part in pair)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return count


TOO_MANY_NODES = (
    f"more than {limits.MAX_DOCUMENT_NODES} values once its aliases (*name) are expanded: "
    "an alias bomb, or far more than a TrainingJob holds; write the values out"
)


def _read_text(path: Path) -> str:
    """The file's text, at most MAX_DOCUMENT_BYTES of UTF-8."""
    source = str(path)
    with path.open("rb") as file:
        data = file.read(limits.MAX_DOCUMENT_BYTES + 1)
    if len(data) > limits.MAX_DOCUMENT_BYTES:
        raise _refused(
            source, f"larger than {limits.MAX_DOCUMENT_BYTES} bytes: a TrainingJob is a few KiB"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise _refused(
            source, f"not UTF-8 text (byte {err.start}): a TrainingJob is a YAML text file"
        ) from None


def _yaml_message(err: BaseException) -> str:
    """A YAML error in one line: ``line 25, column 11: expected ',' or ']', but got ':' (while
    parsing a flow sequence at line 24, column 12)``; other errors as they read."""
    mark = getattr(err, "problem_mark", None)
    if not isinstance(err, yaml.MarkedYAMLError) or mark is None:
        return str(err)
    message = f"line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
    if err.context:
        context = err.context_mark
        where = f" at line {context.line + 1}, column {context.column + 1}" if context else ""
        message += f" ({err.context}{where})"
    return message


def load_yaml(text: str, source: str = "spec") -> Any:
    """One YAML document, bounded: no duplicate keys, nesting or alias expansion past the limits."""
    [document] = _documents(text, source, single=True) or [None]
    return document


def load_yaml_documents(text: str, source: str = "spec") -> list[Any]:
    """Every YAML document of ``text`` (``---``-separated), bounded as :func:`load_yaml` is: at most
    :data:`~meshtrain.api.limits.MAX_YAML_DOCUMENTS`, their nodes counted together."""
    return _documents(text, source, single=False)


def _documents(text: str, source: str, *, single: bool) -> list[Any]:
    if len(text) > limits.MAX_DOCUMENT_BYTES:
        raise _refused(source, f"longer than {limits.MAX_DOCUMENT_BYTES} characters")
    loader = _BoundedLoader(text)
    loader.name = source  # PyYAML's marks name the stream: the file, not "<unicode string>"
    documents: list[Any] = []
    try:
        nodes = [loader.get_single_node()] if single else _nodes(loader, source)
        counted = 0
        for node in (n for n in nodes if n is not None):
            counted += _expanded_nodes(node, limits.MAX_DOCUMENT_NODES - counted)
            if counted > limits.MAX_DOCUMENT_NODES:  # every document's together
                raise _refused(source, TOO_MANY_NODES)
            documents.append(loader.construct_document(node))
        return documents
    except (yaml.YAMLError, ValueError, RecursionError, OverflowError) as err:
        if isinstance(err, SpecError):
            raise
        message = _yaml_message(err)
        if len(message) > 4 * limits.MAX_QUOTED:
            message = message[: 4 * limits.MAX_QUOTED] + " ..."
        raise _refused(source, f"not valid YAML: {message}") from None
    finally:
        loader.dispose()


def _nodes(loader: _BoundedLoader, source: str) -> list[yaml.Node]:
    """The documents' nodes, at most MAX_YAML_DOCUMENTS (empty ones, a trailing ``---``, dropped)."""
    nodes: list[yaml.Node] = []
    loader.get_event()  # the stream's start
    while not loader.check_event(yaml.StreamEndEvent):
        if len(nodes) >= limits.MAX_YAML_DOCUMENTS:
            raise _refused(
                source, f"more than {limits.MAX_YAML_DOCUMENTS} YAML documents: split the file"
            )
        nodes.append(loader.compose_document())
    loader.get_event()
    return nodes


def _location(loc: tuple[int | str, ...]) -> str:
    """Pydantic error location -> a YAML field path such as spec.parallelism.microBatches.

    Pydantic names fields by their aliases (the YAML's camelCase) and keys as written, so a
    key is printed as the user wrote it, as the API server prints it: an unknown
    ``micro_batches`` is not shown as ``microBatches``."""
    parts = ["spec"]
    for item in loc:
        if isinstance(item, int):
            parts[-1] += f"[{item}]"
        elif item not in ("function-after", "literal"):
            name = str(item)
            parts.append(name if len(name) <= limits.MAX_QUOTED else base.quoted(name))
    return ".".join(parts)


FIXES = {
    "less_than_equal": "lower it: the limit keeps one job from stalling a shared operator",
    "int_type": "write a whole number without quotes or a decimal point",
    "float_type": "write a number without quotes",
    "bool_type": "write true or false without quotes",
    "string_type": "write a string (quote it if YAML reads it as something else)",
    "finite_number": "write a finite number (not .inf or .nan)",
}
"""The fix a pydantic error type calls for, added to its message."""


MAX_LISTED_FIELDS = 12
"""Known fields an unknown one's message lists when none is close enough to suggest."""


def _model_in(annotation: Any) -> type[pydantic.BaseModel] | None:
    """The spec model a field's annotation holds (through ``X | None``, lists and mappings)."""
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return annotation
    for inner in typing.get_args(annotation):
        model = _model_in(inner)
        if model is not None:
            return model
    return None


def known_fields(loc: tuple[int | str, ...]) -> list[str] | None:
    """The YAML names of the fields at the section ``loc`` (a pydantic location), in declared
    order; None where ``loc`` is no section of the spec model (a mapping such as nodeSelector)."""
    model: type[pydantic.BaseModel] = api_spec.TrainingJobSpec
    for item in loc:
        if isinstance(item, int):
            continue  # a list's index: its items are the field's model
        by_alias = {field.alias or name: field for name, field in model.model_fields.items()}
        inner = _model_in(by_alias[item].annotation) if item in by_alias else None
        if inner is None:
            return None
        model = inner
    return [field.alias or name for name, field in model.model_fields.items()]


def _unknown_field(loc: tuple[int | str, ...]) -> str:
    """An unknown field's message: the closest known names, else every known one (bounded)."""
    section = _location(loc[:-1])
    known = known_fields(loc[:-1])
    if not known:
        return f"unknown field: not permitted in {section}, which has no fields of its own"
    hint = suggest.did_you_mean(str(loc[-1]), known)
    if hint:
        return f"unknown field: not permitted in {section}; {hint}"
    listed = ", ".join(known[:MAX_LISTED_FIELDS]) + (
        " ..." if len(known) > MAX_LISTED_FIELDS else ""
    )
    return (
        f"unknown field: not permitted in {section}; remove it or use one of {listed} "
        f"(kubectl explain trainingjob.{section})"
    )


def _problem(error: Any) -> rules.Problem:
    """One pydantic error as a problem: the field, pydantic's message, the fix and a bounded quote.

    An unknown field says which known one is closest, not what it holds (a misspelt section's
    whole subtree is no part of the fix)."""
    if error["type"] == "extra_forbidden":
        return rules.Problem(path=_location(error["loc"]), message=_unknown_field(error["loc"]))
    fix = (
        FIXES.get(error["type"])
        or kube_names.PATTERN_HINTS.get((error.get("ctx") or {}).get("pattern", ""))
        or _enum_hint(error)
    )
    said = str(error["msg"]).removeprefix(VALUE_ERROR_PREFIX)  # a validator's own words stand alone
    got = f"(got {base.quoted(error.get('input'))})"
    message = f"{said}{f'; {fix}' if fix else ''}{'' if got in said else f' {got}'}"
    return rules.Problem(path=_location(error["loc"]), message=message)


VALUE_ERROR_PREFIX = "Value error, "
"""What pydantic puts before a validator's ValueError message (its words already name the fix)."""


def _enum_hint(error: Any) -> str:
    """``did you mean 1f1b?`` for a value outside a field's choices (``schedule: 1F1B``), else ''."""
    if error["type"] not in ("literal_error", "enum") or not isinstance(error.get("input"), str):
        return ""
    choices = re.findall(r"'([^']*)'", str((error.get("ctx") or {}).get("expected", "")))
    return suggest.did_you_mean(error["input"], choices)


def parse_spec(raw: object, source: str = "spec") -> api_spec.TrainingJobSpec:
    """Build a spec from a dict (the ``spec`` of a TrainingJob) and check every rule.

    Raises :class:`SpecError` listing all problems: type and range errors from
    the schema first, then the cross-field rules of :mod:`meshtrain.api.rules`.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        problem = f"must be a mapping of the spec's sections, got {base.quoted(raw)}"
        raise SpecError([rules.Problem(path="spec", message=problem)], source)
    try:
        # by alias only: the API server knows ``gpusPerNode``, never the Python name ``gpus_per_node``
        spec = api_spec.TrainingJobSpec.model_validate(
            _json_numbers(raw), by_alias=True, by_name=False
        )
    except pydantic.ValidationError as err:
        raise SpecError([_problem(e) for e in err.errors()], source) from None
    problems = rules.check(spec)
    if problems:
        raise SpecError(problems, source)
    return spec


OBJECT_FIELDS = ("apiVersion", "kind", "metadata", "spec", "status")
"""The top-level fields of a TrainingJob object; the API server refuses any other."""


def _unknown_top_level(document: dict[str, Any]) -> list[rules.Problem]:
    """A key beside apiVersion, kind, metadata, spec and status, with the closest of them."""
    problems = []
    for key in list(document)[: MAX_LISTED + 1]:
        if key not in OBJECT_FIELDS:
            hint = suggest.did_you_mean(str(key), OBJECT_FIELDS)
            where = str(key) if len(str(key)) <= limits.MAX_QUOTED else base.quoted(key)
            message = f"unknown field: not permitted in a TrainingJob; {hint or 'remove it'}"
            problems.append(rules.Problem(path=where, message=message))
    return problems


def _header_problems(document: dict[str, Any]) -> list[rules.Problem]:
    """kind, apiVersion, metadata.name and the top-level keys as the API server reads them."""
    group_version = f"{api_spec.API_GROUP}/{api_spec.API_VERSION}"
    problems = _unknown_top_level(document)
    if document.get("kind") != api_spec.KIND:
        got = base.quoted(document.get("kind"))
        problems.append(
            rules.Problem(path="kind", message=f"expected {api_spec.KIND!r}, got {got}")
        )
    if document.get("apiVersion") != group_version:
        got = base.quoted(document.get("apiVersion"))
        problems.append(
            rules.Problem(path="apiVersion", message=f"expected {group_version!r}, got {got}")
        )
    metadata = document.get("metadata")
    if metadata is None:
        return problems
    if not isinstance(metadata, dict):
        message = f"must be a mapping (name, namespace, labels), got {base.quoted(metadata)}"
        return [*problems, rules.Problem(path="metadata", message=message)]
    name = metadata.get("name")
    if "name" in metadata and not isinstance(name, str):
        message = f"must be a string such as my-run, got {base.quoted(name)}"
        return [*problems, rules.Problem(path="metadata.name", message=message)]
    return [*problems, *(rules.check_name(name) if isinstance(name, str) else [])]


def parse_manifest(
    document: dict[str, Any], source: str = "manifest"
) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """Validate a whole TrainingJob object; returns (metadata, spec)."""
    header = _header_problems(document)
    if any(p.path in ("kind", "apiVersion", "metadata") for p in header):
        raise SpecError(header, source)
    try:
        spec = parse_spec(document.get("spec"), source)
    except SpecError as err:
        raise SpecError([*header, *err.problems], source) from None
    if header:
        raise SpecError(header, source)
    return document.get("metadata") or {}, spec


def _readable(path: Path) -> None:
    """Refuse a path that is no file, saying what it is instead."""
    if path.is_dir():
        message = "is a directory, not a file: name the TrainingJob YAML file in it"
        raise SpecError([rules.Problem(path=str(path), message=message)], str(path))
    if not path.is_file():
        raise SpecError([rules.Problem(path=str(path), message="file not found")], str(path))


def from_document(
    document: Any, source: str = "manifest"
) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """A parsed YAML document as a TrainingJob: the whole object, or just its spec."""
    if not isinstance(document, dict):
        raise SpecError(
            [rules.Problem(path=source, message="expected a YAML mapping (a TrainingJob)")], source
        )
    if "kind" in document or "apiVersion" in document:
        return parse_manifest(document, source)
    return {}, parse_spec(document, source)


def load_manifest(path: str | Path) -> tuple[dict[str, Any], api_spec.TrainingJobSpec]:
    """Read a TrainingJob YAML file: the whole object, or just its spec."""
    path = Path(path)
    _readable(path)
    return from_document(load_yaml(_read_text(path), str(path)), str(path))


def load_documents(path: str | Path) -> list[Any]:
    """Every YAML document of a file (:func:`load_yaml_documents`; empty ones are None)."""
    path = Path(path)
    _readable(path)
    return load_yaml_documents(_read_text(path), str(path))


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
        node[keys[-1]] = load_yaml(value, "--set")
    return parse_spec(raw, "spec with --set overrides")
