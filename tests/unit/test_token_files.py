"""Token files: a file read with the wrong element type is refused, and the vocabulary scan is recorded.

The misread files are made by numpy writing ids as one type; the test reads
them through the dataset as the other, as a job with the wrong
``training.tokenDtype`` would.  The scan record is checked by its effect: a
start on an unchanged file never calls the scan, any change scans again.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from meshtrain.api.spec import training as api_training
from meshtrain.trainer.data import dataset, token_files, vocab_scan


def _open(path, vocab, dtype="uint16"):
    return dataset.open_dataset(
        api_training.Training(dataset=str(path), tokenDtype=dtype), vocab=vocab, seq_len=8
    )


def _ids(count, vocab, offset=0):
    return offset + (np.arange(count, dtype=np.int64) * 7919) % vocab


@pytest.mark.parametrize(
    ("vocab", "offset"),
    [(1000, 0), (65_536, 70_000 - 65_536)],  # small ids; ids above 65,535 whose low halves fit
)
def test_uint32_tokens_read_as_uint16_are_refused_naming_the_field_and_the_fix(
    tmp_path, vocab, offset
):
    path = tmp_path / "raw.bin"
    ids = _ids(5000, vocab - offset, offset)
    ids.astype("<u4").tofile(path)
    model_vocab = 128_256 if offset else vocab
    assert len(_open(path, model_vocab, "uint32")[0].tokens) == 5000  # read as what it is: fine
    as_uint16 = np.fromfile(path, dtype="<u2")
    assert as_uint16.max() < 65_536 and (offset or as_uint16.max() < vocab)  # nothing out of range
    training = api_training.Training(dataset=str(path), tokenDtype="uint16")
    with pytest.raises(dataset.DatasetError) as err:  # before any process starts
        dataset.check_dataset(training, vocab=min(model_vocab, 65_536))
    message = str(err.value)
    assert "looks like uint32 tokens read as uint16" in message
    assert "spec.training.dataset" in message and str(path) in message
    assert "set spec.training.tokenDtype: uint32" in message


@pytest.mark.parametrize("vocab", [1000, 128_256])
def test_uint16_tokens_read_as_uint32_are_refused_naming_the_field_and_the_fix(tmp_path, vocab):
    path = tmp_path / "raw.bin"
    _ids(4000, min(vocab, 50_000)).astype("<u2").tofile(path)
    assert len(_open(path, min(vocab, 65_536))[0].tokens) == 4000
    with pytest.raises(dataset.DatasetError) as err:
        _open(path, vocab, "uint32")
    message = str(err.value)
    assert "looks like uint16 tokens read as uint32" in message
    assert "set spec.training.tokenDtype: uint16" in message and str(path) in message


def test_odd_count_of_uint16_read_as_uint32_names_the_other_dtype(tmp_path):
    path = tmp_path / "odd.bin"
    _ids(4001, 1000).astype("<u2").tofile(path)
    with pytest.raises(dataset.DatasetError, match="not a multiple of 4.*set tokenDtype: uint16"):
        _open(path, 1000, "uint32")


def test_byte_tokens_and_a_tiny_vocabulary_are_not_taken_for_misread_files(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    corpus = dataset.stdlib_corpus(cap_bytes=200_000)  # byte-level Python source, uint16
    assert len(_open(corpus, 256)[0].tokens) == 200_000
    tiny = tmp_path / "tiny.bin"
    (np.arange(4000) % 4).astype("<u2").tofile(tiny)  # every id <= 3: no high half to tell
    assert len(_open(tiny, 4)[0].tokens) == 4000


def test_metadata_of_another_version_of_the_file_is_refused(tmp_path):
    path = tmp_path / "t.bin"
    _ids(3000, 1000).astype("<u2").tofile(path)
    meta = token_files.metadata_path(path)
    meta.write_text(json.dumps({"dtype": "uint16", "vocab": 1000, "tokens": 3000, "bytes": 6000}))
    assert len(_open(path, 1000)[0].tokens) == 3000
    _ids(2000, 1000).astype("<u2").tofile(path)  # rewritten without preparing it again
    with pytest.raises(dataset.DatasetError) as err:
        _open(path, 1000)
    assert "has 4000 bytes but t.bin.json describes a file of 6000 bytes" in str(err.value)
    assert "meshtrain data prepare" in str(err.value) and "spec.training.dataset" in str(err.value)
    meta.write_text("{truncated")
    with pytest.raises(
        dataset.DatasetError, match="unreadable metadata t.bin.json .* or delete t.bin.json"
    ):
        _open(path, 1000)


def test_metadata_settles_the_type_of_a_file_that_looks_misread(tmp_path):
    path = tmp_path / "t.bin"
    ids = np.zeros(4000, dtype="<u2")
    ids[::2] = _ids(2000, 1000)  # every second id 0: what uint32 ids read as uint16 look like
    ids.tofile(path)
    with pytest.raises(dataset.DatasetError, match="looks like uint32"):
        _open(path, 1000)
    token_files.metadata_path(path).write_text(json.dumps({"dtype": "uint16", "vocab": 1000}))
    assert len(_open(path, 1000)[0].tokens) == 4000


def _scans(monkeypatch):
    calls = []
    real = token_files.largest_id
    monkeypatch.setattr(token_files, "largest_id", lambda ids: calls.append(len(ids)) or real(ids))
    return calls


def test_a_restart_on_an_unchanged_file_skips_the_scan_and_a_change_scans_again(
    tmp_path, monkeypatch
):
    path = tmp_path / "t.bin"
    _ids(5000, 1000).astype("<u2").tofile(path)
    calls = _scans(monkeypatch)
    _open(path, 1000)
    assert calls == [5000] and vocab_scan.beside(path).is_file()
    _open(path, 1000)
    _open(path, 1000)
    assert calls == [5000]  # restarts read the record, not the file
    first = int(np.argmax(_ids(5000, 1000) >= 999))
    with pytest.raises(
        dataset.DatasetError, match=f"token id 999 >= model vocab 999 at position {first}"
    ):
        _open(
            path, 999
        )  # a smaller vocabulary: the record's largest id is refused, the scan finds where
    assert calls == [5000]

    stat = path.stat()
    ids = _ids(5000, 1000)
    ids[-1] = 1000  # same size, the last id out of range
    ids.astype("<u2").tofile(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with the old mtime
    with pytest.raises(
        dataset.DatasetError, match="token id 1000 >= model vocab 1000 at position 4999"
    ):
        _open(path, 1000)
    assert calls == [5000, 5000]

    np.concatenate([_ids(5000, 1000), [3]]).astype("<u2").tofile(path)  # appended to
    _open(path, 1000)
    assert calls == [5000, 5000, 5001]
    _open(path, 1000)
    assert calls == [5000, 5000, 5001]


def test_a_read_only_directory_records_the_scan_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "t.bin"
    _ids(5000, 1000).astype("<u2").tofile(path)
    blocked = tmp_path / "not-a-directory"
    blocked.write_text(
        ""
    )  # writing under a file fails, as on a read-only volume (tests run as root)
    monkeypatch.setattr(vocab_scan, "beside", lambda p: blocked / (p.name + vocab_scan.SUFFIX))
    calls = _scans(monkeypatch)
    _open(path, 1000)
    _open(path, 1000)
    assert calls == [5000]
    assert vocab_scan.in_cache(path).is_file()
    assert vocab_scan.in_cache(path).parent == tmp_path / "cache" / "token-scans"


def test_a_record_for_the_other_element_type_is_not_trusted(tmp_path, monkeypatch):
    path = tmp_path / "t.bin"
    _ids(4000, 60_000).astype("<u2").tofile(path)
    fingerprint = vocab_scan.fingerprint(path, "uint32")
    vocab_scan.record(path, "uint32", 10, fingerprint)  # a record of the bytes read as uint32
    calls = _scans(monkeypatch)
    _open(path, 60_000)
    assert calls == [4000]


def test_a_glob_skips_the_files_meshtrain_writes_beside_token_files(tmp_path):
    for name in ("a.bin", "b.bin"):
        _ids(3000, 1000).astype("<u2").tofile(tmp_path / name)
    token_files.metadata_path(tmp_path / "a.bin").write_text(json.dumps({"dtype": "uint16"}))
    _open(tmp_path / "a.bin", 1000)  # writes a.bin.scan.json
    files = _open(tmp_path / "*", 1000)
    assert [f.path.name for f in files] == ["a.bin", "b.bin"]
