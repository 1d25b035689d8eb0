"""The podTemplateOverride examples of docs/operator.md are valid and build into the gang's pods
(their acceptance by the real API server: tests/integration/operator/test_operator_pod_template.py)."""

from __future__ import annotations

import pathlib
import textwrap
from typing import Any

import pytest
import yaml

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity, naming
from tests.builders import JobBuilder

DOC = pathlib.Path(__file__).parents[2] / "docs" / "operator.md"
REF = identity.JobRef(name="docs", namespace="research", uid="1234")


def docs_overrides() -> list[dict[str, Any]]:
    """Each podTemplateOverride of the documentation's indented YAML examples."""
    found, block = [], []
    for line in [*DOC.read_text().splitlines(), "end"]:
        if line.startswith("    ") or (block and not line.strip()):
            block.append(line)
            continue
        text = textwrap.dedent("\n".join(block))
        block = []
        if "podTemplateOverride:" in text:
            found.append(yaml.safe_load(text)["spec"]["podTemplateOverride"])
    return found


def docs_pods() -> list[dict[str, Any]]:
    """The pod the operator builds for a small job with each documented override."""
    pods = []
    for override in docs_overrides():
        job = JobBuilder().layout(data=2).gpus(1)
        job.pod_template(override.get("spec"), **override.get("metadata", {}))
        spec = loading.parse_spec(job.raw())
        pods.append(builders.build_pod(REF, spec, 0, 0, "node-a"))
    return pods


def test_the_four_examples_the_issue_asks_for_are_documented():
    overrides = docs_overrides()
    assert len(overrides) >= 4
    text = yaml.safe_dump(overrides)
    for words in ("persistentVolumeClaim", "k8s.v1.cni.cncf.io/networks", "restartPolicy: Always"):
        assert words in text, words


@pytest.mark.parametrize("index", range(4))
def test_each_documented_override_is_valid_and_reaches_the_pod(index):
    override = docs_overrides()[index]
    pod = docs_pods()[index]
    spec = pod["spec"]
    trainer = next(c for c in spec["containers"] if c["name"] == naming.CONTAINER)
    for volume in override.get("spec", {}).get("volumes", []):
        assert volume in spec["volumes"]
    for container in override.get("spec", {}).get("containers", []):
        if container["name"] == naming.CONTAINER:
            for mount in container.get("volumeMounts", []):
                assert mount in trainer["volumeMounts"]
    for sidecar in override.get("spec", {}).get("initContainers", []):
        assert sidecar in spec["initContainers"]
    for key, value in override.get("metadata", {}).get("annotations", {}).items():
        assert pod["metadata"]["annotations"][key] == value
