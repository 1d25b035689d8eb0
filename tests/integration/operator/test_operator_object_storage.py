"""spec.objectStorage on a real API server: the CRD refuses s3:// URLs without it, and the pods the
operator builds for it (keys by secretKeyRef, the CA ConfigMap volume) are valid Pods."""

from __future__ import annotations

import pytest
import yaml

from meshtrain.api import loading, rules
from meshtrain.operator.policy import builders, identity
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

STORE = {
    "endpoint": "http://minio.storage:9000",
    "credentialsSecret": "s3-keys",
    "caConfigMap": "ca",
}


def _dry_run(cluster, namespace: str, body: dict):
    return cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-o", "yaml", "-f", "-",
        stdin=yaml.safe_dump(body),
    )  # fmt: skip


def _job(name: str) -> JobBuilder:
    return (
        JobBuilder(name, None).layout(data=1, gpus_per_node=1).training(dataset="s3://corpus/a.bin")
    )


def test_an_s3_url_needs_object_storage_at_apply(cluster, namespace):
    message = next(r.cel_message for r in rules.RULES if r.name == "object-storage-for-urls")
    refused = _dry_run(cluster, namespace, _job("no-store").manifest())
    assert refused.returncode != 0 and message in refused.stderr
    accepted = _dry_run(  # elastic without a claim: the bucket keeps the checkpoints
        cluster,
        namespace,
        _job("store")
        .object_storage(**STORE)
        .checkpoint(path="s3://ckpt/x")
        .run_policy(elastic={"minData": 1, "maxData": 2})
        .manifest(),
    )
    assert accepted.returncode == 0, accepted.stderr
    assert yaml.safe_load(accepted.stdout)["spec"]["objectStorage"]["addressingStyle"] == "path"


def test_the_pods_of_a_job_with_object_storage_are_valid_pods(cluster, namespace):
    spec = loading.parse_spec(
        _job("pods").object_storage(**STORE).checkpoint(path="s3://ckpt/runs").raw()
    )
    pod = builders.build_pod(identity.JobRef("pods", namespace, "u-1"), spec, 0, 0, "node-a")
    result = _dry_run(cluster, namespace, pod)
    assert result.returncode == 0, result.stderr
    stored = yaml.safe_load(result.stdout)["spec"]
    env = {e["name"]: e for e in stored["containers"][0]["env"]}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "s3-keys"
    assert {v["name"] for v in stored["volumes"]} >= {"object-storage-ca", "checkpoints"}
