"""spec.objectStorage: the rule on s3:// URLs, and what the operator puts into the pods for it."""

from __future__ import annotations

import pytest

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity
from tests.builders import JobBuilder

REF = identity.JobRef(name="llm", namespace="research", uid="1234")
STORE = {"endpoint": "https://minio.storage:9000", "region": "eu-1", "credentialsSecret": "s3-keys"}


def _env(pod):
    return {
        e["name"]: e.get("value", e.get("valueFrom")) for e in pod["spec"]["containers"][0]["env"]
    }


@pytest.mark.parametrize(
    ("section", "values", "field"),
    [
        ("training", {"dataset": "s3://corpus/tokens/*.bin"}, "spec.training.dataset="),
        (
            "training",
            {"datasets": [{"path": "s3://corpus/a.bin"}]},
            "spec.training.datasets[0].path=",
        ),
        ("model", {"init": {"fromHF": "s3://models/llama"}}, "spec.model.init.fromHF="),
        ("checkpoint", {"path": "s3://ckpt/runs"}, "spec.checkpoint.path="),
    ],
)
def test_an_s3_url_without_object_storage_is_refused_naming_field_and_fix(section, values, field):
    raw = JobBuilder().raw()
    raw.setdefault(section, {}).update(values)
    with pytest.raises(loading.SpecError) as refused:
        loading.parse_spec(raw)
    message = str(refused.value)
    assert "spec.objectStorage" in message and field in message
    assert "add objectStorage: {endpoint:" in message
    loading.parse_spec(raw | {"objectStorage": STORE})  # with the store named: accepted


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({"training": {"dataset": "s3://Bad_Bucket/x.bin"}}, "is not an s3://bucket/key URL"),
        ({"checkpoint": {"path": "s3://ckpt//runs"}}, "checkpoint.path must be an absolute"),
        ({"checkpoint": {"path": "s3://ckpt/../runs"}}, "checkpoint.path must be an absolute"),
        ({"objectStorage": {"endpoint": "https://user:pw@minio"}}, "spec.objectStorage.endpoint"),
        ({"objectStorage": {"endpoint": "https://[fd00::1"}}, "spec.objectStorage.endpoint"),
    ],
)
def test_malformed_urls_are_refused(values, expected):
    raw = JobBuilder().raw() | values | {"objectStorage": values.get("objectStorage", STORE)}
    with pytest.raises(loading.SpecError, match=expected):
        loading.parse_spec(raw)


def test_pods_get_the_store_and_its_keys_by_secret_reference_and_no_bucket_mount():
    spec = loading.parse_spec(
        JobBuilder()
        .checkpoint(path="s3://ckpt/runs", claimName="logs")
        .object_storage(**STORE, caConfigMap="corp-ca")
        .raw()
    )
    pod = builders.build_pod(REF, spec, 0, 0, "n-a")
    env = _env(pod)
    assert env["AWS_ENDPOINT_URL"] == "https://minio.storage:9000"
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == "eu-1"
    assert env["MESHTRAIN_S3_ADDRESSING_STYLE"] == "path"
    assert env["AWS_ACCESS_KEY_ID"] == {
        "secretKeyRef": {"name": "s3-keys", "key": "AWS_ACCESS_KEY_ID"}
    }
    assert env["AWS_SECRET_ACCESS_KEY"] == {
        "secretKeyRef": {"name": "s3-keys", "key": "AWS_SECRET_ACCESS_KEY"}
    }
    assert env["AWS_SESSION_TOKEN"]["secretKeyRef"]["optional"] is True
    assert env["AWS_CA_BUNDLE"] == "/etc/meshtrain/object-storage-ca/ca.crt"
    mounts = {m["name"]: m for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts["checkpoints"]["mountPath"] == "/checkpoints"  # the logs' volume, not the URL
    assert env["MESHTRAIN_LOG_DIR"] == "/checkpoints/research/llm/logs"
    assert env["MESHTRAIN_CHECKPOINT_DIR"] == "s3://ckpt/runs"
    assert env["MESHTRAIN_JOB_CHECKPOINT_DIR"] == "s3://ckpt/runs/research/llm"
    assert mounts["object-storage-ca"] == {
        "name": "object-storage-ca",
        "mountPath": "/etc/meshtrain/object-storage-ca",
        "readOnly": True,
    }
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["object-storage-ca"]["configMap"] == {
        "name": "corp-ca",
        "items": [{"key": "ca.crt", "path": "ca.crt"}],
    }


def test_without_object_storage_the_pod_has_no_store_variables():
    pod = builders.build_pod(REF, loading.parse_spec(JobBuilder().raw()), 0, 0, "n-a")
    assert not [name for name in _env(pod) if name.startswith("AWS_")]


def test_checkpoints_in_a_bucket_outlive_the_gang_like_a_claim():
    raw = (
        JobBuilder()
        .layout(data=2, gpus_per_node=1)
        .run_policy(elastic={"minData": 1, "maxData": 2}, stragglerPolicy={"action": "replace"})
        .raw()
    )
    with pytest.raises(loading.SpecError, match="or drop runPolicy.elastic"):
        loading.parse_spec(raw)
    bucket = {"checkpoint": {"path": "s3://ckpt/runs"}, "objectStorage": STORE}
    loading.parse_spec(raw | bucket)  # no claim needed: the bucket keeps them


@pytest.mark.parametrize(
    "endpoint", ["http://[fd00::1]:9000", "https://[::1]", "http://10.0.0.1:7070/"]
)
def test_ip_literal_endpoints_are_accepted(endpoint):
    raw = JobBuilder().raw() | {"objectStorage": {"endpoint": endpoint}}
    assert loading.parse_spec(raw).object_storage.endpoint == endpoint
