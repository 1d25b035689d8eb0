"""Job names and quantities: the API server (CEL at kubectl apply) and `meshtrain validate` agree, in the same words.

Each candidate is sent to the real API server (server-side dry run) and given to
the Python rules; both must accept it or both refuse it, and a refusal carries
the rule's message on both sides.  The CEL side is the truth for quantities:
``isQuantity`` is apimachinery's own parser.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import yaml

from meshtrain.api import loading, rules
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

BASE = JobBuilder("named", None).parallelism(data=2).manifest()
"""A valid job the candidates go into (no namespace: kubectl's -n)."""
NAMES = ["run-2", "a", "dotted.name", "Upper", "7b-run", "end-", "under_score", "x" * 40, "x" * 41]
QUANTITIES = [
    "1", "1.5", ".5", "5.", "100m", "16Gi", "1e3", "2E", "+1", "-1", "1e-3", "1E+3",
    "1.5.5", "1GB", "abc", "1 Gi", "1e", "0x10", "1ki", "", "Gi", "-", ".", "5n", "1u",
    "1k3", "1e3.5", "1Mi5",
]  # fmt: skip


def _server_accepts(cluster, namespace: str, body: dict) -> tuple[bool, str]:
    result = cluster.kubectl(  # JSON: YAML 1.2 would read 1e3 as a number
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=json.dumps(body)
    )
    return result.returncode == 0, result.stderr


def _python_accepts(body: dict) -> tuple[bool, str]:
    try:
        loading.parse_manifest(body)
    except loading.SpecError as err:
        return False, str(err)
    return True, ""


def _disagreements(
    cluster, namespace: str, candidates: list[str], path: tuple[str, ...], messages: list[str]
) -> tuple[dict, int]:
    """Candidates the server and the Python rules judge differently (or word differently), and the
    number the server refused."""
    wrong, refused = {}, 0
    for value in candidates:
        body = copy.deepcopy(BASE)
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        server, server_says = _server_accepts(cluster, namespace, body)
        python, python_says = _python_accepts(body)
        same_words = server or any(m in server_says and m in python_says for m in messages)
        if server != python or not same_words:
            wrong[value] = {
                "server": server_says or "accepted",
                "python": python_says or "accepted",
            }
        refused += not server
    return wrong, refused


def test_names_are_judged_alike(cluster, namespace):
    messages = [r.message for r in rules.NAME_RULES]
    wrong, refused = _disagreements(cluster, namespace, NAMES, ("metadata", "name"), messages)
    assert not wrong, wrong
    assert refused >= 5  # the cases do refuse


@pytest.mark.parametrize("field", ["cpu", "memory", "shmSize"])
def test_quantities_are_judged_alike(cluster, namespace, field):
    messages = [r.cel_message for r in rules.QUANTITY_RULES]
    path = ("spec", "resources", field)
    wrong, refused = _disagreements(cluster, namespace, QUANTITIES, path, messages)
    assert not wrong, wrong
    assert refused >= 5


def test_meshtrain_validate_prints_the_rule_message(tmp_path):
    body = copy.deepcopy(BASE)
    body["metadata"]["name"] = "dotted.name"
    body["spec"]["resources"]["memory"] = "1GB"
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(body))
    result = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert rules.NAME_RULES[1].message in result.stderr
    assert "resources.memory must be a Kubernetes quantity" in result.stderr
