"""Jobs that share one checkpoint path, as the operator runs them: each writes its own directory.

The pods' own command (torchrun with the environment the operator gave the pod, and the spec of the
job's ConfigMap) runs on this machine, as in ``test_operator_exit_codes``; the job's UID comes from
the real API server.  Also ``CheckpointsNotPersistent``: set on every claimless job (suspend,
preemption and drains restart it whatever its run policy), turned False once it has a claim.  ``make test`` tier (integration).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from meshtrain.api import exitcodes, job_dir
from meshtrain.operator.policy import conditions
from meshtrain.trainer.checkpointing import checkpointer, owner, store
from tests.builders import CPU_PARALLELISM, CPU_TRAINING, TINY, JobBuilder
from tests.integration.operator.cluster import Cluster, wait_for
from tests.integration.operator.test_operator_exit_codes import _run_pod_command

pytestmark = pytest.mark.integration


BEAT = 0.5
"""The owner heartbeat of these tests (``MESHTRAIN_OWNER_HEARTBEAT_SECONDS``): a claimant watches a
quiet record 1.25 s and a live one 3 s."""


def _job(name: str, namespace: str, pool: str, root: Path, steps: int = 2) -> JobBuilder:
    return (
        JobBuilder(name, namespace, pool)
        .model(TINY)
        .parallelism(**CPU_PARALLELISM)
        .training(**{**CPU_TRAINING, "steps": steps, "microBatch": 8})
        .checkpoint(path=str(root), intervalSteps=1, keep=2)
    )


def _train(cluster: Cluster, namespace: str, name: str, tmp_path: Path) -> tuple[int, str, str]:
    """Run the job's one pod as its container would; (exit code, stderr, termination message)."""
    [pod] = cluster.wait_gang(namespace, name, 1, attempt=0)
    spec_file, termination = tmp_path / f"{name}.yaml", tmp_path / f"{name}.termination"
    spec_file.write_text(
        cluster.core.read_namespaced_config_map(f"{name}-spec", namespace).data["job.yaml"]
    )
    termination.write_text("")
    env = {e.name: e.value for e in pod.spec.containers[0].env if e.value is not None}
    assert env[job_dir.UID_ENV] == cluster.job(namespace, name)["metadata"]["uid"]
    ran = _run_pod_command(pod, str(spec_file), str(termination))
    return ran.returncode, ran.stderr, termination.read_text()


def _owner(directory: Path) -> job_dir.Owner:
    record = owner.newest(directory)[1]
    assert record is not None
    return record


def test_two_jobs_on_one_path_keep_their_own_and_a_live_writer_fails_the_new_job(
    cluster, operator, namespace, pool, tmp_path, monkeypatch
):
    monkeypatch.setenv(job_dir.HEARTBEAT_ENV, str(BEAT))  # the pods' commands run with it
    cluster.add_node(pool, gpus=2)
    root = tmp_path / "claim"
    uids = {}
    for name in ("first", "second"):
        cluster.apply(_job(name, namespace, pool, root))
        uids[name] = cluster.job(namespace, name)["metadata"]["uid"]
        warned = wait_for(
            f"{name}: CheckpointsNotPersistent=True",
            lambda name=name: cluster.condition(
                namespace, name, conditions.CHECKPOINTS_NOT_PERSISTENT
            ),
        )
        assert warned["status"] == "True" and warned["reason"] == conditions.EMPTY_DIR_CHECKPOINTS
        assert "set checkpoint.claimName" in warned["message"]
    for name in ("first", "second"):
        code, err, _ = _train(cluster, namespace, name, tmp_path)
        assert code == 0, err[-3000:]
        directory = root / namespace / name
        assert [p.step for p in store.scan(directory)] == [1, 2]
        marker = store.read_marker(directory / "step-00000002")
        assert marker.extra[checkpointer.JOB_UID_KEY] == uids[name] == _owner(directory).uid
        assert (directory / "logs" / "steps.jsonl").is_file(), "MESHTRAIN_LOG_DIR is the job's own"

    # "first" is deleted and applied again while its old writer still beats (another node's pod)
    directory = root / namespace / "first"
    cluster.delete_job(namespace, "first")
    wait_for("first deleted", lambda: cluster.job(namespace, "first") is None, timeout=60)
    monkeypatch.setenv(job_dir.ATTEMPT_ENV, "9")
    alive = owner.me(job_dir.JobIdentity(namespace, "first", uids["first"]))
    monkeypatch.delenv(job_dir.ATTEMPT_ENV)
    _, generation = owner.claim(directory, alive, BEAT)  # the old job's writer, beating on
    beating = owner.Heartbeat(directory, alive, generation, BEAT)
    cluster.apply(_job("first", namespace, pool, root))
    code, err, message = _train(cluster, namespace, "first", tmp_path)
    report = exitcodes.read_failure_report(message)
    assert report is not None and report[0] == exitcodes.CHECKPOINT, err[-3000:]
    assert "another live writer holds it" in report[1] and uids["first"] in report[1]
    [pod] = cluster.pods(namespace, "first")
    cluster.set_pod_phase(namespace, pod.metadata.name, "Failed", exit_code=code, message=message)
    cluster.wait_phase(namespace, "first", "Failed", timeout=30)
    failed = cluster.condition(namespace, "first", conditions.FAILED)
    assert failed["reason"] == conditions.PERMANENT_FAILURE
    assert "another live writer holds it" in failed["message"]
    assert [p.step for p in store.scan(directory)] == [1, 2], "the refused job wrote nothing"
    assert _owner(directory).writer == alive.writer

    # the old writer went quiet (its record stopped changing, not released): applied again with
    # more steps to train, the job resumes and its status says whose checkpoints
    cluster.delete_job(namespace, "first")
    wait_for("first deleted", lambda: cluster.job(namespace, "first") is None, timeout=60)
    beating._stop.set()
    cluster.apply(_job("first", namespace, pool, root, steps=3))
    code, err, message = _train(cluster, namespace, "first", tmp_path)
    assert code == 0, err[-3000:]
    assert f"resuming the checkpoints that uid {uids['first']} wrote" in err
    [pod] = cluster.pods(namespace, "first")
    cluster.set_pod_phase(namespace, pod.metadata.name, "Succeeded", exit_code=0, message=message)
    status = cluster.wait_phase(namespace, "first", "Succeeded", timeout=30)
    assert status["progress"]["resumedFromUid"] == uids["first"]
    assert (
        _owner(directory).uid == cluster.job(namespace, "first")["metadata"]["uid"] != uids["first"]
    )


def test_checkpoints_not_persistent_without_restarts_too_and_false_once_claimed(
    cluster, operator, namespace, pool, tmp_path
):
    cluster.add_node(pool, gpus=2)
    never = _job("brittle", namespace, pool, tmp_path).run_policy(
        backoffLimit=0, disruptionRestartLimit=0
    )
    cluster.apply(never)
    wait_for(
        "CheckpointsNotPersistent=True",
        lambda: (
            cluster.condition(namespace, "brittle", conditions.CHECKPOINTS_NOT_PERSISTENT).get(
                "status"
            )
            == "True"
        ),
    )
    cluster.patch_job(namespace, "brittle", {"checkpoint": {"claimName": "ckpt"}})
    cleared = wait_for(
        "CheckpointsNotPersistent=False",
        lambda: (
            (c := cluster.condition(namespace, "brittle", conditions.CHECKPOINTS_NOT_PERSISTENT))
            and c["status"] == "False"
            and c
        ),
    )
    assert cleared["reason"] == conditions.PERSISTENT_CHECKPOINTS
    events = [
        e
        for e in cluster.core.list_namespaced_event(namespace).items
        if e.reason == conditions.EMPTY_DIR_CHECKPOINTS
    ]
    assert len(events) == 1 and events[0].type == "Warning"
