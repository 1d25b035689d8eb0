"""The engine's one telemetry interface: what happened, when, during a step.

The :class:`StepRecorder` protocol the engine calls around every forward and backward, wait and
collective; :class:`EventCollector`, the one way a recorder keeps a step's events; and
:class:`DeferredRecorder`, which holds a step's CUDA events until they can be read.  Times are
seconds on ``time.perf_counter()``'s timeline: host time around the work on CPU, when the GPU ran
it on CUDA (:mod:`.clocks`).  Calls may come from a communication or autograd thread, so a recorder
must be cheap and thread-safe.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

if TYPE_CHECKING:  # torch: `meshtrain report` and `timeline` read traces without the trainer extra
    from meshtrain.trainer.telemetry import clocks

ComputeKind = Literal["forward", "backward"]
WaitKind = Literal["recv", "send", "tp", "cp"]
"""Blocked on a pipeline receive, on draining pipeline sends, on a tensor-parallel collective
(a blocking one whole, an overlapped one for what was not hidden: its exposed time), or on a
context-parallel ring transfer (what the attention beside it did not hide)."""
PIPELINE_WAITS = ("recv", "send")
"""The wait kinds of pipeline point-to-point traffic."""
Group = Literal["dp", "tp", "pp", "cp"]
RING_OP = "ring_send_recv"
"""The op of one context-parallel ring transfer (group ``cp``): a send to the next cp rank and a
receive from the previous one, launched beside a block's attention; point-to-point, not a
reduction, so the exporter reports it apart from the collectives' durations."""
Level = Literal["flat", "intra", "inter"]
"""Where a collective runs: its whole group, or (hierarchical all-reduce) inside a node or across nodes."""


class StepRecorder(Protocol):
    """Receives timing events from the engine: perf_counter seconds (see the module docstring per device)."""

    def step_start(self, step: int, start: float) -> None:
        """Optimizer step ``step`` (1-based) begins."""

    def compute(
        self, kind: ComputeKind, microbatch: int, chunk: int, start: float, end: float
    ) -> None:
        """A forward or backward of one micro-batch through one model chunk (virtual stage)."""

    def wait(self, kind: WaitKind, start: float, end: float) -> None:
        """Time blocked on pipeline point-to-point traffic (a receive, or draining sends) or on a
        tensor-parallel collective (``tp``); on CUDA, the stream's."""

    def collective(
        self,
        group: Group,
        op: str,
        nbytes: int,
        start: float,
        end: float,
        bucket: int | None = None,
        level: Level = "flat",
        cpu_seconds: float | None = None,
    ) -> None:
        """A collective over ``group``: ``op`` such as all_reduce, ``nbytes`` of payload per rank, at ``level``.

        ``cpu_seconds``: the process's CPU seconds over a blocking call on the host (None: not measured).
        """

    def step_end(
        self, step: int, loss: float, tokens: int, seconds: float, model_flops: float | None = None
    ) -> None:
        """Optimizer step ``step`` done: mean loss, tokens of the global batch, wall seconds.

        ``model_flops``: the step's model FLOPs counted from its batch (masked attention,
        ``training.documentMask``); None: the job's FLOPs per token times ``tokens``.
        """


class NullRecorder:
    """Drops everything (the default)."""

    def step_start(self, step: int, start: float) -> None:
        pass

    def compute(
        self, kind: ComputeKind, microbatch: int, chunk: int, start: float, end: float
    ) -> None:
        pass

    def wait(self, kind: WaitKind, start: float, end: float) -> None:
        pass

    def collective(
        self,
        group: Group,
        op: str,
        nbytes: int,
        start: float,
        end: float,
        bucket: int | None = None,
        level: Level = "flat",
        cpu_seconds: float | None = None,
    ) -> None:
        pass

    def step_end(
        self, step: int, loss: float, tokens: int, seconds: float, model_flops: float | None = None
    ) -> None:
        pass


def blocking_collective(
    recorder: StepRecorder,
    clock: clocks.Clock,
    group: Group,
    op: str,
    nbytes: int,
    call: Callable[[], object],
) -> None:
    """Run ``call`` (a collective that returns when done) and record it with, on the host, the CPU it cost.

    The CPU seconds are the whole process's over the call: the caller only
    waits, so they are what gloo's threads spent on it.  None where other
    communication of the process ran meanwhile (an asynchronous bucket, an
    exchange chain: :meth:`.clocks.HostClock.cpu_now`) and on CUDA.
    Calibration prices a tensor-parallel call's CPU with them.  A ``tp`` call is also
    recorded as a ``tp`` wait: the compute thread was held for all of it.
    """
    start, cpu_start = clock.now(), clock.cpu_now()
    call()
    end, cpu_end = clock.now(), clock.cpu_now()
    cpu = None if cpu_start is None or cpu_end is None else cpu_end - cpu_start
    # stamps are floats on the host clock, CUDA events for the DeferredRecorder (see clocks)
    if group == "tp":  # held for all of it: its exposed time (overlapped ones: tensor_overlap)
        wait: Callable[..., None] = recorder.wait
        wait("tp", start, end)
    record: Callable[..., None] = recorder.collective
    record(group, op, nbytes, start, end, cpu_seconds=cpu)


@dataclasses.dataclass(frozen=True)
class Event:
    """One recorded event."""

    what: str
    """compute, wait or collective."""
    kind: str
    """forward/backward, recv/send, or the collective's op."""
    start: float
    """perf_counter seconds (on CUDA, when the GPU started the work)."""
    end: float
    """perf_counter seconds (on CUDA, when the GPU finished the work)."""
    group: str | None = None
    """Process group axis of a collective."""
    nbytes: int = 0
    """Payload of a collective."""
    microbatch: int | None = None
    """Micro-batch of a compute event."""
    chunk: int | None = None
    """Model chunk of a compute event."""
    bucket: int | None = None
    """Gradient bucket of a data-parallel collective."""
    level: str = "flat"
    """flat, or intra / inter (node) for the stages of a hierarchical all-reduce."""
    cpu_seconds: float | None = None
    """CPU seconds the process spent over a blocking collective (host clock only; None: not measured)."""


class EventCollector:
    """Collects the events of the current step, under a lock: the one way a recorder here keeps them.

    :class:`MemoryRecorder` and the telemetry's ``TelemetryRecorder`` are
    collectors that do different things at ``step_end``.
    """

    def __init__(self, started: float = 0.0) -> None:
        self._lock = threading.Lock()
        self.events: list[Event] = []
        """Events since the last ``step_start``."""
        self.step_started = started
        """``step_start``'s time of the current step."""

    def step_start(self, step: int, start: float) -> None:
        with self._lock:
            self.events = []
            self.step_started = start

    def compute(
        self, kind: ComputeKind, microbatch: int, chunk: int, start: float, end: float
    ) -> None:
        self._add(Event("compute", kind, start, end, microbatch=microbatch, chunk=chunk))

    def wait(self, kind: WaitKind, start: float, end: float) -> None:
        self._add(Event("wait", kind, start, end))

    def collective(
        self,
        group: Group,
        op: str,
        nbytes: int,
        start: float,
        end: float,
        bucket: int | None = None,
        level: Level = "flat",
        cpu_seconds: float | None = None,
    ) -> None:
        self._add(
            Event(
                "collective",
                op,
                start,
                end,
                group=group,
                nbytes=nbytes,
                bucket=bucket,
                level=level,
                cpu_seconds=cpu_seconds,
            )
        )

    def _add(self, event: Event) -> None:
        with self._lock:
            self.events.append(event)

    def snapshot(self) -> list[Event]:
        """A copy of the current step's events."""
        with self._lock:
            return list(self.events)

    def take(self) -> tuple[list[Event], float]:
        """The current step's events and start, leaving no events behind."""
        with self._lock:
            events, self.events = self.events, []
            return events, self.step_started


class MemoryRecorder(EventCollector):
    """Keeps every event of the current step in memory; summarises a step."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[dict[str, float]] = []
        """One summary per finished step (see :meth:`summary`)."""

    def step_end(
        self, step: int, loss: float, tokens: int, seconds: float, model_flops: float | None = None
    ) -> None:
        summary = self.summary()
        summary.update(step=step, loss=loss, tokens=tokens, step_seconds=seconds)
        with self._lock:
            self.steps.append(summary)

    def count(self, what: str, group: str | None = None) -> int:
        """Events of one sort in the current step (e.g. ``count('collective', 'dp')``)."""
        return sum(
            1 for e in self.snapshot() if e.what == what and (group is None or e.group == group)
        )

    def summary(self) -> dict[str, float]:
        """Per-step totals: compute, pipeline wait, exposed tensor-parallel (and, when a ring ran,
        context-parallel), and collective seconds and bytes per group."""
        events = self.snapshot()
        out: dict[str, float] = {
            "compute_seconds": 0.0,
            "wait_seconds": 0.0,
            "tp_exposed_seconds": 0.0,
        }
        for e in events:
            if e.what == "compute":
                out["compute_seconds"] += e.end - e.start
            elif e.what == "wait":
                key = "wait_seconds" if e.kind in PIPELINE_WAITS else f"{e.kind}_exposed_seconds"
                out[key] = out.get(key, 0.0) + (e.end - e.start)
            else:
                key = f"{e.group}_collective"
                out[f"{key}_seconds"] = out.get(f"{key}_seconds", 0.0) + (e.end - e.start)
                out[f"{key}_bytes"] = out.get(f"{key}_bytes", 0.0) + e.nbytes
                out[f"{key}_count"] = out.get(f"{key}_count", 0.0) + 1
        return out


class DeferredRecorder:
    """Holds a step's events until their CUDA event stamps can be read, then forwards them as seconds, in order.

    ``step_start`` passes through at once (its time is the host's).  Every
    other event is kept until ``step_end``, which synchronises the device,
    converts the stamps with :meth:`.clocks.CudaClock.seconds` and forwards the
    events in the order they were reported, then ``step_end`` itself.  Events
    reported outside a step (no reference event to measure from) are dropped
    at the next ``step_start``, as every recorder here drops them.
    """

    def __init__(self, inner: StepRecorder, clock: clocks.CudaClock) -> None:
        self.inner = inner
        """The recorder that receives seconds."""
        self.clock = clock
        """The clock whose stamps the engine passes."""
        self._lock = threading.Lock()
        self._held: list[tuple[Callable[[float, float], None], clocks.Stamp, clocks.Stamp]] = []

    def _hold(
        self, forward: Callable[[float, float], None], start: clocks.Stamp, end: clocks.Stamp
    ) -> None:
        with self._lock:
            self._held.append((forward, start, end))

    def step_start(self, step: int, start: float) -> None:
        with self._lock:
            self._held = []
        self.inner.step_start(step, start)

    def compute(
        self, kind: ComputeKind, microbatch: int, chunk: int, start: clocks.Stamp, end: clocks.Stamp
    ) -> None:
        self._hold(functools.partial(self.inner.compute, kind, microbatch, chunk), start, end)

    def wait(self, kind: WaitKind, start: clocks.Stamp, end: clocks.Stamp) -> None:
        self._hold(functools.partial(self.inner.wait, kind), start, end)

    def collective(
        self,
        group: Group,
        op: str,
        nbytes: int,
        start: clocks.Stamp,
        end: clocks.Stamp,
        bucket: int | None = None,
        level: Level = "flat",
        cpu_seconds: float | None = None,
    ) -> None:
        self._hold(
            functools.partial(
                self.inner.collective,
                group,
                op,
                nbytes,
                bucket=bucket,
                level=level,
                cpu_seconds=cpu_seconds,
            ),
            start,
            end,
        )

    def step_end(
        self, step: int, loss: float, tokens: int, seconds: float, model_flops: float | None = None
    ) -> None:
        self.clock.synchronize()
        with self._lock:
            held, self._held = self._held, []
        for forward, start, end in held:
            forward(self.clock.seconds(start), self.clock.seconds(end))
        if model_flops is None:
            self.inner.step_end(step, loss, tokens, seconds)
        else:
            self.inner.step_end(step, loss, tokens, seconds, model_flops=model_flops)
