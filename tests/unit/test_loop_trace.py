"""loop_trace.message_latencies on trace lines whose timelines are worked out by hand.

Two pipeline stages whose step clocks (``t0``) differ by 1 s, as two
processes' do: a latency taken on either rank's own offsets would be off by
that second.
"""

from __future__ import annotations

import pytest

from meshtrain.trainer.telemetry import loop_trace, trace


def _line(stage: int, t0: float, events: list[dict], tp: int = 0) -> dict:
    return {
        "step": 3,
        "pp": stage,
        "dp": 0,
        "tp": tp,
        "virtual_stages": 1,
        "t0": t0,
        "events": events,
    }


def _compute(kind: str, microbatch: int, start: float, end: float) -> dict:
    return {
        "what": "compute",
        "kind": kind,
        "microbatch": microbatch,
        "chunk": 0,
        "start": start,
        "end": end,
    }


def _recv(start: float, end: float) -> dict:
    return {"what": "wait", "kind": "recv", "start": start, "end": end}


def test_latency_is_the_wait_s_end_less_the_sender_s_action_on_the_wall_clock() -> None:
    # Wall clock: stage 0 runs F0 [100.0, 100.2], F1 [100.2, 100.4]; stage 1
    # (t0 = 99.0) waits from 100.0 and holds F0's activations at 100.23: 0.03 s.
    # It asks for F1's only at 100.5, after they were sent (100.4): no latency.
    # Stage 0 waits for B0's gradients from 100.4; stage 1's B0 ends at 100.8,
    # stage 0 holds them at 100.81: 0.01 s.  B1's arrive while stage 0 computes.
    stage0 = _line(
        0,
        100.0,
        [
            _compute("forward", 0, 0.0, 0.2),
            _compute("forward", 1, 0.2, 0.4),
            _recv(0.4, 0.81),
            _compute("backward", 0, 0.81, 1.0),
            _recv(1.0, 1.0),
            _compute("backward", 1, 1.0, 1.2),
        ],
    )
    stage1 = _line(
        1,
        99.0,
        [
            _recv(1.0, 1.23),
            _compute("forward", 0, 1.23, 1.3),
            _recv(1.5, 1.5),
            _compute("forward", 1, 1.5, 1.6),
            _compute("backward", 0, 1.6, 1.8),
            _compute("backward", 1, 1.8, 1.9),
        ],
    )
    latencies = loop_trace.message_latencies([stage0, stage1])
    assert latencies["activations"] == [pytest.approx(0.03)]
    assert latencies["gradients"] == [pytest.approx(0.01)]


def test_interleaved_lines_and_other_steps_say_nothing() -> None:
    sender = _line(0, 0.0, [_compute("forward", 0, 0.0, 1.0)])
    receiver = _line(1, 0.0, [_recv(0.0, 1.5), _compute("forward", 0, 1.5, 2.0)])
    assert loop_trace.message_latencies([sender, receiver]) == {"activations": [pytest.approx(0.5)]}
    assert loop_trace.message_latencies([sender, {**receiver, "step": 4}]) == {}
    interleaved = [{**line, "virtual_stages": 2} for line in (sender, receiver)]
    assert loop_trace.message_latencies(interleaved) == {}


def test_a_wait_begun_after_the_send_still_times_a_message_in_flight_once_per_tensor_group() -> (
    None
):
    # Stage 0 sends F0's activations at 100.2.  Stage 1's two tensor-parallel
    # ranks ask for them only at 100.25, after the send, but wait until 100.27
    # and 100.29: the message was in flight, and the stage could start only once
    # both held theirs, so the hop took 0.09 s.  A wait of 50 us (below
    # IN_FLIGHT_WAIT_S) found its message there and says nothing.
    sender = [_line(0, 100.0, [_compute("forward", 0, 0.0, 0.2)], tp=tp) for tp in (0, 1)]
    receivers = [
        _line(1, 100.0, [_recv(0.25, end), _compute("forward", 0, end, 0.4)], tp=tp)
        for tp, end in ((0, 0.27), (1, 0.29))
    ]
    latencies = loop_trace.message_latencies(sender + receivers)
    assert latencies == {"activations": [pytest.approx(0.09)]}
    arrived = _line(1, 100.0, [_recv(0.25, 0.25005), _compute("forward", 0, 0.25005, 0.4)])
    assert loop_trace.message_latencies([sender[0], arrived]) == {}


class _PausingClocks:
    """perf_counter and time.time of one process (wall = perf + 1000 s); the first wall read comes after a 5 ms pause."""

    def __init__(self) -> None:
        self.now = 0.0
        self.wall_reads = 0

    def perf_counter(self) -> float:
        self.now += 1e-6
        return self.now

    def time(self) -> float:
        self.wall_reads += 1
        self.now += 5e-3 if self.wall_reads == 1 else 1e-6
        return self.now + 1000.0


def test_the_trace_s_wall_offset_ignores_a_read_split_by_a_pause(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Events are placed on the wall clock by this offset, and message latencies
    # of a few hundred microseconds compare two ranks' offsets: a rank paused
    # between its two clock reads would be off by the pause.
    clocks = _PausingClocks()
    monkeypatch.setattr(trace.time, "perf_counter", clocks.perf_counter)
    monkeypatch.setattr(trace.time, "time", clocks.time)
    assert abs(trace.wall_offset(reads=1) - 1000.0) > 2e-3  # the paused read alone
    clocks.wall_reads = 0
    assert trace.wall_offset() == pytest.approx(1000.0, abs=1e-5)


def _tp_call(op: str, start: float, end: float, nbytes: int, cpu: float | None) -> dict:
    event = {"what": "collective", "kind": op, "group": "tp", "bytes": nbytes}
    event.update(start=start, end=end)
    return event if cpu is None else {**event, "cpu": cpu}


def test_tensor_parallel_calls_sum_their_cpu_over_the_calls_that_timed_it() -> None:
    """Calls, wall seconds and bytes per op; CPU, calls and bytes of the calls that timed their CPU.

    A CPU sum over some of the calls divided by all of them would price the
    rest at nothing.  Data-parallel collectives and compute are not
    tensor-parallel calls.
    """
    lines = [
        _line(
            0,
            10.0,
            [
                _tp_call("all_reduce", 0.0, 0.002, 100, 0.001),
                _tp_call("all_gather", 0.01, 0.011, 50, 0.0005),
                {
                    "what": "collective",
                    "kind": "all_reduce",
                    "group": "dp",
                    "bytes": 7,
                    "start": 0.02,
                    "end": 0.03,
                    "cpu": 0.005,
                },
                _compute("forward", 0, 0.03, 0.04),
            ],
        ),
        _line(
            0,
            11.0,
            [
                _tp_call("all_reduce", 0.0, 0.003, 100, 0.002),
                _tp_call("all_gather", 0.01, 0.012, 50, None),
            ],
        ),
    ]
    calls = loop_trace.tp_calls(lines)
    assert calls["all_reduce"] == pytest.approx(
        {"calls": 2, "seconds": 0.005, "bytes": 200}
        | {"cpu_calls": 2, "cpu_bytes": 200, "cpu_seconds": 0.003}
    )
    assert calls["all_gather"] == pytest.approx(
        {"calls": 2, "seconds": 0.003, "bytes": 100}
        | {"cpu_calls": 1, "cpu_bytes": 50, "cpu_seconds": 0.0005}
    )
