"""ZeRO shard arithmetic and the memory formula, without processes."""

from __future__ import annotations

import pytest
import torch

from meshtrain.trainer.parallel import state_bytes, zero


@pytest.mark.parametrize("numel", [1, 7, 64, 1000, 1001])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8])
def test_shard_ranges_cover_each_element_once(numel: int, size: int) -> None:
    ranges = [zero.shard_range(numel, r, size) for r in range(size)]
    owned = [i for start, stop in ranges for i in range(start, stop)]
    assert owned == list(range(numel))
    assert all(stop - start <= zero.shard_size(numel, size) for start, stop in ranges)


def test_segments_split_parameters_at_shard_boundaries() -> None:
    numels = [6, 3, 5]  # flat 0..14 -> owners of 2 ranks: [0, 7), [7, 14)
    first = zero.segments(numels, 0, 7)
    second = zero.segments(numels, 7, 14)
    assert first == [
        zero.Segment(member=0, start=0, stop=6, shard_offset=0),
        zero.Segment(member=1, start=0, stop=1, shard_offset=6),
    ]
    assert second == [
        zero.Segment(member=1, start=1, stop=3, shard_offset=0),
        zero.Segment(member=2, start=0, stop=5, shard_offset=2),
    ]
    assert sum(s.numel for s in first + second) == sum(numels)


@pytest.mark.parametrize(
    ("stage", "dp", "expected"),
    [
        (0, 4, {"params": 4, "grads": 4, "optimizer": 8}),
        (1, 4, {"params": 4, "grads": 4, "optimizer": 2}),
        (2, 4, {"params": 4, "grads": 1, "optimizer": 2}),
    ],
)
def test_expected_bytes_follow_the_zero_paper(stage: int, dp: int, expected: dict) -> None:
    assert zero.expected_bytes_per_param(stage=stage, dp=dp) == expected
    mixed = zero.expected_bytes_per_param(stage=stage, dp=dp, weight=2, grad=2, optimizer=12)
    assert sum(mixed.values()) == {0: 16, 1: 2 + 2 + 3, 2: 2 + 0.5 + 3}[stage]


def test_measure_counts_each_storage_once() -> None:
    model = torch.nn.Linear(4, 3)  # 15 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    report = state_bytes.measure(model, optimizer, None)
    assert report.params == 15 and report.param_bytes == 60 and report.grad_bytes == 60
    assert report.optimizer_bytes == 2 * 60 + 2 * 4  # two moments + two scalar step counters
    assert report.per_param()["params"] == 4.0 and report.expected()["optimizer"] == 8.0
    assert "zero 0, dp 1" in report.summary()
