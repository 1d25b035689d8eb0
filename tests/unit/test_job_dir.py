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
ME = job_dir.Owner("team", "llm", "uid-new", "uid-new/1/aaaa", "pod-a", 10, NOW)


def _record(**changes: object) -> job_dir.Owner:
    return dataclasses.replace(ME, uid="uid-old", writer="uid-old/3/bbbb", host="pod-b", **changes)


@pytest.mark.parametrize(
    ("current", "live", "action", "previous", "says"),
    [
        (None, False, "claim", None, "owns this directory"),
        (dataclasses.replace(ME, writer="uid-new/1/cccc"), True, "claim", None, "takes over"),
        (dataclasses.replace(ME, writer="uid-new/0/cccc"), True, "claim", None, "takes over"),
        (dataclasses.replace(ME, writer="uid-new/7/cccc"), True, "refuse", None, "outdated"),
        (_record(), True, "refuse", None, "another live writer holds it"),
        (_record(), False, "claim", "uid-old", "re-created"),
        (_record(released=True), False, "claim", "uid-old", "re-created"),
        (_record(name="other", heartbeat=0.0), False, "refuse", None, "names job team/other"),
        (_record(namespace="x", released=True), False, "refuse", None, "names job x/llm"),
    ],
)
def test_who_may_write_a_job_directory(current, live, action, previous, says) -> None:
    verdict = job_dir.decide(current, ME, live=live)
    assert (verdict.action, verdict.previous_uid) == (action, previous)
    assert says in verdict.message


def test_only_an_unreleased_record_of_another_uid_of_this_job_is_watched() -> None:
    assert job_dir.must_watch(_record(), ME)
    assert not job_dir.must_watch(_record(released=True), ME)
    assert not job_dir.must_watch(dataclasses.replace(ME, writer="uid-new/1/cccc"), ME)
    assert not job_dir.must_watch(_record(name="other"), ME)


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


BEAT = 0.1
"""Heartbeat of the tests (seconds): a claimant watches a quiet record for 2.5 beats, a live one for 6."""
ENV = {
    job_dir.NAMESPACE_ENV: "team",
    job_dir.NAME_ENV: "llm",
    job_dir.UID_ENV: "uid-1",
    job_dir.HEARTBEAT_ENV: str(BEAT),
}


def _newest(directory) -> job_dir.Owner:
    record = owner.newest(directory)[1]
    assert record is not None
    return record


def _claim(directory, uid: str, attempt: str = "0", monkeypatch=None) -> tuple[job_dir.Owner, int]:
    if monkeypatch is not None:
        monkeypatch.setenv(job_dir.ATTEMPT_ENV, attempt)
    mine = owner.me(job_dir.JobIdentity("team", "llm", uid))
    return mine, owner.claim(directory, mine, BEAT)[1]


def test_claim_heartbeat_takeover_and_release_on_files(tmp_path, monkeypatch) -> None:
    held = owner.take(tmp_path, ENV)
    assert held.directory == tmp_path / "team" / "llm" and held.heartbeat is not None
    first = _newest(held.directory)
    assert (first.uid, first.host, first.pid) == ("uid-1", socket.gethostname(), os.getpid())
    assert (held.directory / job_dir.record_name(1)).is_file()
    # another UID of the same name, while this writer beats: refused, the record untouched
    with pytest.raises(store.CheckpointError, match="another live writer holds it"):
        _claim(held.directory, "uid-2")
    assert _newest(held.directory).writer == first.writer
    # a later attempt of the same job takes over; the first writer learns it at its next beat
    _claim(held.directory, "uid-1", "1", monkeypatch)
    with pytest.raises(store.CheckpointError, match="no longer owns the directory"):
        held.heartbeat.beat()
    assert held.heartbeat.lost is not None
    held.heartbeat.release()  # a writer that lost the record leaves it as it is
    assert not _newest(held.directory).released
    # an attempt older than the owner's is refused, not handed the directory back
    with pytest.raises(store.CheckpointError, match="outdated"):
        _claim(held.directory, "uid-1", "0", monkeypatch)
    assert store.scan(held.directory) == [], (
        "the records and their temporary files are no checkpoints"
    )


def test_a_quiet_foreign_record_is_taken_over_and_a_released_one_at_once(tmp_path) -> None:
    directory = tmp_path / "team" / "llm"
    old = dataclasses.replace(owner.me(job_dir.JobIdentity("team", "llm", "old")), host="elsewhere")
    assert owner._write(directory / job_dir.record_name(4), old, exclusive=True)
    _, generation = _claim(directory, "new")
    assert generation == 5 and [p.name for p in (directory / job_dir.OWNER_DIR).iterdir()] == [
        "00000005.json"
    ], "the owner removes the older generations"
    heartbeat = owner.Heartbeat(directory, _newest(directory), generation, BEAT)
    heartbeat.release()
    assert _newest(directory).released
    _claim(directory, "newer")  # no wait for a released record (the watch would refuse a live one)


def test_a_crashed_rewrites_leftover_goes_once_stale_and_a_fresh_one_stays(tmp_path) -> None:
    directory = tmp_path / "team" / "llm"
    records = directory / job_dir.OWNER_DIR
    records.mkdir(parents=True)
    crashed, fresh = (
        records / store.tmp_name("0badc0de", "owner"),
        records / store.tmp_name("1", "owner"),
    )
    crashed.write_text("{")
    fresh.write_text("{")
    os.utime(crashed, (0, 0))
    mine, generation = _claim(directory, "u")
    assert not crashed.exists() and fresh.exists()
    assert owner._generations(directory) == [generation] and store.scan(directory) == []
    with pytest.raises(job_dir.OwnerError, match="between 0.05 and 600"):
        job_dir.heartbeat_seconds({job_dir.HEARTBEAT_ENV: "0"})
    assert job_dir.heartbeat_seconds({}) == job_dir.HEARTBEAT_SECONDS


def test_a_dead_local_writer_is_gone_but_a_pid_of_another_container_says_nothing(tmp_path) -> None:
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    mine = owner.me(job_dir.JobIdentity("team", "llm", "old"))
    assert mine.boot_id and mine.pid_ns and mine.start_time
    assert not owner._gone(mine), "this process lives"
    assert owner._gone(dataclasses.replace(mine, pid=int(dead.stdout)))
    assert owner._gone(dataclasses.replace(mine, start_time=mine.start_time + 1)), "a reused pid"
    assert not owner._gone(dataclasses.replace(mine, pid=int(dead.stdout), pid_ns=mine.pid_ns + 1))
    assert not owner._gone(dataclasses.replace(mine, pid=int(dead.stdout), boot_id="other-boot"))
    assert not owner._gone(dataclasses.replace(mine, pid=int(dead.stdout), boot_id=""))


def test_two_claimants_on_one_stale_record_only_one_wins(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "team" / "llm"
    stale = dataclasses.replace(owner.me(job_dir.JobIdentity("team", "llm", "old")), host="gone")
    assert owner._write(directory / job_dir.record_name(1), stale, exclusive=True)
    snapshot = owner.newest(directory)
    real = owner.newest
    reads = iter([snapshot, snapshot])  # both read the stale record before either writes
    monkeypatch.setattr(owner, "newest", lambda d: next(reads, None) or real(d))
    monkeypatch.setattr(owner, "_gone", lambda record: record.uid == "old")
    a, generation = _claim(directory, "uid-a")
    winner = owner.Heartbeat(directory, a, generation, BEAT)
    try:
        with pytest.raises(store.CheckpointError, match="another live writer holds it"):
            _claim(directory, "uid-b")
    finally:
        winner.release()
    assert (_newest(directory).uid, owner._generations(directory)) == ("uid-a", [2])


def test_a_beat_racing_a_claim_does_not_overwrite_the_new_claim(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "team" / "llm"
    old, generation = _claim(directory, "u", "0", monkeypatch)
    beating = owner.Heartbeat(directory, old, generation, 3600)
    real_write = owner._write
    claimed: list[tuple[job_dir.Owner, int]] = []

    def racing_write(path, record, *, exclusive=False):
        if (
            record.writer == old.writer and not claimed
        ):  # judged, not yet written: a new attempt claims
            claimed.append(_claim(directory, "u", "1", monkeypatch))
        return real_write(path, record, exclusive=exclusive)

    monkeypatch.setattr(owner, "_write", racing_write)
    beating.beat()
    monkeypatch.setattr(owner, "_write", real_write)
    new, new_generation = claimed[0]
    assert _newest(directory).writer == new.writer
    owner.Heartbeat(directory, new, new_generation, 3600).check()  # the new claim survives
    with pytest.raises(store.CheckpointError, match="no longer owns"):
        beating.beat()


def test_a_taken_over_writer_neither_publishes_nor_deletes_the_new_owners_save(
    tmp_path, monkeypatch
) -> None:
    directory = tmp_path / "team" / "llm"
    old, generation = _claim(directory, "u", "0", monkeypatch)
    zombie = owner.Heartbeat(directory, old, generation, 3600)
    own_tmp = store.new_tmp_dir(directory, 8, zombie.tag)
    own_tmp.mkdir()
    new, new_generation = _claim(directory, "u", "1", monkeypatch)
    successor = owner.Heartbeat(directory, new, new_generation, 3600)
    in_progress = store.new_tmp_dir(directory, 10, successor.tag)
    in_progress.mkdir()
    (in_progress / "__0_0.distcp").write_bytes(b"x")
    (directory / ".tmp-step-00000010-newowner").mkdir()  # another writer's name of any shape
    with pytest.raises(store.CheckpointError, match="no longer owns"):
        store.prune(directory, keep=1, tag=zombie.tag, fence=zombie.check)
    marker = store.Marker(step=8, layout={}, model={}, files={})
    with pytest.raises(store.CheckpointError, match="no longer owns"):
        store.publish(own_tmp, marker, zombie.check)
    assert own_tmp.is_dir() and not (directory / "step-00000008").exists()
    # unfenced (a zombie that has not looked yet) it still deletes only its own temporary directories
    store.prune(directory, keep=1, tag=zombie.tag)
    assert in_progress.is_dir() and (directory / ".tmp-step-00000010-newowner").is_dir()
    assert not own_tmp.exists()
    # another writer's leftovers go once stale by the file system's own clock
    store.prune(directory, keep=1, tag=successor.tag, stale_seconds=0)
    assert not (directory / ".tmp-step-00000010-newowner").exists()


def test_checkpoints_of_another_uid_are_neither_counted_nor_pruned(tmp_path) -> None:
    def publish(step: int, uid: str) -> None:
        tmp = store.new_tmp_dir(tmp_path, step)
        tmp.mkdir()
        (tmp / "data").write_bytes(b"x")
        files = store.describe_files(tmp)
        store.publish(tmp, store.Marker(step, {}, {}, files, {store.JOB_UID_KEY: uid}))

    for step, uid in ((1, "old"), (2, "old"), (3, "new"), (4, "new"), (5, "new")):
        publish(step, uid)
    store.prune(tmp_path, keep=2, uid="new")
    assert [p.step for p in store.scan(tmp_path)] == [1, 2, 4, 5]


def test_the_flat_layout_of_older_releases_is_named_not_resumed(tmp_path) -> None:
    (tmp_path / "step-00000040").mkdir()
    (tmp_path / "step-00000040" / store.MARKER).write_text("{}")
    (tmp_path / "step-00000050").mkdir()  # a namespace named like a step: no marker, no checkpoint
    held = owner.take(tmp_path, ENV)
    assert len(held.notes) == 1 and "mv " in held.notes[0] and str(held.directory) in held.notes[0]
    assert "1 checkpoint(s)" in held.notes[0] and "step-00000050" not in held.notes[0]
    assert store.scan(held.directory) == [] and (tmp_path / "step-00000040").is_dir()
    assert held.heartbeat is not None
    held.heartbeat.release()


def _spec(**checkpoint: object) -> object:
    return loading.parse_spec(JobBuilder().checkpoint(**checkpoint).raw())


def test_checkpoints_not_persistent_for_every_job_without_claim_or_bucket() -> None:
    assert "set checkpoint.claimName" in (persistence.warning(_spec()) or "")
    assert "backoffLimit" in (persistence.warning(_spec()) or "")
    assert persistence.warning(_spec(claimName="ckpt")) is None
    bucket = (
        JobBuilder()
        .checkpoint(path="s3://bucket/runs")
        .object_storage(endpoint="https://s3.example", region="r", credentialsSecret="s3")
    )
    assert persistence.warning(loading.parse_spec(bucket.raw())) is None
    # no restart the run policy counts, but a suspend, a preemption or a drain restarts it all the same
    never = JobBuilder().run_policy(backoffLimit=0, disruptionRestartLimit=0).raw()
    message = persistence.warning(loading.parse_spec(never)) or ""
    assert "runPolicy.suspend, a preemption (Kueue)" in message and "backoffLimit" not in message
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
    (directory / job_dir.OWNER_DIR).mkdir()
    os.mkfifo(directory / job_dir.record_name(1))
    with pytest.raises(store.CheckpointError, match="not a regular file"):
        owner.claim(directory, owner.me(job_dir.JobIdentity("team", "llm", "u")))
