"""A job's own checkpoint directory and its owner record: the layout, the record, who may write.

The pure policy (:mod:`meshtrain.api.job_dir`) as a table, and the file-system side
(:mod:`meshtrain.trainer.checkpointing.owner`) on real files; also the warning of a claimless job
that may restart (``meshtrain validate``, ``CheckpointsNotPersistent``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import subprocess
import sys

import pytest
import yaml

from meshtrain.api import job_dir, loading, persistence
from meshtrain.cli import main
from meshtrain.operator.policy import builders, checkpoint_condition, conditions, identity
from meshtrain.trainer.checkpointing import owner, store
from tests.builders import JobBuilder

NOW = 1_000_000.0
ME = job_dir.Owner("team", "llm", "uid-new", "uid-new/0/aaaa", "pod-a", 10, NOW)


def _record(**changes: object) -> job_dir.Owner:
    return dataclasses.replace(ME, uid="uid-old", writer="uid-old/3/bbbb", host="pod-b", **changes)


@pytest.mark.parametrize(
    ("current", "gone", "action", "previous", "says"),
    [
        (None, False, "claim", None, "owns this directory"),
        (dataclasses.replace(ME, writer="uid-new/1/cccc"), False, "claim", None, "takes over"),
        (_record(heartbeat=NOW - 5), False, "refuse", None, "another live writer holds it"),
        (_record(heartbeat=NOW + 5), False, "refuse", None, "another live writer holds it"),
        (_record(heartbeat=NOW - job_dir.STALE_SECONDS), False, "claim", "uid-old", "re-created"),
        (
            _record(heartbeat=NOW + 10 * job_dir.STALE_SECONDS),
            False,
            "claim",
            "uid-old",
            "re-created",
        ),
        (_record(heartbeat=NOW - 5, released=True), False, "claim", "uid-old", "re-created"),
        (_record(heartbeat=NOW - 5), True, "claim", "uid-old", "re-created"),
        (_record(name="other", heartbeat=0.0), False, "refuse", None, "names job team/other"),
        (
            _record(namespace="x", heartbeat=0.0, released=True),
            False,
            "refuse",
            None,
            "names job x/llm",
        ),
    ],
)
def test_who_may_write_a_job_directory(current, gone, action, previous, says) -> None:
    verdict = job_dir.decide(current, ME, NOW, holder_gone=gone)
    assert (verdict.action, verdict.previous_uid) == (action, previous)
    assert says in verdict.message


def test_the_layout_and_the_identity_from_the_environment() -> None:
    assert job_dir.job_dir("/ckpt/", "team", "llm") == "/ckpt/team/llm"
    assert job_dir.job_dir("s3://bucket/runs", "team", "llm") == "s3://bucket/runs/team/llm"
    assert job_dir.log_dir("/ckpt", "team", "llm") == "/ckpt/team/llm/logs"
    env = {job_dir.NAMESPACE_ENV: "team", job_dir.NAME_ENV: "llm", job_dir.UID_ENV: "u"}
    assert job_dir.identity_from_env(env) == job_dir.JobIdentity("team", "llm", "u")
    assert job_dir.identity_from_env({}) is None
    for bad in ("..", "a/b", "", "A", "x" * 254):
        with pytest.raises(job_dir.OwnerError, match="not a Kubernetes name"):
            job_dir.identity_from_env({**env, job_dir.NAME_ENV: bad})


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("x" * (job_dir.RECORD_LIMIT + 1), "larger than"),
        ("{", "not JSON"),
        ("[]", "not an owner record"),
        ('{"namespace": "a"}', "not an owner record"),
        (job_dir.render(ME).replace('"pid": 10', '"pid": true'), "'pid' has the wrong type"),
        (job_dir.render(ME).replace(f'"heartbeat": {NOW}', '"heartbeat": NaN'), "not a time"),
        (job_dir.render(ME).replace('"host": "pod-a"', f'"host": "{"h" * 600}"'), "too long"),
    ],
)
def test_a_bad_owner_record_is_refused_naming_the_file(text: str, says: str) -> None:
    with pytest.raises(job_dir.OwnerError, match=says) as caught:
        job_dir.parse(text, "/ckpt/team/llm/OWNER.json")
    assert "/ckpt/team/llm/OWNER.json" in str(caught.value)
    assert job_dir.parse(job_dir.render(ME), "x") == ME


def test_claim_heartbeat_takeover_and_release_on_files(tmp_path) -> None:
    identity = job_dir.JobIdentity("team", "llm", "uid-1")
    held = owner.take(
        tmp_path, {job_dir.NAMESPACE_ENV: "team", job_dir.NAME_ENV: "llm", job_dir.UID_ENV: "uid-1"}
    )
    assert held.directory == tmp_path / "team" / "llm" and held.heartbeat is not None
    record = tmp_path / "team" / "llm" / job_dir.OWNER_FILE
    first = job_dir.parse(record.read_text(), "r")
    assert (first.uid, first.host, first.pid) == ("uid-1", socket.gethostname(), os.getpid())
    # another UID of the same name, while this writer lives: refused, the record untouched
    with pytest.raises(store.CheckpointError, match="another live writer holds it"):
        owner.claim(held.directory, owner.me(dataclasses.replace(identity, uid="uid-2")))
    assert job_dir.parse(record.read_text(), "r").writer == first.writer
    # a later attempt of the same job takes over; the first writer learns it at its next beat
    owner.claim(held.directory, owner.me(identity))
    with pytest.raises(store.CheckpointError, match="no longer owns the directory"):
        held.heartbeat.beat()
    held.heartbeat.release()  # a writer that lost the record leaves it as it is
    assert not job_dir.parse(record.read_text(), "r").released
    assert store.scan(held.directory) == [], "the record and its temporary files are no checkpoints"


def test_a_dead_local_writer_is_gone_at_once_and_a_released_one_too(tmp_path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    directory = tmp_path / "team" / "llm"
    directory.mkdir(parents=True)
    stale = dataclasses.replace(
        owner.me(job_dir.JobIdentity("team", "llm", "old")), pid=int(dead.stdout)
    )
    (directory / job_dir.OWNER_FILE).write_text(job_dir.render(stale))
    verdict = owner.claim(directory, owner.me(job_dir.JobIdentity("team", "llm", "new")))
    assert verdict.previous_uid == "old"
    heartbeat = owner.Heartbeat(
        directory, job_dir.parse((directory / job_dir.OWNER_FILE).read_text(), "r")
    )
    heartbeat.release()
    assert job_dir.parse((directory / job_dir.OWNER_FILE).read_text(), "r").released


def test_the_flat_layout_of_older_releases_is_named_not_resumed(tmp_path) -> None:
    (tmp_path / "step-00000040").mkdir()
    env = {job_dir.NAMESPACE_ENV: "team", job_dir.NAME_ENV: "llm", job_dir.UID_ENV: "u"}
    held = owner.take(tmp_path, env)
    assert len(held.notes) == 1 and "mv " in held.notes[0] and str(held.directory) in held.notes[0]
    assert store.scan(held.directory) == [] and (tmp_path / "step-00000040").is_dir()


def _spec(**checkpoint: object) -> object:
    return loading.parse_spec(JobBuilder().checkpoint(**checkpoint).raw())


def test_checkpoints_not_persistent_only_without_claim_when_a_restart_is_allowed() -> None:
    assert "set checkpoint.claimName" in (persistence.warning(_spec()) or "")
    assert persistence.warning(_spec(claimName="ckpt")) is None
    never = JobBuilder().run_policy(backoffLimit=0, disruptionRestartLimit=0).raw()
    assert persistence.warning(loading.parse_spec(never)) is None
    only_disruptions = JobBuilder().run_policy(backoffLimit=0).raw()
    assert "disruptionRestartLimit 10" in (
        persistence.warning(loading.parse_spec(only_disruptions)) or ""
    )


def test_the_condition_turns_true_once_with_a_warning_then_false() -> None:
    now = datetime.datetime(2026, 1, 1, tzinfo=datetime.UTC)
    conds, warning = checkpoint_condition.changes([], _spec(), now)
    [cond] = conds
    assert (cond["type"], cond["status"], cond["reason"]) == (
        conditions.CHECKPOINTS_NOT_PERSISTENT,
        "True",
        conditions.EMPTY_DIR_CHECKPOINTS,
    )
    assert warning == cond["message"]
    again, warning = checkpoint_condition.changes(conds, _spec(), now + datetime.timedelta(hours=1))
    assert again == conds and warning is None
    cleared, warning = checkpoint_condition.changes(conds, _spec(claimName="ckpt"), now)
    assert cleared[0]["status"] == "False" and warning is None
    assert checkpoint_condition.changes([], _spec(claimName="ckpt"), now) == ([], None)


def test_validate_warns_about_checkpoints_lost_with_the_pods(tmp_path, capsys) -> None:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(JobBuilder("brittle").manifest()))
    assert main.main(["validate", str(path)]) == 0
    assert "warning: spec.checkpoint.claimName is not set" in capsys.readouterr().err
    path.write_text(yaml.safe_dump(JobBuilder("kept").checkpoint(claimName="ckpt").manifest()))
    assert main.main(["validate", str(path)]) == 0
    assert "warning" not in capsys.readouterr().err


def test_the_pods_carry_the_job_uid_and_log_in_the_job_directory() -> None:
    ref = identity.JobRef(name="llm", namespace="research", uid="5f0c")
    pod = builders.build_pod(ref, loading.parse_spec(JobBuilder().raw()), 0, 0, "n-a")
    env = {e["name"]: e.get("value") for e in pod["spec"]["containers"][0]["env"]}
    assert env[job_dir.UID_ENV] == "5f0c"
    assert env["MESHTRAIN_LOG_DIR"] == "/checkpoints/research/llm/logs"


def test_a_fifo_in_place_of_the_record_is_refused_not_waited_on(tmp_path) -> None:
    directory = tmp_path / "team" / "llm"
    directory.mkdir(parents=True)
    os.mkfifo(directory / job_dir.OWNER_FILE)
    with pytest.raises(store.CheckpointError, match="not a regular file"):
        owner.claim(directory, owner.me(job_dir.JobIdentity("team", "llm", "u")))
