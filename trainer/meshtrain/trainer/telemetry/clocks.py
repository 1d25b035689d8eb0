"""Timestamps for step telemetry: host seconds on CPU, GPU-timeline seconds on CUDA.

The clock the engine reads around every forward, backward,
pipeline wait and collective it reports to the
:class:`~meshtrain.trainer.telemetry.recording.StepRecorder`; the engine owns
one, chosen by :func:`for_device`.

* :class:`HostClock` (CPU, gloo): ``time.perf_counter()``.  Work on CPU
  tensors runs on the calling thread and a gloo collective's future completes
  when the data has arrived, so host time is the work's time.
* :class:`CudaClock` (GPU, NCCL): kernels and NCCL collectives are queued and
  run later, so host time around them measures only the launch.  Its stamps
  are CUDA events recorded on the stream the work runs on.  At step start it
  reads ``perf_counter`` and records a reference event (the GPU is idle
  there: the previous step ended by reading the loss on the host, and it
  synchronises to make sure), and after the step's sync :meth:`CudaClock.seconds`
  places an event on the host timeline as
  ``reference_host + reference.elapsed_time(event) / 1000``.  The stamps reach
  telemetry through :class:`~meshtrain.trainer.telemetry.recording.DeferredRecorder`.

An asynchronous collective whose end must be timed without blocking anyone
(the data-parallel buckets overlapped with backward) goes through
``launch``.  On the host it notes the launch time and reads the clock again
when the collective completes.  On CUDA the collective is issued from a side
stream that first waits for the compute stream; ``work.wait()`` issued on the
side stream makes that stream (not the host, not the compute stream) wait for
NCCL's internal stream, and an event recorded after it is the end on the GPU.
The compute stream waits for the side stream only where the result is needed
(:meth:`DeviceLaunch.wait`, from ``GradReducer.finish``).

A bucket exchange that is a chain of dependent collectives and computations
(hierarchical all-reduce, compressed exchanges: :mod:`meshtrain.trainer.parallel.exchanges`) runs on a
background thread on the host and inline in the reducer's hook on CUDA.
``mark_ready`` notes, on the issuing thread, the point where the bucket's
gradients are final; ``exchange_stream(mark)`` is the context the chain runs
in (on CUDA: the clock's exchange stream, which first waits for the mark, so
neither the host nor backward's stream waits for the chain);
``join_exchanges`` makes the compute stream wait for every chain issued (the
host waits for the thread itself).

Not the step's wall time (the engine reads ``perf_counter``
around the whole step, which ends with a host sync), checkpoint timing, or a
recorder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

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

    def launch(self, collective: Callable[[], dist.Work]) -> HostLaunch:
        """Start ``collective`` (an ``async_op=True`` call)."""
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
    """The side stream."""
    clock: CudaClock
    """The clock that issued it."""

    def report_when_done(
        self, report: Callable[[torch.cuda.Event, torch.cuda.Event], None]
    ) -> None:
        """Call ``report(start, end)`` now: the events get their times on the GPU, read after the step's sync."""
        report(self.start, self.end)

    def wait(self) -> torch.cuda.Event:
        """Make the compute stream wait for the collective (the host does not wait); returns the end stamp."""
        self.clock.compute_stream().wait_stream(self.stream)
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

    def launch(self, collective: Callable[[], dist.Work]) -> DeviceLaunch:
        """Issue ``collective`` (an ``async_op=True`` call) from the side stream; the compute stream runs on."""
        self._side.wait_stream(self.compute_stream())
        with self._api.stream(self._side):
            start = self.now()
            work = collective()
            work.wait()  # the side stream waits for NCCL's stream; the host and the compute stream do not
            end = self.now()
        return DeviceLaunch(start=start, end=end, stream=self._side, clock=self)

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
