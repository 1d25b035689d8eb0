"""The generated TrainingJob CRD: drift, structure, descriptions, defaults and rules."""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from meshtrain.api import crd, limits, rules, spec
from meshtrain.api.spec import kube_names
from meshtrain.cli import main


def _root() -> dict[str, Any]:
    return crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}{{}}")


def _apply_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's structural defaulting does (enough for this schema)."""
    if isinstance(value, dict) and "properties" in schema:
        for name, sub in schema["properties"].items():
            if name not in value and "default" in sub:
                value[name] = yaml.safe_load(yaml.safe_dump(sub["default"]))
            if name in value:
                value[name] = _apply_defaults(sub, value[name])
    if isinstance(value, list) and "items" in schema:
        return [_apply_defaults(schema["items"], item) for item in value]
    return value


def test_every_spec_and_status_field_has_a_description():
    root = _root()
    for section in ("spec", "status"):
        missing = [
            path
            for path, node in _walk(root["properties"][section], section)
            if not node.get("description") and not path.endswith("{}")
        ]  # map values are not fields
        assert not missing, f"fields without description: {missing}"


@pytest.mark.parametrize("section", ["spec", "status"])
def test_schema_is_structural(section):
    forbidden = {"$ref", "$defs", "anyOf", "oneOf", "allOf", "title"}
    for path, node in _walk(_root()["properties"][section], section):
        assert not forbidden & set(node), f"{path} keeps {forbidden & set(node)}"
        assert "type" in node, f"{path} has no type"
        assert node.get("additionalProperties") is not False, path
        if "default" in node:
            assert node["default"] is not None, path
        if node.get("exclusiveMinimum") is not None:
            assert node["exclusiveMinimum"] is True and "minimum" in node, path


def test_only_the_planner_plan_and_the_pod_template_preserve_unknown_fields():
    """The partial PodSpec of podTemplateOverride is kept as written (the API server validates the
    merged pod, issue #33); it is bounded by maxProperties and the model's size limit."""
    open_paths = [p for p, n in _walk(_root(), "") if n.get("x-kubernetes-preserve-unknown-fields")]
    assert open_paths == [".spec.podTemplateOverride.spec", ".status.plan"]
    pod_spec = _root()["properties"]["spec"]["properties"]["podTemplateOverride"]
    assert pod_spec["properties"]["spec"]["maxProperties"] == limits.MAX_LIST_LENGTH


def test_server_defaulting_of_an_empty_spec_equals_the_model_defaults():
    defaulted = _apply_defaults(_root()["properties"]["spec"], {})
    expected = spec.TrainingJobSpec().model_dump(by_alias=True, exclude_none=True, mode="json")
    assert defaulted == expected


def test_enums_minimums_and_nullables_come_from_the_model():
    props = _root()["properties"]["spec"]["properties"]
    assert props["parallelism"]["properties"]["schedule"]["enum"] == [
        "gpipe",
        "1f1b",
        "interleaved-1f1b",
    ]
    assert props["parallelism"]["properties"]["zeroStage"]["enum"] == [0, 1, 2, 3]
    assert props["parallelism"]["properties"]["zeroStage"]["type"] == "integer"
    assert props["parallelism"]["properties"]["data"]["minimum"] == 1
    assert props["metrics"]["properties"]["port"]["maximum"] == 65535
    assert props["training"]["properties"]["globalBatch"]["nullable"] is True
    assert props["training"]["properties"]["learningRate"] == {
        **props["training"]["properties"]["learningRate"],
        "minimum": 0,
        "exclusiveMinimum": True,
    }
    # a node selector's values are label values (issue #32: the API server refuses others in every pod)
    assert props["resources"]["properties"]["nodeSelector"]["additionalProperties"] == {
        "type": "string",
        "maxLength": 63,
        "pattern": kube_names.LABEL_VALUE,
    }


def test_every_cel_rule_is_attached_with_its_message_and_field_path():
    spec_node = _root()["properties"]["spec"]
    attached = {v["rule"]: v for v in spec_node["x-kubernetes-validations"]}
    for rule in rules.RULES:
        if rule.cel is None:
            continue
        assert attached[rule.cel]["message"] == rule.cel_message
        assert attached[rule.cel]["fieldPath"] == rule.path.removeprefix("spec")
    model_rules = spec_node["properties"]["model"]["x-kubernetes-validations"]
    assert model_rules == [
        {"rule": rules.SHAPE_RULE.cel, "message": rules.SHAPE_RULE.cel_message},
        crd.MODEL_IMMUTABLE,
    ]


def test_every_rule_is_stated_in_the_description_of_its_field_once():
    spec_node = _root()["properties"]["spec"]
    for rule in (rules.SHAPE_RULE, *rules.RULES):
        node = spec_node
        for name in rule.path.split(".")[1:]:  # paths start at spec
            node = node["properties"][name]
        assert node["description"].count(f"Rule: {rule.cel_message}.") == 1, rule.name


def test_names_subresource_and_printer_columns():
    crd_spec = crd.build()["spec"]
    assert crd_spec["names"]["shortNames"] == ["tj"]
    assert crd_spec["names"]["kind"] == "TrainingJob"
    version = crd_spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Phase"] == ".status.phase"
    assert columns["Layout"] == ".status.layout"
    assert columns["Step"] == ".status.progress.step"
    assert columns["Age"] == ".metadata.creationTimestamp"


def test_meshtrain_crd_command_prints_the_same_yaml(capsys):
    assert main.main(["crd"]) == 0
    assert capsys.readouterr().out == crd.render()
