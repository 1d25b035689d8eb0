"""The checkpoint directory protocol: atomic publish, COMPLETE marker, discovery, pruning, damage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from meshtrain.trainer.checkpointing import store

SHAPE = {"layers": 2, "hidden": 8, "heads": 2, "vocab": 16, "seq_len": 4, "ffn_hidden": 32}
LAYOUT = {"data": 2, "pipeline": 1, "tensor": 1, "zero_stage": 1}


def write_checkpoint(
    root: Path, step: int, payload: bytes = b"data", extra: dict | None = None
) -> Path:
    """A published checkpoint with one data file, through the real protocol."""
    tmp = store.new_tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / "__0_0.distcp").write_bytes(payload)
    (tmp / ".metadata").write_bytes(b"meta")
    marker = store.Marker(
        step=step, layout=LAYOUT, model=SHAPE, files=store.describe_files(tmp), extra=extra or {}
    )
    return store.publish(tmp, marker)


def test_publish_renames_tmp_and_writes_marker(tmp_path: Path) -> None:
    final = write_checkpoint(tmp_path, 40)
    assert final.name == "step-00000040"
    assert not list(tmp_path.glob(".tmp-*"))
    raw = json.loads((final / store.MARKER).read_text())
    assert raw["format"] == store.FORMAT and raw["step"] == 40 and raw["model"] == SHAPE
    assert raw["files"]["__0_0.distcp"]["bytes"] == 4
    assert store.MARKER not in raw["files"]


def test_latest_picks_newest_and_ignores_interrupted_saves(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20)
    interrupted = store.new_tmp_dir(tmp_path, 30)  # a save killed before publishing
    interrupted.mkdir()
    (interrupted / "__0_0.distcp").write_bytes(b"partial")
    (interrupted / ".metadata").write_bytes(b"meta")
    published, marker = store.latest(tmp_path)
    assert published.step == 20 and marker.step == 20


def test_empty_or_missing_directory_has_no_checkpoint(tmp_path: Path) -> None:
    assert store.latest(tmp_path / "absent") is None
    assert store.latest(tmp_path) is None


def test_the_pods_log_directory_beside_the_checkpoints_is_left_alone(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    write_checkpoint(tmp_path, 20)
    (tmp_path / "logs" / "trace").mkdir(parents=True)  # MESHTRAIN_LOG_DIR=<checkpoint.path>/logs
    (tmp_path / "logs" / "steps.jsonl").write_text("{}\n")
    published, _ = store.latest(tmp_path)
    assert published.step == 20
    store.prune(tmp_path, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["logs", "step-00000020"]
    assert (tmp_path / "logs" / "steps.jsonl").exists()


def test_prune_keeps_newest_and_clears_tmp(tmp_path: Path) -> None:
    for step in (10, 20, 30, 40):
        write_checkpoint(tmp_path, step)
    store.new_tmp_dir(tmp_path, 50).mkdir()
    store.prune(tmp_path, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000030", "step-00000040"]


@pytest.mark.parametrize(
    ("skips", "keep", "kept"),
    [
        ([0, 0, 1, 2], 2, [2, 3, 4]),  # the last good one outlives keep while skips follow it
        ([0, 1, 2, 3], 1, [1, 4]),
        ([0, 1, 0, 1], 1, [3, 4]),  # an older good one is not kept: a newer good one exists
        ([0, 0, 0, 0], 2, [3, 4]),
        ([1, 2, 3, 4], 1, [4]),  # no good one at all: nothing to protect
        ([None, None, 1, 2], 1, [2, 4]),  # markers written before the guard counted: good
    ],
)
def test_prune_never_deletes_the_last_good_checkpoint(
    tmp_path: Path, skips: list[int | None], keep: int, kept: list[int]
) -> None:
    for step, skipped in enumerate(skips, 1):
        extra = {} if skipped is None else {store.GUARD_SKIPS: skipped}
        write_checkpoint(tmp_path, step, extra=extra)
        store.prune(tmp_path, keep=keep)
    assert [p.step for p in store.scan(tmp_path)] == kept


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda d: (d / "__0_0.distcp").write_bytes(b"dat"),
            "__0_0.distcp: 3 bytes, the marker says 4",
        ),
        (lambda d: (d / "__0_0.distcp").write_bytes(b"DATA"), "__0_0.distcp: sha256"),
        (lambda d: (d / "__0_0.distcp").unlink(), "__0_0.distcp: listed in"),
        (
            lambda d: (d / store.MARKER).write_text("{not json"),
            "COMPLETE: not a valid completion marker",
        ),
        (lambda d: (d / store.MARKER).unlink(), "COMPLETE: missing"),
        (
            lambda d: (d / store.MARKER).write_text(json.dumps({"format": "other/2"})),
            "is not a meshtrain checkpoint",
        ),
    ],
    ids=["truncated", "corrupt", "missing-file", "bad-marker", "no-marker", "foreign-format"],
)
def test_damaged_newest_checkpoint_is_an_error_naming_the_file(
    tmp_path: Path, damage, message: str
) -> None:
    write_checkpoint(tmp_path, 10)
    newest = write_checkpoint(tmp_path, 20)
    damage(newest)
    with pytest.raises(store.CheckpointError, match=message.replace("(", r"\(")) as err:
        store.latest(tmp_path)
    assert "step-00000020" in str(err.value)


def test_foreign_entries_refuse_the_directory(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    (tmp_path / "model.pt").write_bytes(b"someone else's")
    with pytest.raises(store.CheckpointError, match="model.pt: not a meshtrain checkpoint"):
        store.latest(tmp_path)


def test_marker_step_must_match_directory(tmp_path: Path) -> None:
    final = write_checkpoint(tmp_path, 10)
    final.rename(tmp_path / "step-00000011")
    with pytest.raises(
        store.CheckpointError, match="says step 10 but the directory is step-00000011"
    ):
        store.latest(tmp_path)


def test_publish_refuses_to_overwrite(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 10)
    with pytest.raises(store.CheckpointError, match="already exists"):
        write_checkpoint(tmp_path, 10)
