"""A snapshot file read back only into tensors its header matches, every read bounded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from meshtrain.trainer.checkpointing import snapshot_file, store

FACTS = {
    "version": 1,
    "rank": 0,
    "world": 2,
    "step": 4,
    "layout": {"data": 2},
    "model": {"layers": 2},
}


def _entries(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(3, 4, generator=generator),
        "model.h": torch.randn(5, generator=generator).to(torch.bfloat16),
        "rng.0": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=generator),
    }


def _written(tmp_path: Path) -> tuple[Path, dict[str, object]]:
    entries = _entries(1)
    head = snapshot_file.header(FACTS, entries, '{"step": 4}')
    return snapshot_file.write(tmp_path, head, entries), head


def test_a_snapshot_loads_back_bit_for_bit(tmp_path: Path) -> None:
    path, head = _written(tmp_path)
    assert path.name == snapshot_file.name(0, 4)
    assert snapshot_file.listing(tmp_path) == ({(0, 4)}, [])
    live = _entries(2)
    found = snapshot_file.load(path, head | {"record": ""}, live)
    assert found["record"] == '{"step": 4}'
    assert all(torch.equal(live[k], v) for k, v in _entries(1).items())


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"layout": {"data": 1}}, "layout"),
        ({"model": {"layers": 3}}, "model shape"),
        ({"step": 6}, "step"),
    ],
    ids=["layout", "model", "step"],
)
def test_another_layout_model_or_step_is_refused(tmp_path: Path, change: dict, words: str) -> None:
    path, head = _written(tmp_path)
    with pytest.raises(store.CheckpointError, match=words):
        snapshot_file.check(path, head | change)


def test_other_tensors_are_refused_before_any_data_is_read(tmp_path: Path) -> None:
    path, _ = _written(tmp_path)
    other = _entries(1) | {"model.w": torch.zeros(4, 3)}
    with pytest.raises(store.CheckpointError, match="tensors"):
        snapshot_file.load(path, snapshot_file.header(FACTS, other, ""), other)


def test_a_hostile_header_length_or_a_truncated_file_is_refused(tmp_path: Path) -> None:
    path, head = _written(tmp_path)
    data = bytearray(path.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # a header "of 4 EiB": never allocated
    path.write_bytes(bytes(data))
    with pytest.raises(store.CheckpointError, match="header of"):
        snapshot_file.check(path, head)
    path, head = _written(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(store.CheckpointError, match="its header lists"):
        snapshot_file.check(path, head)
    path.write_bytes(b"not a snapshot")
    with pytest.raises(store.CheckpointError, match="not a meshtrain"):
        snapshot_file.check(path, head)


def test_an_unreadable_trainer_record_is_refused(tmp_path: Path) -> None:
    entries = _entries(1)
    head = snapshot_file.header(FACTS, entries, "{not json")
    path = snapshot_file.write(tmp_path, head, entries)
    with pytest.raises(store.CheckpointError, match="trainer record"):
        snapshot_file.check(path, head)


def test_a_snapshot_larger_than_the_free_room_is_not_started(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = _entries(1)
    head = snapshot_file.header(FACTS, entries, "{}")
    real = os.statvfs(tmp_path)
    full = os.statvfs_result((real.f_bsize, 1, 0, 0, 0, 0, 0, 0, 0, 255))  # no block free
    monkeypatch.setattr(os, "statvfs", lambda path: full)
    with pytest.raises(OSError, match="bytes needed"):
        snapshot_file.write(tmp_path, head, entries)
    assert list(tmp_path.iterdir()) == []  # not even a temporary file
