"""Process-free parts of the parallel code: sharding maps, bucket plans, stage splits, LR schedule."""

from __future__ import annotations

import copy

import pytest
import torch

from meshtrain.trainer.models import gpt
from meshtrain.trainer.optim import lr_schedule
from meshtrain.trainer.parallel import pipeline, reducer, tensor


@pytest.mark.parametrize(
    "spec", [tensor.ShardSpec(0), tensor.ShardSpec(1), tensor.ShardSpec(0, groups=3)]
)
@pytest.mark.parametrize("size", [1, 2, 4])
def test_shard_unshard_roundtrip(spec, size):
    full = torch.randn(24, 12)
    pieces = [tensor.shard(full, spec, r, size) for r in range(size)]
    assert torch.equal(tensor.unshard(pieces, spec), full)


def test_fused_qkv_shard_keeps_q_k_v_of_its_heads():
    full = torch.arange(12.0).reshape(12, 1)  # rows: q0..q3 | k0..k3 | v0..v3
    piece = tensor.shard(full, tensor.ShardSpec(0, groups=3), 1, 2)
    assert piece.flatten().tolist() == [2, 3, 6, 7, 10, 11]


def test_bucket_plan_fills_to_size():
    assert reducer.plan_buckets([10, 10, 10, 10, 10], 4, 80) == [[0, 1], [2, 3], [4]]
    assert reducer.plan_buckets([100, 1, 1], 4, 80) == [[0], [1, 2]]
    assert reducer.plan_buckets([1] * 5, 4, 10**9) == [[0, 1, 2, 3, 4]]


def test_split_layers_balanced():
    assert [list(r) for r in pipeline.split_layers(8, 4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    sizes = [len(r) for r in pipeline.split_layers(6, 4)]
    assert sizes == [1, 2, 2, 1] and sum(sizes) == 6


def test_split_model_chunks_compose_to_the_full_model():
    config = gpt.GPTConfig(vocab=64, seq_len=8, layers=4, hidden=16, heads=2, ffn_hidden=32)
    torch.manual_seed(0)
    full = gpt.GPT(config)
    ids = torch.randint(0, 64, (2, 8))
    expected = full(ids)
    stages = [
        pipeline.split_model(copy.deepcopy(full), stage=s, stages=2, virtual_stages=2)
        for s in range(2)
    ]
    x = ids
    for j in range(4):  # virtual stage j = chunk * stages + stage
        x = stages[j % 2][j // 2](x)
    torch.testing.assert_close(x, expected)
    names = {n for s in stages for c in s for n, _ in c.named_parameters()}
    assert names == {n for n, _ in full.named_parameters()}


def test_lr_warmup_then_cosine():
    kw = dict(peak=1.0, minimum=0.1, warmup=4, total=14)
    assert lr_schedule.lr_at(1, **kw) == pytest.approx(0.25)
    assert lr_schedule.lr_at(4, **kw) == pytest.approx(1.0)
    assert lr_schedule.lr_at(9, **kw) == pytest.approx(0.55)
    assert lr_schedule.lr_at(14, **kw) == pytest.approx(0.1)
    lrs = [lr_schedule.lr_at(s, **kw) for s in range(4, 15)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
