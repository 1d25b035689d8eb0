"""Static checks of the Helm chart's values: every key commented, schema and values agree.

These run without helm; tests/integration/test_chart.py renders and installs
the chart against a real API server.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re

import yaml

from meshtrain.api import release
from meshtrain.planner import profiles

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "meshtrain"


def _values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict:
    return json.loads((CHART / "values.schema.json").read_text())


def _key_lines() -> list[tuple[int, str]]:
    lines = (CHART / "values.yaml").read_text().splitlines()
    return [(i, line) for i, line in enumerate(lines) if re.match(r"^\s*[A-Za-z][\w]*:", line)]


def test_every_values_key_has_a_comment_right_above_it() -> None:
    lines = (CHART / "values.yaml").read_text().splitlines()
    missing = [line.strip() for i, line in _key_lines() if not lines[i - 1].strip().startswith("#")]
    assert not missing, f"values.yaml keys without a comment line above them: {missing}"


def _walk_schema(schema: dict, values: dict, path: str = "") -> list[str]:
    problems = []
    props = schema.get("properties", {})
    for key, value in values.items():
        where = f"{path}.{key}" if path else key
        if key not in props:
            problems.append(f"{where}: in values.yaml but not in values.schema.json")
            continue
        sub = props[key]
        if "description" not in sub:
            problems.append(f"{where}: schema property without description")
        if isinstance(value, dict) and sub.get("properties"):
            problems.extend(_walk_schema(sub, value, where))
    for key in props:
        if key != "global" and key not in values:
            problems.append(f"{path}.{key}: in the schema but not in values.yaml")
    return problems


def test_schema_describes_exactly_the_values() -> None:
    assert _walk_schema(_schema(), _values()) == []


def test_schema_refuses_unknown_keys_and_bad_watch_modes() -> None:
    schema = _schema()
    assert schema["additionalProperties"] is False
    assert schema["properties"]["replicaCount"]["minimum"] == 0
    assert schema["properties"]["watch"]["properties"]["mode"]["enum"] == ["all", "namespaces"]
    # watch.mode "namespaces" with none listed: a sentence from templates/validate.yaml, not a
    # schema if/then (Helm would print "'allOf' failed"); tests/integration/test_chart_messages.py
    validate = (CHART / "templates" / "validate.yaml").read_text()
    assert 'eq $v.watch.mode "namespaces"' in validate and "watch.namespaces is empty" in validate


def _nodes(node: dict, path: str = "") -> list[tuple[str, dict]]:
    """Every subschema of the values schema with its path (properties, map values, list items)."""
    found = [(path, node)]
    for key, sub in node.get("properties", {}).items():
        found += _nodes(sub, f"{path}.{key}")
    for key, suffix in (("additionalProperties", ".*"), ("items", "[]")):
        if isinstance(node.get(key), dict):
            found += _nodes(node[key], path + suffix)
    return found


def test_every_schema_node_has_a_description_and_no_combinator() -> None:
    """Helm prints a combinator's failure as "'allOf' failed" with the real cause nested below it:
    cross-value rules live in templates/validate.yaml, which says them as a sentence."""
    nodes = _nodes(_schema())
    assert [path for path, node in nodes if path and "description" not in node] == []
    combinators = {"allOf", "anyOf", "oneOf", "not", "if", "then", "else"}
    assert [path for path, node in nodes if combinators & node.keys()] == []
    # A bound says itself and why in the description (Helm prints "maximum: got 9, want 5").
    bounds = {path: node for path, node in nodes if "maximum" in node}
    assert "replicaCount" in "".join(bounds)
    unexplained = [
        p
        for p, node in bounds.items()
        if f"{node['maximum']:,}" not in node["description"]
        and str(node["maximum"]) not in node["description"]
    ]
    assert unexplained == []


def test_defaults_are_least_surprise() -> None:
    values = _values()
    assert values["watch"]["mode"] == "all"
    assert values["monitoring"]["selectorLabels"] == {"release": "kube-prometheus-stack"}
    assert values["grafana"]["dashboards"]["label"] == "grafana_dashboard"
    assert values["grafana"]["dashboards"]["labelValue"] == "1"
    assert values["securityContext"]["runAsUser"] != 0


def test_chart_versions() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart["apiVersion"] == "v2"
    # One version: the package's (pyproject reads release.VERSION), the chart's and the
    # images' tags, so `make chart-package` never ships a chart naming images of another release.
    assert chart["appVersion"] == chart["version"] == release.VERSION, (
        "set Chart.yaml version and appVersion to release.VERSION"
    )


def test_a_profile_value_needs_what_the_profile_loader_needs() -> None:
    """operator.profiles entries are refused at install for the keys the operator would refuse:
    a missing required one, or one the loader does not know."""
    entry = _schema()["properties"]["operator"]["properties"]["profiles"]["additionalProperties"]
    assert set(entry["required"]) == {"name", "source", *profiles.REQUIRED_NUMBERS}
    loaded = {f.name for f in dataclasses.fields(profiles.Profile)} - {"path"}
    assert entry["additionalProperties"] is False and set(entry["properties"]) == loaded
