"""Bucket exchanges that are chains of collectives, overlapped with backward on one background thread.

The flat reducer's exchange is one asynchronous all-reduce per bucket.  The
hierarchical all-reduce (reduce-scatter, all-reduce, all-gather, each
needing the previous one's result) and the compressed exchanges (quantise,
gather, decode; PowerSGD's two all-reduces with an orthonormalisation
between) are chains, so :class:`QueuedGradReducer` hands each bucket's
whole chain, when its gradients are final (the reducer's hook), to an
:class:`ExchangeQueue`: one worker thread that runs the chains in the order
the buckets became ready, with blocking collectives, while backward goes on
computing earlier layers on the calling thread.  This is what PyTorch DDP's
communication hooks do with futures (``powerSGD_hook`` runs per bucket);
one thread in bucket order keeps every rank issuing the same collectives in
the same order on each process group, which the backends require.

What stays exposed after backward is the exchange of the buckets that
became ready last (at least the last bucket's whole chain), which is what
the planner charges (:func:`meshtrain.planner.cost._stage_time`).  On CUDA
the chain runs on the clock's exchange stream after the bucket's ready mark
(:mod:`.clocks`), so neither the host nor backward's stream waits for it
until :meth:`ExchangeQueue.drain`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils import _python_dispatch as python_dispatch

from meshtrain.trainer.parallel import clocks, reducer


class ExchangeQueue:
    """Runs bucket exchanges on one worker thread, first ready first run."""

    def __init__(self, clock: clocks.Clock) -> None:
        self.clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def submit(self, exchange: Callable[[], None]) -> None:
        """Queue ``exchange`` now that its inputs are final (call on the thread that produced them)."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshtrain-exchange")
        ready: Any = self.clock.mark_ready()
        threads = torch.get_num_threads()
        modes = python_dispatch._get_current_dispatch_mode_stack()
        self._pending.append(self._pool.submit(self._run, exchange, ready, threads, modes))

    def _run(
        self, exchange: Callable[[], None], ready: Any, threads: int, modes: list[Any]
    ) -> None:
        torch.set_num_threads(threads)  # the caller's intra-op budget, not the default
        # the caller's dispatch modes (a memory tracker, a FLOP counter) see the exchange's ops, as
        # autograd's worker threads inherit them
        for mode in modes:
            python_dispatch._push_mode(mode)
        try:
            with self.clock.exchange_stream(ready):
                exchange()
        finally:
            for _ in modes:
                python_dispatch._pop_mode()

    def drain(self) -> None:
        """Wait for every queued exchange (re-raising the first failure); the compute stream joins them."""
        pending, self._pending = self._pending, []
        errors = [f.exception() for f in pending]
        for error in errors:
            if error is not None:
                raise error
        self.clock.join_exchanges()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class QueuedGradReducer(reducer.GradReducer):
    """A gradient reducer whose per-bucket exchange (:meth:`_exchange`) runs on an :class:`ExchangeQueue`.

    The exchange leaves this rank's reduced gradient in the bucket; it must
    not touch another bucket (they run while backward fills the others).
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        super().__init__(params, **reducer_args)
        self.exchanges = ExchangeQueue(self.clock)
        self._queued: set[int] = set()

    def _launch(self, bucket: reducer.Bucket) -> None:
        self._queued.add(bucket.index)
        self.exchanges.submit(functools.partial(self._exchange, bucket))

    def _exchange(self, bucket: reducer.Bucket) -> None:
        raise NotImplementedError

    def _settled(self) -> None:
        """After every exchange of the step is done (on the calling thread)."""

    def finish(self) -> None:
        """Queue the buckets whose hook did not fire, wait for every exchange, then :meth:`_settled`."""
        for bucket in self.buckets:
            if bucket.index not in self._queued:
                self._note_local(bucket)
                self._launch(bucket)
        try:
            self.exchanges.drain()
        finally:
            self._queued.clear()
            for bucket in self.buckets:
                bucket.ready = 0
        self._settled()
        self.sync = True

    def remove(self) -> None:
        super().remove()
        self.exchanges.close()
