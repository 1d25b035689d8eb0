"""The TrainingJob CustomResourceDefinition, generated from the spec and status models and the rules.

The models' pydantic JSON schemas become a structural OpenAPI v3 schema (:func:`model_schema`)
and every rule of :mod:`meshtrain.api.rules` a CEL ``x-kubernetes-validations`` entry.
``python -m meshtrain.api.crd`` (or ``meshtrain crd``) prints the YAML checked in at
``manifests/crd/trainingjobs.meshtrain.io.yaml``; a unit test fails when the two drift.
"""

from __future__ import annotations

import copy
import sys
from typing import Any

import pydantic
import yaml

from meshtrain.api import rules, spec
from meshtrain.api.spec import base, status

CRD_NAME = f"{spec.PLURAL}.{spec.API_GROUP}"
"""metadata.name of the CRD: plural.group."""


_KEEP = (
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "maxProperties",
    "pattern",
    "minItems",
    "maxItems",
    "format",
)
"""JSON-schema keywords carried over unchanged (after :func:`_structural`'s rewrites)."""


def _resolve(node: Any, defs: dict[str, Any]) -> Any:
    """Inline every ``$ref`` of ``node`` (siblings of a ref override the target)."""
    if isinstance(node, list):
        return [_resolve(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        siblings = {k: v for k, v in node.items() if k != "$ref"}
        target.update(siblings)
        return _resolve(target, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        merged = dict(node["allOf"][0])
        merged.update({k: v for k, v in node.items() if k != "allOf"})
        return _resolve(merged, defs)
    return {key: _resolve(value, defs) for key, value in node.items()}


def _structural(node: dict[str, Any]) -> dict[str, Any]:
    """One resolved JSON-schema node -> one structural OpenAPI v3 node."""
    node = dict(node)
    nullable = False
    if "anyOf" in node:
        options = [o for o in node.pop("anyOf") if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(
                f"cannot express anyOf with {len(options)} non-null options structurally: {options}"
            )
        nullable = True
        inner = dict(options[0])
        inner.update(
            {k: v for k, v in node.items() if k not in inner or k in ("description", "default")}
        )
        node = inner
    out: dict[str, Any] = {}
    for key in _KEEP:
        if key in node and not (key == "default" and node[key] is None):
            out[key] = node[key]
    if "enum" in out and "type" not in out:
        kinds = {type(v) for v in out["enum"]}
        out["type"] = "integer" if kinds == {int} else "string"
    if "exclusiveMinimum" in out and not isinstance(out["exclusiveMinimum"], bool):
        out["minimum"], out["exclusiveMinimum"] = out["exclusiveMinimum"], True
    if "exclusiveMaximum" in out and not isinstance(out["exclusiveMaximum"], bool):
        out["maximum"], out["exclusiveMaximum"] = out["exclusiveMaximum"], True
    if nullable:
        out["nullable"] = True
    if out.get("type") == "object" or "properties" in node:
        out["type"] = "object"
        if "properties" in node:
            out["properties"] = {name: _structural(sub) for name, sub in node["properties"].items()}
            if node.get("required"):
                out["required"] = list(node["required"])
        extra = node.get("additionalProperties")
        if isinstance(extra, dict):
            if extra:
                out["additionalProperties"] = _structural(extra)
            else:
                out["x-kubernetes-preserve-unknown-fields"] = True
        elif extra is True or ("properties" not in node and extra is None):
            out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("type") == "array":
        out["items"] = _structural(node["items"])
    return out


def _factory_defaults(model: type[pydantic.BaseModel], schema: dict[str, Any]) -> None:
    """Write each ``default_factory`` value of ``model`` (recursively) into ``schema``."""
    for name, field in model.model_fields.items():
        alias = field.alias or name
        prop = schema.get("properties", {}).get(alias)
        if prop is None:
            continue
        if field.default_factory is not None and "default" not in prop:
            value = field.default_factory()  # type: ignore[call-arg]
            if isinstance(value, pydantic.BaseModel):
                prop["default"] = value.model_dump(by_alias=True, exclude_none=True, mode="json")
            else:
                prop["default"] = value
        annotation = field.annotation
        sub_models = [
            a
            for a in getattr(annotation, "__args__", (annotation,))
            if isinstance(a, type) and issubclass(a, pydantic.BaseModel)
        ]
        if sub_models and prop.get("type") == "object":
            _factory_defaults(sub_models[0], prop)
        elif prop.get("type") == "array":
            item_models = [
                a
                for a in getattr(annotation, "__args__", ())
                if isinstance(a, type) and issubclass(a, pydantic.BaseModel)
            ]
            if item_models:
                _factory_defaults(item_models[0], prop["items"])


def model_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """Structural OpenAPI v3 schema of a pydantic model (camelCase field names).

    From pydantic's JSON Schema 2020-12 to Kubernetes' structural schema:

    * ``$ref``/``$defs`` are inlined (structural schemas have no references);
    * ``anyOf: [X, {type: null}]`` becomes ``X`` with ``nullable: true``;
    * ``exclusiveMinimum: n`` becomes ``minimum: n`` + ``exclusiveMinimum: true``;
    * a field built by ``default_factory`` gets the factory's whole value as
      ``default`` so the API server fills every default (CEL rules then read
      them; it validates a default against the rules as written, without
      filling nested defaults first);
    * ``title``, ``additionalProperties: false`` and null defaults are dropped
      (unknown fields are pruned by the server, and refused by ``kubectl apply``
      with server-side field validation);
    * ``dict[str, Any]`` becomes ``x-kubernetes-preserve-unknown-fields: true``,
      the only place the schema is open.
    """
    raw = model.model_json_schema(by_alias=True)
    defs = raw.pop("$defs", {})
    schema = _structural(_resolve(raw, defs))
    _factory_defaults(model, schema)
    return schema


def _field_path(rule_path: str, root: str) -> str:
    """Rule path such as ``spec.parallelism.tensor`` -> CEL fieldPath relative to ``root``."""
    relative = rule_path.removeprefix(root)
    return relative if relative.startswith(".") else ""


def _validation(rule: base.Rule[Any], root: str) -> dict[str, Any]:
    entry: dict[str, Any] = {"rule": rule.cel, "message": rule.cel_message}
    field_path = _field_path(rule.path, root)
    if field_path:
        entry["fieldPath"] = field_path
        entry["reason"] = "FieldValueInvalid"
    return entry


MODEL_IMMUTABLE = {
    "rule": "self == oldSelf",
    "message": "spec.model is immutable: a checkpoint of one model shape cannot resume another; "
    "create a new TrainingJob (any other spec change rebuilds the gang and resumes from the last checkpoint)",
}
"""Transition rule on ``spec.model`` (checked on update only)."""


def _describe_rules(schema: dict[str, Any], judged: tuple[base.Rule[Any], ...]) -> None:
    """Append each rule's message to the description of the field at its path (``Rule: ...``).

    So a model's field descriptions never state a rule again.
    """
    for rule in judged:
        node = schema
        for name in rule.path.removeprefix("spec").strip(".").split("."):
            if name:
                node = node["properties"][name]
        node["description"] = f"{node['description']} Rule: {rule.cel_message}."


def spec_schema() -> dict[str, Any]:
    """Schema of ``spec`` with every CEL-expressible rule attached."""
    schema = model_schema(spec.TrainingJobSpec)
    _describe_rules(schema, (rules.SHAPE_RULE, *rules.RULES))
    schema["x-kubernetes-validations"] = [_validation(r, "spec") for r in rules.RULES if r.cel]
    model_node = schema["properties"]["model"]
    model_node["x-kubernetes-validations"] = [
        _validation(rules.SHAPE_RULE, rules.SHAPE_RULE.path),
        MODEL_IMMUTABLE,
    ]
    return schema


def status_schema() -> dict[str, Any]:
    """Schema of ``status`` (written only by the operator through the status subresource)."""
    return model_schema(status.TrainingJobStatus)


def build() -> dict[str, Any]:
    """The whole CustomResourceDefinition object."""
    root = {
        "type": "object",
        "description": "A 3D-parallel (data x pipeline x tensor) training run placed by the meshtrain operator.",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string", "description": "meshtrain.io/v1alpha1."},
            "kind": {"type": "string", "description": "TrainingJob."},
            # maxLength bounds the cost of the CEL name rules below (253: the API's own limit)
            "metadata": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 253}},
            },
            # No default: the model's all-default spec breaks a rule (1 rank, 8 GPUs per pod),
            # and the API server checks a default against the CEL rules as written.
            "spec": spec_schema(),
            "status": status_schema(),
        },
        "x-kubernetes-validations": [
            {"rule": rule.cel, "message": rule.message} for rule in rules.NAME_RULES
        ],
    }
    columns = [
        {
            "name": "Phase",
            "type": "string",
            "jsonPath": ".status.phase",
            "description": "Lifecycle phase.",
        },
        {
            "name": "Layout",
            "type": "string",
            "jsonPath": ".status.layout",
            "description": "dp x pp x tp layout.",
        },
        {
            "name": "World",
            "type": "integer",
            "jsonPath": ".status.worldSize",
            "description": "Processes in the job, one GPU each.",
        },
        {
            "name": "Step",
            "type": "integer",
            "jsonPath": ".status.progress.step",
            "description": "Last completed optimizer step.",
        },
        {
            "name": "Restarts",
            "type": "integer",
            "jsonPath": ".status.restarts",
            "priority": 1,
            "description": "Gang restarts so far.",
        },
        {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {
            "name": CRD_NAME,
            "annotations": {
                "meshtrain.io/generated-by": "python -m meshtrain.api.crd (do not edit by hand)"
            },
        },
        "spec": {
            "group": spec.API_GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": spec.KIND,
                "listKind": f"{spec.KIND}List",
                "plural": spec.PLURAL,
                "singular": spec.KIND.lower(),
                "shortNames": [spec.SHORT_NAME],
                "categories": ["all", "meshtrain"],
            },
            "versions": [
                {
                    "name": spec.API_VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": columns,
                    "schema": {"openAPIV3Schema": root},
                }
            ],
        },
    }


def render() -> str:
    """The CRD as the YAML text that is checked in."""
    header = "# Generated by `python -m meshtrain.api.crd` from meshtrain/api/spec/ and rules.py; do not edit.\n"
    body: str = yaml.safe_dump(build(), sort_keys=False, allow_unicode=True, width=120)
    return header + body


def main(argv: list[str] | None = None) -> int:
    """Print the CRD YAML to stdout."""
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
