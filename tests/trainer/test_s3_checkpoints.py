"""Checkpoints in a bucket of a real S3 server (versitygw; make test tier).

* the protocol: each save writes an attempt prefix of its own and one conditional marker per step
  approves one attempt; an attempt without a marker is a save in progress (skipped, not damage, kept
  while fresh), an overwritten object is refused by its ETag (and its hash), pruning deletes the
  marker first and leaves only the newest, the owner record's exclusive write is conditional on
  the server; two writers of one step publish one whole checkpoint; a marker whose list differs
  from the objects is not published; a save takes the store's kept SHA-256 and reads nothing back;
* a tiny CPU run (dp2, the dataset and the checkpoints in the bucket) SIGKILLed while the save of
  step 4 is written but unpublished resumes from the bucket's step 2 (not from 0), and ``meshtrain
  export`` writes a Hugging Face directory from the bucket's newest checkpoint.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import signal
import subprocess
import threading
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
    unpublished = _save(root, 4, b"x" * 10)  # written, never published: in progress, not damage
    assert [p.step for p in store.scan(root)] == [2, 3]
    found = store.latest(root)
    assert found is not None and found[0].step == 3
    three = found[0].path
    assert isinstance(three, storage.ObjectPath) and three.url.startswith(
        f"{root}/step-00000003/a-"
    )

    with pytest.raises(store.CheckpointError, match="already published"):
        store.new_tmp_dir(root, 3)
    storage.write_bytes(f"{three}/__0_0.distcp", b"\0" * 1000)  # same size, other bytes
    with pytest.raises(store.CheckpointError, match="ETag .* differs from the marker"):
        store.latest(root)
    monkeypatch.setenv(store.REHASH_ENV, "1")
    marker = store.read_marker(three)
    with pytest.raises(store.CheckpointError, match="differs from the marker"):
        store.verify(
            three,
            dataclasses.replace(
                marker,
                files={
                    n: {k: v for k, v in f.items() if k != "etag"} for n, f in marker.files.items()
                },
            ),
            hashes=True,
        )  # the full re-hash finds it by sha256

    removals: list[list[str]] = []
    remove = storage.remove
    monkeypatch.setattr(storage, "remove", lambda urls: (removals.append(list(urls)), remove(urls)))
    store.prune(root, keep=1)
    two_marker = f"{root}/step-00000002/{store.MARKER}"
    first = next(i for i, urls in enumerate(removals) if two_marker in urls)
    later = [i for i, urls in enumerate(removals) if any("step-00000002/a-" in u for u in urls)]
    assert removals[first] == [two_marker] and later and min(later) > first  # the marker goes first
    assert [p.step for p in store.scan(root)] == [3]
    names = sorted(storage.listing(root.url))
    assert not [n for n in names if n.startswith("step-00000002")]
    assert f"step-00000004/{unpublished.name}/.metadata" in names, "a fresh attempt is kept"
    monkeypatch.setattr(store, "STALE_SECONDS", -1.0)  # now every unpublished attempt is stale
    store.prune(root, keep=1)
    assert sorted(storage.listing(root.url)) == [
        "step-00000003/COMPLETE",
        f"step-00000003/{three.name}/.metadata",
        f"step-00000003/{three.name}/__0_0.distcp",
    ]  # only step 3, its marker and its approved attempt

    storage.write_bytes(f"{root}/notes.txt", b"mine")
    with pytest.raises(store.CheckpointError, match="not a meshtrain checkpoint"):
        store.scan(root)

    record = root / job_dir.record_name(1)
    first = owner.me(job_dir.JobIdentity("ns", "job", "uid-1"))
    assert owner._write(record, first, exclusive=True)
    assert not owner._write(record, first, exclusive=True)  # the server refused the second
    assert owner._read(record) == first and owner.newest(root) == (1, first)


def test_two_writers_of_one_step_publish_one_whole_checkpoint(s3_server):
    """A zombie gang and the new owner save the same step: the published one is one writer's, whole."""
    root = store.location(s3_server.make_bucket("two-writers") + "/job")
    assert isinstance(root, storage.ObjectPath)
    prefixes = [_save(root, 8, bytes([writer + 1]) * 5000) for writer in range(2)]
    assert prefixes[0] != prefixes[1], "every save writes under a prefix of its own"
    markers = [_marker(8, store.describe_files(prefix)) for prefix in prefixes]
    barrier, outcomes = threading.Barrier(2), [None, None]

    def publish(writer: int) -> None:
        barrier.wait()
        try:
            outcomes[writer] = store.publish(prefixes[writer], markers[writer])
        except store.CheckpointError as err:
            outcomes[writer] = err

    threads = [threading.Thread(target=publish, args=(w,)) for w in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    won = [w for w in range(2) if isinstance(outcomes[w], storage.ObjectPath)]
    assert len(won) == 1, outcomes
    assert "already published" in str(outcomes[1 - won[0]])
    found = store.latest(root)
    assert found is not None and found[0].path == prefixes[won[0]]
    assert storage.read_small(f"{found[0].path}/__0_0.distcp") == bytes([won[0] + 1]) * 5000
    assert found[1].files == markers[won[0]].files
    with pytest.raises(store.CheckpointError, match="approves attempt"):
        store.read_marker(prefixes[1 - won[0]])  # the loser is never loaded
    store.prune(root, keep=1)  # the loser's prune: the winner's objects stay, its own too (fresh)
    store.verify(found[0].path, found[1], hashes=True)


def test_a_marker_listing_other_objects_is_not_published(s3_server):
    root = store.location(s3_server.make_bucket("cross-check") + "/job")
    prefix = _save(root, 2, b"a" * 100)
    marker = _marker(2, store.describe_files(prefix))
    storage.write_bytes(f"{prefix}/__1_0.distcp", b"late")  # a file the marker does not list
    with pytest.raises(store.CheckpointError, match="not in the marker's list.*not publishing"):
        store.publish(prefix, marker)
    storage.remove([f"{prefix}/__1_0.distcp", f"{prefix}/.metadata"])
    without = dataclasses.replace(marker, files={"__0_0.distcp": marker.files["__0_0.distcp"]})
    with pytest.raises(store.CheckpointError, match=r"\.metadata: missing"):
        store.publish(prefix, without)
    assert store.scan(root) == []


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
    assert [n for n in in_progress if n.endswith("/.metadata")] and store.MARKER not in in_progress

    resumed = kill_test._start(spec, log_dir)
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err.decode(errors="replace")[-3000:]
    assert re.search(
        rf"resumed from {re.escape(str(root))}/step-00000002/a-[0-9a-f]{{16}} \(step 2",
        (log_dir / "rank-0.log").read_text(),
    )
    assert max(kill_test._losses(log_dir)) == 6
    # step 4 saved again and published; the resumed run (a new UID, as every `meshtrain run` is)
    # keeps its own newest 2 and never deletes step 2, which the killed run wrote (inherited)
    assert [p.step for p in store.scan(root)] == [2, 4, 6]

    out = tmp_path / "hf"
    assert main.main(["export", root.url, "-o", str(out)]) == 0
    with safe_open(str(out / "model.safetensors"), framework="pt") as exported:
        embedding = exported.get_tensor("transformer.wte.weight")
    assert tuple(embedding.shape) == (TINY["vocab"], TINY["hidden"])


def test_a_save_takes_the_sha256_the_store_kept_and_reads_nothing_back(s3_server, monkeypatch):
    root = store.location(s3_server.make_bucket("checksums") + "/job")
    prefix = _save(root, 2, b"p" * 1000)
    with storage.filesystem().open(f"{prefix.url[5:]}/__1_0.distcp", "wb", block_size=5 << 20) as f:
        f.write(bytes(range(256)) * (48 << 10))  # 12 MiB in parts: a composite checksum
    before = len(s3_server.operations())
    files = store.describe_files(prefix)
    assert "s3_GetObject" not in s3_server.operations()[before:], "nothing read back to hash"
    whole = hashlib.sha256(b"p" * 1000).digest()
    assert files["__0_0.distcp"]["s3_sha256"] == base64.b64encode(whole).decode()
    assert files["__1_0.distcp"]["s3_sha256_type"] == "COMPOSITE"
    store.publish(prefix, _marker(2, files))
    monkeypatch.setenv(store.REHASH_ENV, "1")
    found = store.latest(root)
    assert found is not None and found[0].path == prefix  # re-hashed: whole, composite as kept


def test_a_bucket_prune_keeps_the_checkpoints_another_job_uid_wrote(s3_server):
    root = store.location(s3_server.make_bucket("inherited") + "/job")
    assert isinstance(root, storage.ObjectPath)
    for step, uid in ((2, "old-uid"), (3, "new-uid"), (4, "new-uid")):
        prefix = _save(root, step, bytes([step]) * 100)
        marker = dataclasses.replace(
            _marker(step, store.describe_files(prefix)), extra={store.JOB_UID_KEY: uid}
        )
        store.publish(prefix, marker)
    store.prune(root, keep=1, uid="new-uid")
    assert [p.step for p in store.scan(root)] == [2, 4]  # the inherited step 2 is not this job's
