"""A tensor-parallel rank imports only its slices of a Hugging Face directory (issue 33, item 6).

For Llama (grouped-query, one key/value head replicated over tp2, a vocabulary that does not
split evenly) and GPT-2 (Conv1D, stored transposed) directories saved by transformers, every
rank's every parameter built by ``apply_tensor_parallel`` from the directory is bit for bit
the slice of the whole tensor (``shard`` of the dense read, today's import), and no sharded
parameter is read whole: the whole-tensor read is only asked for the replicated ones (norms).
The first-step losses of the layouts against transformers stay in test_hf_interop.py.

Tier: ``make test`` (trainer).
"""

from __future__ import annotations

import pytest
import torch
from test_hf_interop import LLAMA, TINY, _config, _hf_model

from meshtrain.trainer.interop import from_hf
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import pipeline, tensor

MODELS = {
    "llama-gqa": LLAMA,
    "llama-mqa-replicated": {**LLAMA, "kvHeads": 1},
    "llama-vocab257-padded": {**LLAMA, "vocab": 257},
    "gpt2-conv1d": TINY,
}


@pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("size", [2, 4])
def test_every_ranks_slices_equal_the_whole_tensors_cut_and_nothing_sharded_is_read_whole(
    model, size, tmp_path
):
    config = _config(model)
    _hf_model(config).save_pretrained(tmp_path)
    weights = from_hf.HFWeights(tmp_path, config)
    whole_reads: list[str] = []

    class Counting(from_hf.HFWeights):
        def __call__(self, name, shape):
            whole_reads.append(name)
            return super().__call__(name, shape)

    for rank in range(size):
        with torch.device("meta"):
            built = llama.build(config)
        built.initial_weights = Counting(tmp_path, config)
        [chunk] = pipeline.split_model(built, stage=0, stages=1, virtual_stages=1)
        plan = tensor.apply_tensor_parallel(
            chunk, tensor.TPContext(group=None, rank=rank, size=size)
        )
        assert plan.shards
        params = dict(chunk.named_parameters())
        for name, spec in plan.shards.items():
            local = params[name if name in params else "head.weight"]
            with torch.device("meta"):
                dense_shape = dict(llama.build(config).named_parameters())[name].shape
            expected = tensor.shard(weights(name, dense_shape), spec, rank, size)
            assert local.dtype == expected.dtype and torch.equal(local.detach(), expected), name
        assert not set(whole_reads) & set(plan.shards), sorted(set(whole_reads) & set(plan.shards))


@pytest.mark.parametrize("model", list(MODELS.values()), ids=list(MODELS))
@pytest.mark.parametrize("size", [2, 4])
def test_every_zero3_row_window_of_a_piece_equals_the_pieces_rows_from_the_directory_and_the_seed(
    model, size, tmp_path
):
    """ZeRO-3 over tensor parallelism (``shard_param`` with ``rows``): every FSDP2 shard's rows of
    every rank's piece, including shards left no rows (``torch.chunk`` over 3 and 12 data-parallel
    ranks), equal the same rows of the piece cut from the dense tensor, read from the directory or
    made from the seed."""
    config = _config(model)
    _hf_model(config).save_pretrained(tmp_path)
    weights = from_hf.HFWeights(tmp_path, config)
    sources = {"directory": weights, "seed": None}
    empty_windows = 0
    for source, initial in sources.items():
        for rank in range(size):
            with torch.device("meta"):
                built = llama.build(config, seed=3)
            built.initial_weights = initial
            [chunk] = pipeline.split_model(built, stage=0, stages=1, virtual_stages=1)
            with torch.device("meta"):
                dense_params = dict(llama.build(config).named_parameters())
            plan = tensor.apply_tensor_parallel(
                chunk, tensor.TPContext(group=None, rank=rank, size=size), on_meta=True
            )
            for name, spec in plan.shards.items():
                dense = dense_params[name]
                whole = (
                    weights(name, dense.shape) if initial else gpt.dense_value(built, name, dense)
                )
                piece = tensor.shard(whole, spec, rank, size)
                for data in (3, 12):
                    for window in torch.chunk(torch.arange(piece.shape[0]), data):
                        rows = (int(window[0]), int(window[-1]) + 1) if len(window) else (0, 0)
                        got = tensor.shard_param(chunk, name, dense, spec, rank, size, rows)
                        assert torch.equal(got, piece[rows[0] : rows[1]]), (source, name, rows)
                    # the last ranks of a chunked split may get nothing: (R, R)
                    per_rank = -(-piece.shape[0] // data)
                    last = (min((data - 1) * per_rank, piece.shape[0]),) * 2
                    if last[0] == piece.shape[0]:
                        empty_windows += 1
                        got = tensor.shard_param(chunk, name, dense, spec, rank, size, last)
                        assert got.shape[0] == 0, (source, name)
    assert empty_windows  # 12 ranks leave some piece's last rank no rows
