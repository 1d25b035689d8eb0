"""Ranks of a job scan a token file once between them (issue 33, item 6).

Four gloo ranks open the same two files without metadata or a scan record: each scans a quarter
of each file's ids (the counts of ``token_files.largest_id`` per rank), every rank gets the
largest id of the whole file (an id past the vocabulary planted in one rank's quarter is
refused on every rank, naming its position), the result is recorded once, and a second open
reads no id, and only rank 0 reads the files to check the record (the others learn the result
from it).  The engine's share (``engine.scan_share``) is the one used.

Tier: ``make test`` (trainer).
"""

from __future__ import annotations

from pathlib import Path

import mt_harness
import numpy as np
import torch

from meshtrain.api.spec import training as api_training
from meshtrain.trainer import engine
from meshtrain.trainer.data import dataset, token_files, vocab_scan

COUNTS = (40_000, 30_002)


def _open_counting(paths: list[str], vocab: int) -> dict:
    calls: list[int] = []
    real = token_files.largest_id
    token_files.largest_id = lambda ids: calls.append(len(ids)) or real(ids)
    share = engine.scan_share(torch.device("cpu"))
    training = api_training.Training(
        datasets=[{"path": p, "weight": 1.0} for p in paths], tokenDtype="uint16"
    )
    result: dict = {"share": (share.rank, share.size) if share else None}
    try:
        files = dataset.open_dataset(training, vocab=vocab, seq_len=8, share=share)
        result["lengths"] = [len(f.tokens) for f in files]
    except dataset.DatasetError as err:
        result["error"] = str(err)
    result["first"] = list(calls)
    calls.clear()
    reads = _count_record_reads()
    if "error" not in result:
        dataset.open_dataset(training, vocab=vocab, seq_len=8, share=share)
    result["second"] = list(calls)
    result["record_reads"] = len(reads)
    return result


def _count_record_reads() -> list[str]:
    """Calls of what reads a token file to check a record (its fingerprint, its sampled digest)."""
    reads: list[str] = []
    for name in ("fingerprint", "sampled_digest"):
        real = getattr(vocab_scan, name)
        setattr(
            vocab_scan, name, lambda *a, _real=real, _name=name: reads.append(_name) or _real(*a)
        )
    return reads


def _files(tmp_path: Path, planted: int | None = None) -> list[str]:
    paths = []
    for index, count in enumerate(COUNTS):
        ids = (np.arange(count) * 7919) % 1000
        if planted is not None and index == 1:
            ids[planted] = 1000
        path = tmp_path / f"t{index}.bin"
        ids.astype("<u2").tofile(path)
        paths.append(str(path))
    return paths


def test_four_ranks_scan_a_quarter_each_and_record_the_result_once(tmp_path):
    paths = _files(tmp_path)
    results = mt_harness.run_distributed(_open_counting, 4, paths, 1000)
    assert [r["share"] for r in results] == [(rank, 4) for rank in range(4)]
    for rank, result in enumerate(results):
        quarters = [count * (rank + 1) // 4 - count * rank // 4 for count in COUNTS]
        assert result["first"] == quarters, (rank, result["first"])
        assert result["second"] == []
        assert result["lengths"] == list(COUNTS)
    for path in paths:
        assert vocab_scan.largest_id(Path(path), "uint16") == 999


def test_an_id_past_the_vocabulary_in_one_ranks_quarter_is_refused_on_every_rank(tmp_path):
    planted = COUNTS[1] * 3 // 4 + 5  # in rank 3's quarter
    paths = _files(tmp_path, planted)
    results = mt_harness.run_distributed(_open_counting, 4, paths, 1000)
    for result in results:
        assert f"token id 1000 >= model vocab 1000 at position {planted}" in result["error"]


def test_only_rank_0_reads_the_files_to_check_their_records(tmp_path):
    results = mt_harness.run_distributed(_open_counting, 4, _files(tmp_path), 1000)
    assert [r["second"] for r in results] == [[]] * 4  # the record vouched for both files
    assert results[0]["record_reads"] >= len(COUNTS)
    assert [r["record_reads"] for r in results[1:]] == [0, 0, 0]
