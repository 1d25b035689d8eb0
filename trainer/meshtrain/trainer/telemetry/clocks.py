"""Timestamps for step telemetry: host seconds on CPU, GPU-timeline seconds on CUDA.

The engine owns one clock (:func:`for_device`) and passes it wherever the recorder goes.
:class:`HostClock` reads ``perf_counter`` around work that runs on the calling thread;
:class:`CudaClock` records CUDA events on the stream the work runs on (host time there measures
only the launch) and places them on the host timeline after the step's sync.  Overlapped
collectives and exchange chains are timed on streams of their own, so timing holds back neither
the host nor backward (docs/telemetry.md, "Timing on GPUs").
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Literal

import torch
import torch.distributed as dist

Lane = Literal["dp", "tp"]
"""Whose collective a launch is: each lane has its own side stream on CUDA (one per process group)."""
Stamp = float | torch.cuda.Event
"""A point in time: host seconds (:class:`HostClock`) or a recorded CUDA event (:class:`CudaClock`)."""


@dataclasses.dataclass
class HostLaunch:
    """An asynchronous collective timed on the host."""

    work: dist.Work
    """The collective's handle."""
    start: float
    """perf_counter seconds just before the launch."""
    landed: Callable[[HostLaunch], None] = lambda _launch: None
    """Told when the collective is seen done (by either method below)."""

    def report_when_done(self, report: Callable[[float, float], None]) -> None:
        """Call ``report(start, end)`` when the collective completes (a future callback: the communication thread)."""

        def done(_future: torch.futures.Future[Any]) -> None:
            report(self.start, time.perf_counter())
            self.landed(self)

        self.work.get_future().add_done_callback(done)

    def wait(self) -> float:
        """Block until the collective is done; returns the time it was seen done."""
        self.work.wait()
        self.landed(self)
        return time.perf_counter()


class HostClock:
    """``time.perf_counter()`` seconds: right where work runs on the calling thread (CPU tensors, gloo)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # launches not yet seen done; dropped when waited for or reported, so their tensors die with them
        self._launched: dict[int, HostLaunch] = {}
        self._held = 0  # work queued or running on another thread of the process

    def now(self) -> float:
        """Host seconds now."""
        return time.perf_counter()

    def start_step(self) -> float:
        """The step's start on the host timeline."""
        return time.perf_counter()

    def cpu_now(self) -> float | None:
        """CPU seconds of this process (every thread) so far; None while other communication runs.

        Over a blocking collective the caller only waits, so the difference is
        what gloo's threads spent on that call, unless an asynchronous
        collective (a data-parallel bucket) or a held exchange chain
        (:meth:`hold`) ran meanwhile.
        """
        with self._lock:
            for key, launched in list(self._launched.items()):
                if launched.work.is_completed():  # done, though nobody has waited for it yet
                    del self._launched[key]
            busy = bool(self._launched) or self._held > 0
        return None if busy else time.process_time()

    def hold(self) -> Callable[[], None]:
        """Mark work queued for another thread of the process (a bucket's exchange chain); call the result when it ends."""
        with self._lock:
            self._held += 1
        released = threading.Event()

        def release() -> None:
            if not released.is_set():
                released.set()
                with self._lock:
                    self._held -= 1

        return release

    def launch(self, collective: Callable[[], dist.Work], *, lane: Lane = "dp") -> HostLaunch:
        """Start ``collective`` (an ``async_op=True`` call); ``lane`` matters on CUDA only."""
        start = time.perf_counter()
        launched = HostLaunch(work=collective(), start=start, landed=self._landed)
        with self._lock:
            self._launched[id(launched)] = launched
        return launched

    def _landed(self, launched: HostLaunch) -> None:
        with self._lock:
            self._launched.pop(id(launched), None)

    def mark_ready(self) -> None:
        """Host work is done when issued: nothing to mark."""
        return None

    @contextlib.contextmanager
    def exchange_stream(self, ready: None) -> Iterator[None]:
        """Host work needs no stream: run as is."""
        yield

    def join_exchanges(self) -> None:
        """Nothing to join on the host (the caller waited for the thread)."""


@dataclasses.dataclass
class DeviceLaunch:
    """An asynchronous collective issued from the clock's side stream, both ends already recorded there."""

    start: torch.cuda.Event
    """Recorded on the side stream once the compute stream had reached the launch."""
    end: torch.cuda.Event
    """Recorded on the side stream after it waited for the collective."""
    stream: torch.cuda.Stream
    """Its lane's side stream."""
    clock: CudaClock
    """The clock that issued it."""

    def report_when_done(
        self, report: Callable[[torch.cuda.Event, torch.cuda.Event], None]
    ) -> None:
        """Call ``report(start, end)`` now: the events get their times on the GPU, read after the step's sync."""
        report(self.start, self.end)

    def wait(self) -> torch.cuda.Event:
        """Make the compute stream wait for this collective (the host does not wait); returns the end stamp.

        It waits on the end event, not the whole side stream: collectives launched after this one
        on the same lane (the next chunks) stay in flight beside the compute stream.  Once this
        returns, work the compute stream issues is ordered after the collective, so its input may
        be freed (the caching allocator reuses blocks in compute-stream order).
        """
        self.clock.compute_stream().wait_event(self.end)
        return self.end


class CudaClock:
    """CUDA events on the stream the work runs on, resolved to host-timeline seconds after the step's sync.

    ``device_api`` is the module whose ``Event``, ``Stream``, ``stream``,
    ``current_stream`` and ``synchronize`` it uses: ``torch.cuda``, or in
    tests a stand-in, since this path cannot run on a CPU-only machine.
    """

    def __init__(self, device: torch.device, *, device_api: Any = torch.cuda) -> None:
        self.device = device
        self._api = device_api
        self._side = device_api.Stream(device=device)
        self._exchange: torch.cuda.Stream | None = None
        self._lanes: dict[str, torch.cuda.Stream] = {"dp": self._side}
        self._reference: torch.cuda.Event | None = None
        self._reference_host = 0.0

    def now(self) -> torch.cuda.Event:
        """An event recorded on the current stream (timed once the GPU reaches it)."""
        event = self._api.Event(enable_timing=True)
        event.record()
        return event

    def cpu_now(self) -> None:
        """Not measured: a queued collective costs the host only its launch, not what the GPU does."""
        return None

    def compute_stream(self) -> torch.cuda.Stream:
        """The stream this thread issues work on now."""
        return self._api.current_stream(self.device)

    def start_step(self) -> float:
        """Record the reference event and its host time; returns the host time (the step's start).

        The device is idle (synchronised), so the reference runs as soon as it
        is recorded.  The host time is read just before, so resolved stamps
        may read early by the microseconds until the GPU reaches the
        reference, but never late and never before the step's start.
        """
        self._api.synchronize(self.device)
        self._reference_host = time.perf_counter()
        self._reference = self.now()
        return self._reference_host

    def launch(self, collective: Callable[[], dist.Work], *, lane: Lane = "dp") -> DeviceLaunch:
        """Issue ``collective`` (an ``async_op=True`` call) from ``lane``'s side stream; the compute stream runs on.

        Each lane (process group) has its own side stream, so a tensor-parallel chunk never
        queues behind a data-parallel bucket launched before it (each stream's ``work.wait()``
        holds everything issued on it after), and each flight is timed on its own group's stream.
        The caller keeps the collective's input alive until :meth:`DeviceLaunch.wait` has ordered
        the compute stream after it: since torch 2.7 ``work.wait()`` drops NCCL's own reference.
        """
        side = self._lane(lane)
        side.wait_stream(self.compute_stream())
        with self._api.stream(side):
            start = self.now()
            work = collective()
            work.wait()  # the side stream waits for NCCL's stream; the host and the compute stream do not
            end = self.now()
        return DeviceLaunch(start=start, end=end, stream=side, clock=self)

    def _lane(self, lane: Lane) -> torch.cuda.Stream:
        """``lane``'s side stream, made on first use."""
        if lane not in self._lanes:
            self._lanes[lane] = self._api.Stream(device=self.device)
        return self._lanes[lane]

    def mark_ready(self) -> torch.cuda.Event:
        """An event on the compute stream where a bucket's gradients are final."""
        event = self._api.Event()
        event.record()
        return event

    @contextlib.contextmanager
    def exchange_stream(self, ready: torch.cuda.Event) -> Iterator[None]:
        """Run (inline, on the issuing thread) on the clock's exchange stream, after ``ready``."""
        if self._exchange is None:
            self._exchange = self._api.Stream(device=self.device)
        with self._api.device(self.device), self._api.stream(self._exchange):
            self._exchange.wait_event(ready)
            yield

    def join_exchanges(self) -> None:
        """The compute stream waits for every exchange issued so far (the host does not)."""
        if self._exchange is not None:
            self.compute_stream().wait_stream(self._exchange)

    def synchronize(self) -> None:
        """Wait until every stamp of the step has its time."""
        self._api.synchronize(self.device)

    def seconds(self, stamp: torch.cuda.Event) -> float:
        """``stamp`` on the host's perf_counter timeline (after :meth:`synchronize`)."""
        if self._reference is None:
            raise RuntimeError("CudaClock.seconds before start_step: no reference event")
        return self._reference_host + self._reference.elapsed_time(stamp) / 1000.0


Clock = HostClock | CudaClock
"""The engine's clock."""
Launch = HostLaunch | DeviceLaunch
"""A timed asynchronous collective."""


def for_device(device: torch.device) -> Clock:
    """The clock of work on ``device``: CUDA events on a GPU, perf_counter elsewhere."""
    return CudaClock(device) if device.type == "cuda" else HostClock()
