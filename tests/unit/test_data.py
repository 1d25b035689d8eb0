"""Data: the stdlib corpus, user token files and layout-independent batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meshtrain.api import loading
from meshtrain.api.spec import training as api_training
from meshtrain.trainer.data import batches, dataset, token_files
from tests.builders import JobBuilder


@pytest.fixture()
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("MESHTRAIN_CACHE_DIR", str(tmp_path / "cache"))
    return dataset.stdlib_corpus(cap_bytes=200_000)


def test_stdlib_corpus_is_bytes_of_python_source(corpus):
    tokens = np.fromfile(corpus, dtype="<u2")
    assert len(tokens) == 200_000
    assert tokens.max() < 256
    text = bytes(tokens[:5000].astype(np.uint8)).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text


def test_corpus_is_cached(corpus):
    before = corpus.stat().st_mtime_ns
    assert dataset.stdlib_corpus(cap_bytes=200_000) == corpus
    assert corpus.stat().st_mtime_ns == before


def _training(**fields):
    return api_training.Training.model_validate(fields)


def test_missing_token_file_names_path_and_field(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(dataset.DatasetError) as err:
        dataset.check_dataset(_training(dataset=str(missing)), vocab=256)
    assert str(missing) in str(err.value) and "spec.training.dataset" in str(err.value)
    missing.touch()
    mixture = _training(datasets=[{"path": str(missing)}, {"path": str(tmp_path / "x*.bin")}])
    with pytest.raises(
        dataset.DatasetError, match=r"spec.training.datasets\[1\]: the glob .* matches no"
    ):
        dataset.check_dataset(mixture, vocab=256)


def test_user_token_file_checked_against_vocab(tmp_path):
    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype="<u2").tofile(path)
    assert len(dataset.load_tokens(str(path), vocab=1000, seq_len=16)) == 1000
    with pytest.raises(
        dataset.DatasetError, match="token id 500 >= model vocab 500 at position 500"
    ):
        dataset.load_tokens(str(path), vocab=500, seq_len=16)
    path.write_bytes(b"abc")
    with pytest.raises(dataset.DatasetError, match="not a multiple of 2"):
        dataset.load_tokens(str(path), vocab=1000, seq_len=16)


def _sampler(tokens, dp_rank, dp, m, seed=5):
    return batches.BatchSampler(
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


def test_every_token_is_checked_not_just_the_first_million(tmp_path, monkeypatch):
    path = tmp_path / "tokens.bin"
    ids = np.arange(3_000_000, dtype=np.uint32) % 1000
    ids[2_999_990] = 1000  # far past the first 2**20 tokens
    ids.astype("<u4").tofile(path)
    monkeypatch.setattr(token_files, "CHECK_CHUNK_TOKENS", 1 << 18)  # several chunks
    with pytest.raises(dataset.DatasetError) as err:
        dataset.open_dataset(
            _training(dataset=str(path), tokenDtype="uint32"), vocab=1000, seq_len=8
        )
    message = str(err.value)
    assert "token id 1000 >= model vocab 1000 at position 2999990" in message
    assert str(path) in message and "spec.training.dataset" in message


def test_uint32_ids_above_uint16_load_and_uint16_refuses_a_large_vocab(tmp_path):
    path = tmp_path / "big.bin"
    np.arange(70_000, 70_100, dtype="<u4").tofile(path)
    opened = dataset.open_dataset(
        _training(dataset=str(path), tokenDtype="uint32"), vocab=128_256, seq_len=8
    )
    assert int(opened[0].tokens.max()) == 70_099
    with pytest.raises(dataset.DatasetError) as err:
        dataset.open_dataset(_training(dataset=str(path)), vocab=128_256, seq_len=8)
    assert str(path) in str(err.value) and "spec.training.tokenDtype: uint32" in str(err.value)


def test_prepared_metadata_with_another_dtype_is_refused(tmp_path):
    path = tmp_path / "t.bin"
    np.arange(100, dtype="<u2").tofile(path)
    (tmp_path / "t.bin.json").write_text('{"dtype": "uint32", "vocab": 100}')
    with pytest.raises(dataset.DatasetError, match="holds uint32 tokens .* set tokenDtype: uint32"):
        dataset.open_dataset(_training(dataset=str(path)), vocab=100, seq_len=8)


def _mixture(tmp_path):
    a, b = tmp_path / "a.bin", tmp_path / "b.bin"
    (np.arange(4000) % 100).astype("<u2").tofile(a)  # ids 0..99
    (100 + np.arange(4000) % 100).astype("<u2").tofile(b)  # ids 100..199
    return _training(datasets=[{"path": str(a), "weight": 3}, {"path": str(b), "weight": 1}])


def test_mixture_draws_by_weight_the_same_on_every_layout_and_resume(tmp_path):
    files = dataset.open_dataset(_mixture(tmp_path), vocab=200, seq_len=8)
    reference = _sampler(files, 0, 1, 1)
    drawn = [reference.next()[0].inputs for _ in range(200)]
    from_b = sum(int((batch[:, 0] >= 100).sum()) for batch in drawn)
    share = from_b / (200 * 8)
    assert 0.2 < share < 0.3, share  # weight 1 of 4
    for batch in drawn:  # a window never straddles two sources
        assert ((batch >= 100).all(dim=1) | (batch < 100).all(dim=1)).all()
    for dp, m in [(2, 1), (4, 2)]:
        parts = [mb for r in range(dp) for mb in _sampler(files, r, dp, m).next()]
        assert torch.equal(torch.cat([p.inputs for p in parts]), drawn[0])
    resumed = _sampler(files, 0, 1, 1)
    resumed.load_state_dict({"position": 150, "seed": 5})
    assert torch.equal(resumed.next()[0].inputs, drawn[150])


def test_glob_weights_files_by_their_tokens(tmp_path):
    for name, count in (("p1.bin", 3000), ("p2.bin", 1000)):
        np.zeros(count, dtype="<u2").tofile(tmp_path / name)
    files = dataset.open_dataset(_training(dataset=str(tmp_path / "p*.bin")), vocab=10, seq_len=8)
    assert [f.path.name for f in files] == ["p1.bin", "p2.bin"]
    assert [f.weight for f in files] == [0.75, 0.25]


def test_spec_refuses_dataset_and_datasets_together():
    with pytest.raises(loading.SpecError, match="spec.training.datasets: both dataset="):
        loading.parse_spec(
            JobBuilder().training(dataset="/x.bin", datasets=[{"path": "/y.bin"}]).raw()
        )


class _CountingTokens(np.ndarray):
    """A token array that counts the windows sliced out of it."""

    windows_read = 0

    def __getitem__(self, key):
        if isinstance(key, slice):
            type(self).windows_read += 1
        return np.asarray(super().__getitem__(key))


def test_each_data_parallel_rank_reads_only_its_own_windows():
    tokens = (np.arange(5000, dtype=np.uint16) % 251).view(_CountingTokens)
    dp, m = 4, 1
    whole = _sampler(np.asarray(tokens), 0, dp, m).global_batch_at(0)  # (G, T+1): the global batch
    rows = []
    for rank in range(dp):
        _CountingTokens.windows_read = 0
        parts = _sampler(tokens, rank, dp, m).next()
        assert _CountingTokens.windows_read == len(whole) // dp  # not the global batch's
        rows += [torch.cat([p.inputs, p.targets[:, -1:]], dim=1) for p in parts]
    assert torch.equal(torch.cat(rows), whole)
