"""Token files are scanned once (issue 33, item 6): ``data prepare``'s metadata vouches for a file.

``data prepare`` records the largest id with the byte count and a digest of sampled blocks; a
job opening the unchanged file (even a copy of it, whose modification time differs) reads no id
of it, and a rewrite of a sampled block (same size, an id past the vocabulary put there) is
noticed: the file is scanned and refused at that id's position; so is an id past the vocabulary
written in place into the prepared file outside the sampled blocks (its modification time).  The scan itself is counted by
replacing ``token_files.largest_id``.

Tier: ``make test`` (unit).
"""

from __future__ import annotations

import json
import shutil
import time

import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtrain.api.spec import training as api_training
from meshtrain.cli import main
from meshtrain.trainer.data import dataset, token_files, vocab_scan


def _prepared(tmp_path, count: int = 200_000):
    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 300)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    text = tmp_path / "docs.txt"
    text.write_text(" ".join(f"w{2 + (i * 37) % 290}" for i in range(count)))
    out = tmp_path / "tokens.bin"
    argv = ["data", "prepare", str(text), "--tokenizer", str(tmp_path / "tokenizer.json")]
    assert main.main([*argv, "-o", str(out)]) == 0
    return out


def _scans(monkeypatch):
    calls: list[int] = []
    real = token_files.largest_id
    monkeypatch.setattr(token_files, "largest_id", lambda ids: calls.append(len(ids)) or real(ids))
    return calls


def _open(path, vocab=300):
    return dataset.open_dataset(api_training.Training(dataset=str(path)), vocab=vocab, seq_len=8)


def test_prepare_records_the_largest_id_and_a_job_reads_no_id_for_it(tmp_path, monkeypatch):
    out = _prepared(tmp_path)
    meta = json.loads(token_files.metadata_path(out).read_text())
    assert meta["max_id"] == int(np.fromfile(out, dtype="<u2").max())
    assert meta["sample_sha256"] == vocab_scan.sampled_digest(out)
    calls = _scans(monkeypatch)
    _open(out)
    copy = tmp_path / "copy" / "tokens.bin"  # another volume: new mtime, same bytes
    copy.parent.mkdir()
    shutil.copyfile(out, copy)
    shutil.copyfile(token_files.metadata_path(out), token_files.metadata_path(copy))
    _open(copy)
    assert calls == []
    assert not vocab_scan.beside(out).exists()  # nothing to record: nothing was scanned


def test_a_rewritten_sampled_block_is_noticed_scanned_and_refused_where_it_is(
    tmp_path, monkeypatch
):
    out = _prepared(tmp_path)
    ids = np.fromfile(out, dtype="<u2")
    size = out.stat().st_size
    position = (size - vocab_scan.SAMPLE_BYTES) * 7 // (vocab_scan.SAMPLE_BLOCKS - 1) // 2 + 3
    ids[position] = 299 + 1  # one id past the vocabulary, inside the 8th sampled block
    ids.tofile(out)
    assert out.stat().st_size == size
    calls = _scans(monkeypatch)
    with pytest.raises(
        dataset.DatasetError, match=f"token id 300 >= model vocab 300 at position {position}"
    ):
        _open(out)
    assert calls == [len(ids)]


def test_metadata_without_a_recorded_largest_id_is_scanned_once_then_recorded(
    tmp_path, monkeypatch
):
    out = _prepared(tmp_path)
    meta_path = token_files.metadata_path(out)
    meta = json.loads(meta_path.read_text())
    del meta["max_id"], meta["sample_sha256"]  # written by an older meshtrain
    meta_path.write_text(json.dumps(meta))
    calls = _scans(monkeypatch)
    _open(out)
    _open(out)
    assert calls == [meta["tokens"]]


def test_an_in_place_edit_outside_the_sampled_blocks_is_noticed_by_its_time(tmp_path, monkeypatch):
    out = _prepared(tmp_path, count=700_000)  # large enough for gaps between the sampled blocks
    size = out.stat().st_size
    second_block = (size - vocab_scan.SAMPLE_BYTES) // (vocab_scan.SAMPLE_BLOCKS - 1)
    assert second_block > vocab_scan.SAMPLE_BYTES
    position = (vocab_scan.SAMPLE_BYTES + second_block) // 4  # an id between blocks 1 and 2
    digest = vocab_scan.sampled_digest(out)
    time.sleep(0.05)  # past the file system's timestamp granularity
    with out.open("r+b") as handle:
        handle.seek(position * 2)
        handle.write(np.array([300], dtype="<u2").tobytes())
    assert vocab_scan.sampled_digest(out) == digest and out.stat().st_size == size
    calls = _scans(monkeypatch)
    with pytest.raises(
        dataset.DatasetError, match=f"token id 300 >= model vocab 300 at position {position}"
    ):
        _open(out)
    assert calls == [size // 2]
