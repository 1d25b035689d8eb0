"""Chained bucket exchanges are issued in bucket index order whatever order the hooks fire in."""

from __future__ import annotations

import torch

from meshtrain.trainer.parallel import exchanges
from meshtrain.trainer.telemetry import recording


class _Recording(exchanges.QueuedGradReducer):
    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        super().__init__(
            params, group=None, group_size=1, bucket_mb=0.0, recorder=recording.MemoryRecorder()
        )
        self.issued: list[int] = []

    def _exchange(self, bucket) -> None:
        self.issued.append(bucket.index)


def _reducer() -> _Recording:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(4)]
    reducer = _Recording(params)  # bucket_mb 0: one parameter per bucket, the last registered first
    assert [len(b.params) for b in reducer.buckets] == [1, 1, 1, 1]
    return reducer


def _ready(reducer: _Recording, index: int) -> None:
    reducer._on_grad(reducer.buckets[index].params[0])
    reducer.exchanges.drain()  # the worker has run what was submitted so far


def test_a_ready_bucket_waits_for_every_lower_one_and_finish_issues_the_rest_in_order():
    reducer = _reducer()
    try:
        _ready(reducer, 2)
        assert reducer.issued == []  # bucket 0 not ready yet
        _ready(reducer, 0)
        assert reducer.issued == [0]
        _ready(reducer, 1)
        assert reducer.issued == [0, 1, 2]
        reducer.finish()  # bucket 3 never became ready (an unused parameter)
        assert reducer.issued == [0, 1, 2, 3]
        # next step: the same order though only the last bucket fired before finish
        reducer.issued.clear()
        _ready(reducer, 3)
        assert reducer.issued == []
        reducer.finish()
        assert reducer.issued == [0, 1, 2, 3]
    finally:
        reducer.remove()
