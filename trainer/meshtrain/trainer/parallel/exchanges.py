"""Bucket exchanges that are chains of collectives (hierarchical, compressed), overlapped with backward.

:class:`QueuedGradReducer` issues each bucket's whole chain in bucket index order, so every rank
issues the same collectives in the same order on each process group: on the host from one worker
thread (:class:`ExchangeQueue`), on CUDA inline on the clock's exchange stream.  At least the last
bucket's chain stays exposed after backward, which the planner charges
(:func:`meshtrain.planner.timing.stage_work.price`).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.utils import _python_dispatch as python_dispatch

from meshtrain.trainer.parallel import reducer
from meshtrain.trainer.telemetry import clocks


class ExchangeQueue:
    """Runs bucket exchanges in submission order: on one worker thread (host), inline on CUDA.

    On the host the thread runs each chain with blocking collectives while backward goes on
    computing earlier layers on the calling thread; after a chain fails, the chains queued
    behind it are skipped (their collectives would pair with the peers' remaining legs of the
    failed one) and :meth:`drain` raises the failure at once.  On CUDA kernels and NCCL
    collectives are asynchronous, so a thread gains nothing, and issuing data-parallel
    collectives from a thread while tensor and pipeline collectives are issued from others
    would let the order across communicators differ between ranks (an NCCL deadlock).
    """

    def __init__(self, clock: clocks.Clock) -> None:
        self.clock = clock
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []
        self._failed = threading.Event()

    def submit(self, exchange: Callable[[], None]) -> None:
        """Run ``exchange`` now that its inputs are final (call on the thread that produced them)."""
        ready: Any = self.clock.mark_ready()
        if isinstance(self.clock, clocks.CudaClock):
            with self.clock.exchange_stream(ready):
                exchange()
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="meshtrain-exchange")
        threads = torch.get_num_threads()
        modes = python_dispatch._get_current_dispatch_mode_stack()
        release = self.clock.hold()  # the process's CPU is not a blocking call's alone meanwhile
        self._pending.append(self._pool.submit(self._run, exchange, ready, threads, modes, release))

    def _run(
        self,
        exchange: Callable[[], None],
        ready: Any,
        threads: int,
        modes: list[Any],
        release: Callable[[], None],
    ) -> None:
        try:
            if self._failed.is_set():
                return  # an earlier chain failed: its collectives would pair with its peers' rest
            self._exchange(exchange, ready, threads, modes)
        finally:
            release()

    def _exchange(
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
        except BaseException:
            self._failed.set()
            raise
        finally:
            for _ in modes:
                python_dispatch._pop_mode()

    def drain(self) -> None:
        """Wait for the queued exchanges in order, raising the first failure as soon as it is seen."""
        pending, self._pending = self._pending, []
        try:
            for future in pending:
                future.result()
        finally:
            if self._failed.is_set():
                for future in pending:  # skipped after the failure: they end at once
                    future.exception()
                self._failed.clear()
        self.clock.join_exchanges()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


class QueuedGradReducer(reducer.GradReducer):
    """A gradient reducer whose per-bucket exchange (:meth:`_exchange`) runs through an :class:`ExchangeQueue`.

    The exchange leaves this rank's reduced gradient in the bucket; it must
    not touch another bucket (they run while backward fills the others).

    Chains are submitted in bucket index order, as PyTorch DDP's Reducer launches its buckets
    (``next_bucket_``): when bucket ``i`` becomes ready, every bucket from the lowest not yet
    submitted up to, not including, the lowest one not ready.  Every rank then issues the same
    chains in the same order on each process group, whatever order its hooks fired in (an
    unused parameter's bucket completes in :meth:`finish` on one rank and mid-backward on
    another), which the backends require.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter] | list[list[torch.nn.Parameter]],
        **reducer_args: Any,
    ) -> None:
        """``reducer_args`` are :class:`~.reducer.GradReducer`'s (group, group_size, bucket_mb, recorder, clock)."""
        super().__init__(params, **reducer_args)
        self.exchanges = ExchangeQueue(self.clock)
        self._ready: set[int] = set()
        self._next = 0
        """The lowest bucket index not yet submitted."""

    def _launch(self, bucket: reducer.Bucket) -> None:
        """Bucket ``bucket`` is ready: submit, in index order, every bucket up to the lowest one not ready."""
        self._ready.add(bucket.index)
        while self._next < len(self.buckets) and self._next in self._ready:
            self._submit(self.buckets[self._next])

    def _submit(self, bucket: reducer.Bucket) -> None:
        self._next = bucket.index + 1
        self.exchanges.submit(functools.partial(self._exchange, bucket))

    def _exchange(self, bucket: reducer.Bucket) -> None:
        raise NotImplementedError

    def _settled(self) -> None:
        """After every exchange of the step is done (on the calling thread)."""

    def finish(self) -> None:
        """Submit the buckets not yet submitted in index order, wait for every exchange, then :meth:`_settled`."""
        try:
            for bucket in self.buckets[self._next :]:
                if bucket.index not in self._ready:
                    self._note_local(bucket)
                self._submit(bucket)
            self.exchanges.drain()
        finally:
            self._ready.clear()
            self._next = 0
            for bucket in self.buckets:
                bucket.ready = 0
        self._settled()
        self.sync = True

    def remove(self) -> None:
        super().remove()
        self.exchanges.close()
