"""Data: the stdlib corpus, user token files and layout-independent batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtrain.trainer import data


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return data.stdlib_corpus(cap_bytes=200_000)


def test_stdlib_corpus_is_bytes_of_python_source(corpus):
    tokens = np.fromfile(corpus, dtype="<u2")
    assert len(tokens) == 200_000
    assert tokens.max() < 256
    text = bytes(tokens[:5000].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_corpus_is_cached(corpus):
    before = corpus.stat().st_mtime_ns
    assert data.stdlib_corpus(cap_bytes=200_000) == corpus
    assert corpus.stat().st_mtime_ns == before


def test_missing_token_file_names_path_and_field(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(data.DatasetError) as err:
        data.check_dataset(str(missing))
    assert str(missing) in str(err.value) and "spec.training.dataset" in str(err.value)


def test_user_token_file_checked_against_vocab(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    assert len(data.load_tokens(str(path), vocab=1000, seq_len=16)) == 1000
    with pytest.raises(data.DatasetError, match="token id 999 >= model vocab 500"):
        data.load_tokens(str(path), vocab=500, seq_len=16)
    path.write_bytes(b"abc")
    with pytest.raises(data.DatasetError, match="odd byte count"):
        data.load_tokens(str(path), vocab=1000, seq_len=16)


def _sampler(tokens, dp_rank, dp, m, seed=5):
    return data.BatchSampler(
        tokens,
        seq_len=8,
        micro_batch=8 // (dp * m),
        micro_batches=m,
        dp_rank=dp_rank,
        dp_size=dp,
        seed=seed,
    )


def test_every_layout_sees_the_same_global_batch():
    tokens = np.arange(5000, dtype=np.uint16) % 251
    reference = _sampler(tokens, 0, 1, 1).next()[0]
    for dp, m in [(2, 1), (2, 2), (4, 2), (1, 4), (8, 1)]:
        parts = [mb for r in range(dp) for mb in _sampler(tokens, r, dp, m).next()]
        assert len(parts) == dp * m
        assert torch.equal(torch.cat([p.inputs for p in parts]), reference.inputs)
        assert torch.equal(torch.cat([p.targets for p in parts]), reference.targets)


def test_targets_are_inputs_shifted():
    tokens = np.arange(5000, dtype=np.uint16) % 251
    mb = _sampler(tokens, 0, 1, 1).next()[0]
    assert torch.equal(mb.inputs[:, 1:], mb.targets[:, :-1])


def test_seed_decides_order_and_position_restores():
    tokens = np.arange(5000, dtype=np.uint16) % 251
    a, b = _sampler(tokens, 0, 1, 1), _sampler(tokens, 0, 1, 1, seed=6)
    assert not torch.equal(a.next()[0].inputs, b.next()[0].inputs)
    a.next()
    state = a.state_dict()
    third = a.next()[0].inputs
    fresh = _sampler(tokens, 0, 1, 1)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.next()[0].inputs, third)
    with pytest.raises(ValueError, match="seed"):
        b.load_state_dict(state)
