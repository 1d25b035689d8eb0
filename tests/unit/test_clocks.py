"""Telemetry clocks: host time, CUDA events resolved against the step's reference, the side-stream launch, and
the recorder that holds a step's events until they can be read (a stand-in device: no GPU here)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from meshtrain.trainer.parallel import exchanges
from meshtrain.trainer.telemetry import clocks, live_bytes, recording
from tests.unit import fake_device


class ManualTime:
    """A device time source the test moves by hand (seconds)."""

    def __init__(self, at: float) -> None:
        self.at = at

    def __call__(self) -> float:
        return self.at


class CallLog:
    """A StepRecorder that notes every call in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def step_start(self, step, start):
        self.calls.append(("step_start", step, start))

    def compute(self, kind, microbatch, chunk, start, end):
        self.calls.append(("compute", kind, microbatch, chunk, start, end))

    def wait(self, kind, start, end):
        self.calls.append(("wait", kind, start, end))

    def collective(
        self, group, op, nbytes, start, end, bucket=None, level="flat", cpu_seconds=None
    ):
        self.calls.append(("collective", group, op, nbytes, start, end, bucket))

    def step_end(self, step, loss, tokens, seconds):
        self.calls.append(("step_end", step, loss, tokens, seconds))


class FakeWork:
    """A collective handle that logs on which stream it was waited for."""

    def __init__(self, device: fake_device.FakeDevice) -> None:
        self.device = device
        self.future: torch.futures.Future = torch.futures.Future()

    def wait(self) -> bool:
        self.device.log.append(("work.wait", self.device.current.name))
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


def relative(call: tuple, origin: float) -> tuple:
    """``call`` with its float fields (the times) as seconds after ``origin``, rounded to the microsecond."""
    return tuple(round(v - origin, 6) if isinstance(v, float) else v for v in call)


def cuda_clock(at: float) -> tuple[clocks.CudaClock, fake_device.FakeDevice, ManualTime]:
    device_time = ManualTime(at)
    device = fake_device.FakeDevice(now=device_time)
    return clocks.CudaClock(torch.device("cuda", 0), device_api=device), device, device_time


# --- host ---------------------------------------------------------------------


def test_host_clock_reads_perf_counter():
    clock = clocks.HostClock()
    before = time.perf_counter()
    now, start = clock.now(), clock.start_step()
    assert isinstance(now, float) and before <= now <= start <= time.perf_counter()


def test_host_launch_reports_when_the_collective_completes():
    work = FakeWork(fake_device.FakeDevice())
    launch = clocks.HostClock().launch(lambda: work)
    reports = []
    launch.report_when_done(lambda start, end: reports.append((start, end)))
    assert reports == []  # not before completion
    work.future.set_result(None)
    assert len(reports) == 1
    start, end = reports[0]
    assert start == launch.start <= end <= launch.wait()


def test_cpu_devices_get_the_host_clock():
    assert isinstance(clocks.for_device(torch.device("cpu")), clocks.HostClock)


# --- CUDA events --------------------------------------------------------------


def test_cuda_stamps_resolve_against_the_step_reference():
    clock, device, device_time = cuda_clock(100.0)
    host = clock.start_step()
    assert device.log[:2] == [
        ("synchronize",),
        ("record", "compute"),
    ]  # idle device, then the reference
    device_time.at = 100.25
    first = clock.now()
    device_time.at = 100.75
    second = clock.now()
    assert clock.seconds(first) == pytest.approx(host + 0.25)
    assert clock.seconds(second) == pytest.approx(host + 0.75)
    device_time.at = 500.0  # the next step measures from its own reference
    host_next = clock.start_step()
    device_time.at = 500.5
    assert clock.seconds(clock.now()) == pytest.approx(host_next + 0.5)


def test_cuda_stamps_need_a_step_reference():
    clock, _, _ = cuda_clock(0.0)
    with pytest.raises(RuntimeError, match="start_step"):
        clock.seconds(clock.now())


def test_cuda_launch_times_the_collective_on_the_side_stream():
    clock, device, device_time = cuda_clock(10.0)
    work = FakeWork(device)

    def collective() -> FakeWork:
        device.log.append(("collective", device.current.name))
        return work

    launch = clock.launch(collective)
    assert device.log == [
        ("wait_stream", "side", "compute"),  # the side stream starts where backward is
        ("enter", "side"),
        ("record", "side"),  # start
        ("collective", "side"),  # issued from the side stream
        ("work.wait", "side"),  # the side stream, not the compute stream, waits for the collective
        ("record", "side"),  # end
        ("exit", "side"),
    ]
    assert device.current is device.compute
    reports = []
    launch.report_when_done(lambda start, end: reports.append((start, end)))
    assert reports == [(launch.start, launch.end)]  # at once: the events are timed on the device
    del device.log[:]
    assert launch.wait() is launch.end
    assert device.log == [("wait_event", "compute", "side")]  # where the reducer needs the result


# --- the deferred recorder ----------------------------------------------------


def test_deferred_recorder_forwards_resolved_events_in_order_at_step_end():
    clock, device, device_time = cuda_clock(50.0)
    inner = CallLog()
    deferred = recording.DeferredRecorder(inner, clock)
    deferred.compute("forward", 9, 9, clock.now(), clock.now())  # outside a step: dropped
    start = clock.start_step()
    deferred.step_start(1, start)
    assert inner.calls == [("step_start", 1, start)]  # host time: passed on at once

    def stamp(at: float):
        device_time.at = 50.0 + at
        return clock.now()

    deferred.compute("forward", 0, 0, stamp(0.1), stamp(0.3))
    deferred.wait("recv", stamp(0.3), stamp(0.4))
    hook = threading.Thread(
        target=lambda: deferred.collective("dp", "all_reduce", 64, stamp(0.4), stamp(0.9), bucket=0)
    )
    hook.start()
    hook.join()
    deferred.compute("backward", 0, 0, stamp(0.4), stamp(0.8))
    assert inner.calls == [("step_start", 1, start)]  # nothing before step_end
    syncs = device.log.count(("synchronize",))
    deferred.step_end(1, 2.5, 100, 1.0)
    assert device.log.count(("synchronize",)) == syncs + 1
    assert inner.calls[0] == ("step_start", 1, start)
    assert inner.calls[-1] == ("step_end", 1, 2.5, 100, 1.0)
    assert [
        relative(call, start) for call in inner.calls[1:-1]
    ] == [  # seconds after the step start, call order
        ("compute", "forward", 0, 0, 0.1, 0.3),
        ("wait", "recv", 0.3, 0.4),
        ("collective", "dp", "all_reduce", 64, 0.4, 0.9, 0),
        ("compute", "backward", 0, 0, 0.4, 0.8),
    ]
    deferred.step_start(2, clock.start_step())
    deferred.step_end(2, 2.0, 100, 1.0)
    assert [c[0] for c in inner.calls[-2:]] == [
        "step_start",
        "step_end",
    ]  # step 1's events are gone


def test_deferred_recorder_feeds_a_memory_recorder_seconds():
    clock, _, device_time = cuda_clock(7.0)
    inner = recording.MemoryRecorder()
    deferred = recording.DeferredRecorder(inner, clock)
    start = clock.start_step()
    deferred.step_start(1, start)
    first = clock.now()
    device_time.at = 7.5
    deferred.compute("forward", 0, 0, first, clock.now())
    deferred.step_end(1, 1.0, 10, 0.5)
    assert inner.steps[-1]["compute_seconds"] == pytest.approx(0.5)
    assert inner.events[0].start == pytest.approx(start) and inner.events[0].end == pytest.approx(
        start + 0.5
    )


def test_cuda_bucket_exchanges_run_inline_on_their_own_stream_and_join_at_drain():
    """On CUDA a bucket's exchange runs inline (the issuing thread, no worker thread: one program
    order of NCCL calls across communicators) on the exchange stream, after the bucket's ready mark
    (recorded on the compute stream); backward's stream waits for it only at drain."""
    clock, device, _ = cuda_clock(0.0)
    queue = exchanges.ExchangeQueue(clock)
    seen = []
    try:
        queue.submit(lambda: seen.append((threading.current_thread().name, device.current.name)))
        assert seen  # ran before submit returned
        queue.drain()
    finally:
        queue.close()
    [(thread, stream)] = seen
    assert thread == threading.current_thread().name and stream == "exchange"
    assert device.log == [
        ("record", "compute"),  # the ready mark, where backward is
        ("enter", "exchange"),
        ("wait_event", "exchange", "compute"),  # the chain starts after the mark
        ("exit", "exchange"),
        ("wait_stream", "compute", "exchange"),  # drain: backward's stream joins the chains
    ]
    assert device.current is device.compute  # the issuing thread's stream is restored


def test_a_failed_exchange_is_raised_at_drain():
    queue = exchanges.ExchangeQueue(clocks.HostClock())
    queue.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        queue.drain()
    queue.close()


def test_after_a_failed_exchange_the_queued_ones_are_skipped_and_drain_raises_at_once():
    """A later chain's collectives would pair with the peers' rest of the failed one and hang: it must
    not run, and drain must not wait for it.  (The stand-in 'collective' waits for a release that
    only a test failure gives.)"""
    queue = exchanges.ExchangeQueue(clocks.HostClock())
    release = threading.Event()
    ran = []

    def paired_collective() -> None:
        ran.append("second")
        release.wait(timeout=30)

    def failing_chain() -> None:
        raise RuntimeError("leg 2 of bucket 0 failed")

    queue.submit(failing_chain)
    queue.submit(paired_collective)
    try:
        with pytest.raises(RuntimeError, match="leg 2 of bucket 0"):
            queue.drain()
        assert ran == []
        queue.submit(lambda: ran.append("next step"))  # a later step runs again
        queue.drain()
        assert ran == ["next step"]
    finally:
        release.set()
        queue.close()


def test_the_callers_dispatch_modes_see_a_queued_exchange():
    """A memory tracker or op counter active where a bucket becomes final sees its exchange's ops
    (run on the exchange thread), as autograd's worker threads inherit the caller's modes."""
    queue = exchanges.ExchangeQueue(clocks.HostClock())
    tracker = live_bytes.LiveBytes()
    with tracker:
        queue.submit(lambda: torch.ones(1000, dtype=torch.float64).sum())
        queue.drain()
    queue.close()
    assert tracker.peak >= 8000  # the exchange's 1000 doubles


class _Waitable:
    """A collective handle with no future, as gloo's reduce-scatter returns; done when the test says."""

    def __init__(self) -> None:
        self.done = False

    def wait(self) -> bool:
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done

    def get_future(self) -> torch.futures.Future:
        raise RuntimeError("Work::getFuture not implemented.")


class _PendingWork:
    """An asynchronous collective whose completion the test decides."""

    def __init__(self) -> None:
        self.future: torch.futures.Future = torch.futures.Future()

    def is_completed(self) -> bool:
        return self.future.done()

    def wait(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        return self.future


def test_host_clock_times_cpu_only_while_no_other_communication_runs() -> None:
    """A blocking call's CPU is the process's: with a bucket in flight or an exchange chain held it is not the call's alone."""
    clock = clocks.HostClock()
    assert isinstance(clock.cpu_now(), float)
    bucket = _PendingWork()
    launched = clock.launch(lambda: bucket)  # type: ignore[arg-type,return-value]
    launched.report_when_done(lambda start, end: None)
    assert clock.cpu_now() is None
    recorder = recording.MemoryRecorder()
    recording.blocking_collective(recorder, clock, "tp", "all_reduce", 8, lambda: None)
    assert recorder.events[-1].cpu_seconds is None
    bucket.future.set_result(None)
    assert isinstance(clock.cpu_now(), float)
    launched.wait()  # seen done twice: the callback, then the wait
    assert isinstance(clock.cpu_now(), float)
    # A collective without a future (gloo's reduce-scatter) lands when waited for, or
    # when it has completed by the next reading.
    waited = _Waitable()
    clock.launch(lambda: waited)  # type: ignore[arg-type,return-value]
    assert clock.cpu_now() is None
    waited.done = True
    assert isinstance(clock.cpu_now(), float)
    # An exchange chain queued for the worker thread holds the clock until it ends.
    release = clock.hold()
    assert clock.cpu_now() is None
    release()
    release()  # once only
    assert isinstance(clock.cpu_now(), float)
    recording.blocking_collective(recorder, clock, "tp", "all_reduce", 8, lambda: sum(range(10**5)))
    assert recorder.events[-1].cpu_seconds is not None and recorder.events[-1].cpu_seconds > 0
    assert clocks.CudaClock.cpu_now(None) is None  # type: ignore[arg-type]  # a queued call's host CPU says nothing


def test_a_queued_exchange_chain_holds_the_host_clock_until_it_ends() -> None:
    """A compressed or hierarchical bucket's chain runs on the exchange thread: no call's CPU is its own meanwhile."""
    clock = clocks.HostClock()
    queue = exchanges.ExchangeQueue(clock)
    started, finish = threading.Event(), threading.Event()

    def chain() -> None:
        started.set()
        finish.wait(timeout=10)

    queue.submit(chain)
    assert started.wait(timeout=10)
    assert clock.cpu_now() is None
    finish.set()
    queue.drain()
    assert isinstance(clock.cpu_now(), float)
