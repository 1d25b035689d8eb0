"""Small files a tenant controls are read bounded: an oversized one is refused naming it, its size and the bound.

Each file is made larger than its bound in :mod:`meshtrain.api.limits` as a sparse file (no disk
used) and reached the way a user reaches it: ``meshtrain run`` (:func:`.launch.run_local`) over a
token file with oversized ``data prepare`` metadata or scan record, a resume past an oversized
``COMPLETE`` marker, and the dataset check ``run`` makes with a ``fromHF`` directory whose
``generation_config.json`` is oversized.  Beside each, the same file at its normal size still
works, so the bound refuses only what is too large.  ``make test`` tier.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import mt_harness
import numpy as np
import pytest

from meshtrain.api import exitcodes, limits
from meshtrain.api.spec import training as api_training
from meshtrain.trainer import launch
from meshtrain.trainer.checkpointing import store
from meshtrain.trainer.data import dataset, token_files, vocab_scan
from tests.builders import JobBuilder

VOCAB = 256
"""The vocabulary of :meth:`JobBuilder.cpu_run`'s model."""


def _token_file(directory: Path) -> Path:
    path = directory / "corpus.bin"
    (np.arange(4096, dtype=np.int64) % VOCAB).astype("<u2").tofile(path)
    return path


def _oversized(path: Path, bound: int) -> int:
    """Make ``path`` a sparse file one byte over ``bound``; its size."""
    with path.open("wb") as handle:
        handle.truncate(bound + 1)
    return bound + 1


def _refusal(text: str, path: Path, size: int, bound: int) -> None:
    assert f"{path}: {size} bytes, more than the {bound}" in text, text[-3000:]


def _run(tmp_path: Path, raw: dict) -> int:
    spec = mt_harness.write_job(tmp_path, raw)
    return launch.run_local(spec, log_dir=tmp_path / "logs")


def test_oversized_token_metadata_is_refused_by_run(tmp_path: Path, capsys) -> None:
    corpus = _token_file(tmp_path)
    meta = token_files.metadata_path(corpus)
    size = _oversized(meta, limits.MAX_TOKEN_METADATA_BYTES)
    code = _run(tmp_path, JobBuilder.cpu_run().training(dataset=str(corpus)).raw())
    assert code == exitcodes.DATA
    err = capsys.readouterr().err
    _refusal(err, meta, size, limits.MAX_TOKEN_METADATA_BYTES)
    assert "spec.training.dataset" in err
    assert not (tmp_path / "logs").exists(), "refused before any rank started"


@pytest.mark.slow
def test_oversized_scan_record_is_refused_by_the_ranks_and_a_normal_one_is_used(
    tmp_path: Path,
) -> None:
    corpus = _token_file(tmp_path)
    raw = JobBuilder.cpu_run().training(dataset=str(corpus), steps=1).raw()
    (tmp_path / "first").mkdir()
    assert _run(tmp_path / "first", raw) == 0
    record = vocab_scan.beside(corpus)
    assert json.loads(record.read_text())["max_id"] == VOCAB - 1  # the first run recorded its scan

    size = _oversized(record, limits.MAX_SCAN_RECORD_BYTES)
    (tmp_path / "second").mkdir()
    assert _run(tmp_path / "second", raw) == exitcodes.DATA
    _refusal(
        (tmp_path / "second" / "logs" / "rank-0.log").read_text(),
        record,
        size,
        limits.MAX_SCAN_RECORD_BYTES,
    )


@pytest.mark.slow
def test_oversized_checkpoint_marker_is_refused_on_resume(tmp_path: Path) -> None:
    raw = JobBuilder.cpu_run().training(steps=2).checkpoint(intervalSteps=2, keep=1).raw()
    assert _run(tmp_path, raw) == 0
    root = tmp_path / "logs" / "checkpoints"
    (published,) = store.scan(root)
    marker = published.path / store.MARKER
    store.read_marker(published.path)  # a normal marker reads
    size = _oversized(marker, limits.MAX_CHECKPOINT_MARKER_BYTES)

    assert _run(tmp_path, raw) == exitcodes.CHECKPOINT
    _refusal(
        (tmp_path / "logs" / "rank-0.log").read_text(),
        marker,
        size,
        limits.MAX_CHECKPOINT_MARKER_BYTES,
    )


def test_oversized_generation_config_of_from_hf_is_refused_by_the_dataset_check(
    tmp_path: Path,
) -> None:
    corpus = _token_file(tmp_path)
    meta = {"dtype": "uint16", "vocab": VOCAB, "bytes": corpus.stat().st_size, "eos_id": 0}
    token_files.metadata_path(corpus).write_text(json.dumps(meta))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"eos_token_id": 0}))
    training = api_training.Training(dataset=str(corpus))
    dataset.check_dataset(training, vocab=VOCAB, from_hf=str(model))  # normal files pass

    generation = model / "generation_config.json"
    size = _oversized(generation, limits.MAX_HF_JSON_BYTES)
    with pytest.raises(dataset.DatasetError) as refused:
        dataset.check_dataset(training, vocab=VOCAB, from_hf=str(model))
    _refusal(str(refused.value), generation, size, limits.MAX_HF_JSON_BYTES)
    assert os.stat(generation).st_blocks < 64, "the sparse file took no disk"
