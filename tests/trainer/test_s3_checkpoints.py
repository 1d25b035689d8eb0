"""Checkpoints in a bucket of a real S3 server (versitygw; make test tier).

* the marker-last protocol: a step prefix without its COMPLETE marker is a save in progress (skipped,
  not damage), a corrupt object is refused by its hash, pruning leaves only the newest, the owner
  record's exclusive write is conditional on the server;
* a tiny CPU run (dp2, the dataset and the checkpoints in the bucket) SIGKILLed while the save of
  step 4 is written but unpublished resumes from the bucket's step 2 (not from 0), and ``meshtrain
  export`` writes a Hugging Face directory from the bucket's newest checkpoint.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import mt_harness
import pytest
import s3fs
import test_checkpoint_kill as kill_test
from safetensors import safe_open

from meshtrain.api import job_dir
from meshtrain.cli import main
from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import checkpointer, owner, store
from meshtrain.trainer.data import dataset
from tests.builders import TINY, JobBuilder


def _marker(step: int, files: dict) -> store.Marker:
    return store.Marker(step=step, layout={}, model={}, files=files)


def _save(root: storage.ObjectPath, step: int, payload: bytes) -> storage.ObjectPath:
    prefix = store.new_tmp_dir(root, step)
    storage.write_bytes(f"{prefix}/__0_0.distcp", payload)
    storage.write_bytes(f"{prefix}/.metadata", b"meta")
    return prefix


def test_marker_last_protocol_in_a_bucket(s3_server, monkeypatch):
    root = store.location(s3_server.make_bucket("protocol") + "/job")
    assert isinstance(root, storage.ObjectPath) and store.scan(root) == []
    for step in (2, 3):
        prefix = _save(root, step, bytes([step]) * 1000)
        store.publish(prefix, _marker(step, store.describe_files(prefix)))
    _save(root, 4, b"x" * 10)  # written, never published: in progress, not damage
    assert [p.step for p in store.scan(root)] == [2, 3]
    found = store.latest(root)
    assert found is not None and found[0].step == 3

    with pytest.raises(store.CheckpointError, match="already published"):
        store.new_tmp_dir(root, 3)
    storage.write_bytes(
        f"{root}/step-00000003/__0_0.distcp", b"\0" * 1000
    )  # same size, other bytes
    with pytest.raises(store.CheckpointError, match="sha256 .* differs from the marker"):
        store.latest(root)

    removals: list[list[str]] = []
    remove = storage.remove
    monkeypatch.setattr(storage, "remove", lambda urls: (removals.append(list(urls)), remove(urls)))
    store.prune(root, keep=1)
    marker = f"{root}/step-00000002/{store.MARKER}"
    first = next(i for i, urls in enumerate(removals) if marker in urls)
    later = [i for i, urls in enumerate(removals) if f"{root}/step-00000002/.metadata" in urls]
    assert removals[first] == [marker] and later and min(later) > first  # the marker goes first
    assert [p.step for p in store.scan(root)] == [3]
    assert sorted(storage.listing(root.url)) == [
        "step-00000003/.metadata",
        "step-00000003/COMPLETE",
        "step-00000003/__0_0.distcp",
    ]  # step 2's objects and the unpublished step 4 are gone

    storage.write_bytes(f"{root}/notes.txt", b"mine")
    with pytest.raises(store.CheckpointError, match="not a meshtrain checkpoint"):
        store.scan(root)

    record = root / job_dir.record_name(1)
    first = owner.me(job_dir.JobIdentity("ns", "job", "uid-1"))
    assert owner._write(record, first, exclusive=True)
    assert not owner._write(record, first, exclusive=True)  # the server refused the second
    assert owner._read(record) == first and owner.newest(root) == (1, first)


def _spec(tmp_path: Path, server, data_url: str, ckpt_url: str) -> Path:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=2)
        .training(steps=6, dataset=data_url)
        .checkpoint(path=ckpt_url, intervalSteps=2, keep=2)
        .object_storage(endpoint=server.endpoint)
        .raw()
    )
    return mt_harness.write_job(tmp_path, raw)


def _kill_in_the_save_of_step_4(proc: subprocess.Popen, log_dir: Path) -> None:
    log, deadline = log_dir / "rank-0.log", time.monotonic() + 300
    while f"{checkpointer.FAULT_ENV}: pause" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, proc.stderr.read().decode(errors="replace")[-3000:]
        assert time.monotonic() < deadline, "the run never reached the save of step 4"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)  # the launcher and every rank, mid-save
    proc.wait()
    proc.stderr.close()


@pytest.mark.slow
def test_train_kill_resume_and_export_from_a_bucket(s3_server, tmp_path):
    data = s3_server.make_bucket("train-data") + "/corpus.bin"
    s3fs.S3FileSystem(endpoint_url=s3_server.endpoint).put(str(dataset.stdlib_corpus()), data)
    ckpt = s3_server.make_bucket("ckpts") + "/runs"
    spec, log_dir = _spec(tmp_path, s3_server, data, ckpt), tmp_path / "run"
    root = store.location(f"{ckpt}/{job_dir.LOCAL_NAMESPACE}/t")  # the job's own prefix

    _kill_in_the_save_of_step_4(
        kill_test._start(spec, log_dir, **{checkpointer.FAULT_ENV: "4:pause"}), log_dir
    )
    assert [p.step for p in store.scan(root)] == [2]
    in_progress = storage.listing(f"{root}/step-00000004")
    assert ".metadata" in in_progress and store.MARKER not in in_progress

    resumed = kill_test._start(spec, log_dir)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode(errors="replace")[-3000:]
    assert f"resumed from {root}/step-00000002 (step 2" in (log_dir / "rank-0.log").read_text()
    assert max(kill_test._losses(log_dir)) == 6
    assert [p.step for p in store.scan(root)] == [
        4,
        6,
    ]  # step 4 saved again, published, pruned to 2
    assert not [n for n in storage.listing(root.url) if n.startswith("step-00000002")]

    out = tmp_path / "hf"
    assert main.main(["export", root.url, "-o", str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as exported:
        embedding = exported.get_tensor("transformer.wte.weight")
    assert tuple(embedding.shape) == (TINY["vocab"], TINY["hidden"])
