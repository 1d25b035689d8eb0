"""A stand-in for ``torch.cuda``'s timing surface, so the CUDA clock runs on a CPU.

:class:`FakeDevice`, with the ``Event``, ``Stream``, ``stream``,
``current_stream`` and ``synchronize`` that
:class:`~meshtrain.trainer.telemetry.clocks.CudaClock` uses.  An event takes its
time from ``now`` (a callable returning seconds) when it is recorded, and
``elapsed_time`` answers in milliseconds as CUDA's does.  Every stream
operation is appended to :attr:`FakeDevice.log` as a tuple, so a test can
check their order.

Not a model of asynchrony.  Everything runs when it is issued;
the multi-process test uses it with ``now = time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any


class FakeStream:
    """A named stream that logs what waits on what."""

    def __init__(self, name: str, device: FakeDevice) -> None:
        self.name = name
        self.device = device

    def wait_stream(self, other: FakeStream) -> None:
        self.device.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.device.log.append(("wait_event", self.name, str(event.stream)))


class FakeEvent:
    """A timing event: its time is read when it is recorded."""

    def __init__(self, device: FakeDevice, enable_timing: bool) -> None:
        self.device = device
        self.enable_timing = enable_timing
        self.at: float | None = None
        self.stream: str | None = None

    def record(self, stream: FakeStream | None = None) -> None:
        stream = stream or self.device.current
        self.at, self.stream = self.device.now(), stream.name
        self.device.log.append(("record", stream.name))

    def elapsed_time(self, end: FakeEvent) -> float:
        """Milliseconds from this event to ``end`` (both recorded, as CUDA requires)."""
        assert self.enable_timing and end.enable_timing, "CudaClock must ask for timing events"
        if self.at is None or end.at is None:
            raise RuntimeError("elapsed_time on an event that was not recorded")
        return (end.at - self.at) * 1000.0

    def synchronize(self) -> None:
        pass


class FakeDevice:
    """The ``torch.cuda`` functions CudaClock calls, on a host time source."""

    def __init__(
        self,
        now: Callable[[], float] = time.perf_counter,
        names: tuple[str, ...] = ("side", "exchange"),
    ) -> None:
        self.now = now
        """Where event times come from (seconds)."""
        self.names = names
        """The names of the streams made, in order (then "other")."""
        self.log: list[tuple[str, ...]] = []
        """Stream operations in issue order."""
        self.compute = FakeStream("compute", self)
        """The default stream."""
        self._local = threading.local()
        self._streams = 0

    @property
    def current(self) -> FakeStream:
        """The stream work is issued on now (per thread, as CUDA's current stream is)."""
        return getattr(self._local, "stream", self.compute)

    @current.setter
    def current(self, stream: FakeStream) -> None:
        self._local.stream = stream

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - torch.cuda.Event
        return FakeEvent(self, enable_timing)

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 - torch.cuda.Stream
        """The n-th stream made is named ``names[n]``: by default the clock's first is "side" (the
        data-parallel lane's), its second (the bucket exchanges') "exchange"."""
        self._streams += 1
        name = self.names[self._streams - 1] if self._streams <= len(self.names) else "other"
        return FakeStream(name, self)

    @contextlib.contextmanager
    def device(self, device: Any = None) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def stream(self, stream: FakeStream) -> Iterator[None]:
        previous, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = previous
            self.log.append(("exit", stream.name))

    def current_stream(self, device: Any = None) -> FakeStream:
        return self.current

    def synchronize(self, device: Any = None) -> None:
        self.log.append(("synchronize",))
