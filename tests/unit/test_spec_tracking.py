"""``spec.tracking``: a present sub-section turns a tracker on; URIs, paths and names are checked
with the field named and the fix said, by the model and by the CRD's schema alike."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from meshtrain.api import crd, limits, loading
from meshtrain.api.spec import tracking
from meshtrain.operator.policy import builders, identity
from meshtrain.trainer.telemetry.tracking import backend, tensorboard_files
from tests.builders import JobBuilder


def _spec(**sections):
    return loading.parse_spec(JobBuilder().tracking(**sections).raw())


def test_no_tracker_unless_a_section_is_present():
    job = loading.parse_spec(JobBuilder().raw())
    assert (job.tracking.tensorboard, job.tracking.mlflow, job.tracking.wandb) == (None, None, None)
    on = _spec(tensorboard={}, mlflow={}, wandb={})
    assert on.tracking.tensorboard.log_dir is None and on.tracking.wandb.mode == "online"


@pytest.mark.parametrize(
    "uri",
    [
        "http://mlflow.mlflow:5000",
        "https://mlflow.example.com/tracking/",
        "http://127.0.0.1:5000",
        "http://[::1]:5000",
        "file:///var/mlruns",
        "sqlite:////var/mlflow/store.db",
        "sqlite:///mlflow.db",
    ],
)
def test_tracking_uri_accepted(uri):
    assert _spec(mlflow={"trackingUri": uri}).tracking.mlflow.tracking_uri == uri


@pytest.mark.parametrize(
    "uri",
    [
        "http://user:secret@mlflow:5000",  # credentials belong in spec.pod.env
        "databricks",
        "mlflow:5000",
        "ftp://mlflow/",
        "http://mlflow:5000/a b",
        "file:relative/path",
        "sqlite:///",
        "sqlite://host/x.db",
        "http://" + "a" * limits.MAX_URL_LENGTH,
    ],
)
def test_tracking_uri_refused_naming_field_and_fix(uri):
    with pytest.raises(loading.SpecError) as err:
        _spec(mlflow={"trackingUri": uri})
    assert "spec.tracking.mlflow.trackingUri" in str(err.value)
    if len(uri) <= limits.MAX_URL_LENGTH:
        assert "http://, https:// or file:///" in str(err.value)


@pytest.mark.parametrize("path", ["/a/../b", "/a//b", "/a/./b", "/a/\x01", "../tb", "./tb", "a//b"])
def test_log_dir_must_be_normalised(path):
    with pytest.raises(loading.SpecError, match=r"spec\.tracking\.tensorboard\.logDir.*absolute"):
        _spec(tensorboard={"logDir": path})


def test_a_relative_log_dir_is_taken_from_the_working_or_checkpoint_directory(
    tmp_path, monkeypatch
):
    job = _spec(tensorboard={"logDir": "tb/run-1"})
    monkeypatch.chdir(tmp_path)
    for local, expected in ((True, tmp_path / "tb/run-1"), (False, Path("/ckpt/ns/job/tb/run-1"))):
        context = backend.Context(job, "ns", "job", Path("/ckpt/ns/job"), 1, None, local=local)
        files = tensorboard_files.TensorBoardFiles(job.tracking.tensorboard, context)
        assert files.directory() == expected
    pod = backend.Context(job, "ns", "job", None, 1, None, local=False)
    with pytest.raises(ValueError, match="logDir"):
        tensorboard_files.TensorBoardFiles(job.tracking.tensorboard, pod).directory()


def test_log_dir_accepts_dots_inside_names():
    job = _spec(tensorboard={"logDir": "/data/.tb/..x/run.1/"})
    assert job.tracking.tensorboard.log_dir == "/data/.tb/..x/run.1/"


@pytest.mark.parametrize(
    ("section", "field", "value", "words"),
    [
        ("mlflow", "experimentName", "x" * (limits.MAX_TRACKER_NAME_LENGTH + 1), "at most 256"),
        ("mlflow", "runName", "a\nb", "control characters"),
        ("wandb", "project", "team/project", "W&B project"),
        ("wandb", "project", "p" * (limits.MAX_WANDB_PROJECT_LENGTH + 1), "at most 128"),
        ("wandb", "entity", "-team", "W&B entity"),
        ("wandb", "mode", "disabled", "online"),
    ],
)
def test_names_bounded_and_shaped(section, field, value, words):
    with pytest.raises(loading.SpecError) as err:
        _spec(**{section: {field: value}})
    assert f"spec.tracking.{section}.{field}" in str(err.value)
    assert words in str(err.value)


def test_unknown_tracker_field_refused():
    with pytest.raises(loading.SpecError, match=r"spec\.tracking\.mlflow\.trackingURI"):
        _spec(mlflow={"trackingURI": "http://mlflow:5000"})


def _crd_pattern(*path: str) -> str:
    node = crd.spec_schema()["properties"]["tracking"]
    for part in path:
        node = node["properties"][part]
    return node["pattern"]


@pytest.mark.parametrize(
    ("path", "pattern", "good", "bad"),
    [
        (("tensorboard", "logDir"), tracking.LOG_DIR, "/x/.y", "/x/../y"),
        (("mlflow", "trackingUri"), tracking.TRACKING_URI, "https://m:1/p", "http://u:p@m"),
        (("wandb", "project"), tracking.WANDB_PROJECT, "proj", "a/b"),
        (("wandb", "entity"), tracking.WANDB_ENTITY, "team", "-x"),
    ],
)
def test_crd_carries_the_same_patterns(path, pattern, good, bad):
    assert _crd_pattern(*path) == pattern
    assert re.fullmatch(pattern, good) and not re.fullmatch(pattern, bad)


def test_the_pods_spec_file_carries_the_trackers():
    """The trainer reads spec.tracking from the ConfigMap the operator mounts (MESHTRAIN_SPEC_FILE)."""
    job = _spec(
        tensorboard={"logDir": "/checkpoints/tb"},
        mlflow={"trackingUri": "http://mlflow.mlflow:5000", "experimentName": "sweep"},
        wandb={"project": "p", "mode": "offline"},
    )
    ref = identity.JobRef(name="llm", namespace="research", uid="1234")
    document = yaml.safe_load(builders.build_configmap(ref, job)["data"]["job.yaml"])
    assert loading.parse_manifest(document)[1].tracking == job.tracking
    env = {
        e["name"]: e.get("value")
        for e in builders.build_pod(ref, job, 0, 0, "n")["spec"]["containers"][0]["env"]
    }
    assert env["MESHTRAIN_NAMESPACE"] == "research" and env["MESHTRAIN_JOB_NAME"] == "llm"
