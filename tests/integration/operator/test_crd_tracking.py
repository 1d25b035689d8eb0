"""``spec.tracking``: the API server (the CRD's patterns and bounds, at kubectl apply) and
``meshtrain validate`` accept and refuse the same tracker URIs, folders and names."""

from __future__ import annotations

import copy
import json

import pytest

from meshtrain.api import limits, loading
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

BASE = JobBuilder("tracked", None).manifest()
CANDIDATES = {
    ("mlflow", "trackingUri"): [
        "http://mlflow.mlflow:5000",
        "https://m.example.com/p/",
        "http://[::1]:5000",
        "file:///var/mlruns",
        "http://user:pw@mlflow:5000",
        "databricks",
        "ftp://m/",
        "http://m/a b",
        "file:rel",
        "sqlite:////var/mlflow.db",
        "sqlite:///",
        "http://" + "a" * limits.MAX_URL_LENGTH,
    ],
    ("tensorboard", "logDir"): [
        "/tb",
        "/a/.b/..c/",
        "tb",
        "tb/run-1",
        "../tb",
        "/a/../b",
        "/a//b",
        "/a/./b",
        "/a\tb",
    ],
    ("mlflow", "experimentName"): ["sweep 1", "a\nb", "x" * (limits.MAX_TRACKER_NAME_LENGTH + 1)],
    ("wandb", "project"): ["p-1", "a/b", "a:b", "p" * (limits.MAX_WANDB_PROJECT_LENGTH + 1)],
    ("wandb", "entity"): ["team_1", "-team", "a b", "e" * (limits.MAX_WANDB_ENTITY_LENGTH + 1)],
}


def _python_accepts(body: dict) -> bool:
    try:
        loading.parse_manifest(body)
    except loading.SpecError:
        return False
    return True


@pytest.mark.parametrize(("section", "field"), list(CANDIDATES))
def test_tracking_fields_are_judged_alike(cluster, namespace, section, field):
    wrong, refused = {}, 0
    for value in CANDIDATES[(section, field)]:
        body = copy.deepcopy(BASE)
        body["spec"]["tracking"] = {section: {field: value}}
        result = cluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=json.dumps(body)
        )
        server = result.returncode == 0
        if server != _python_accepts(body):
            wrong[value[:60]] = result.stderr or "accepted by the server"
        refused += not server
    assert not wrong, wrong
    assert refused >= 2  # the candidates do refuse
