"""Context-parallel ring timing: a transfer's flight is a ``cp`` collective, the time its wait
held compute a ``cp`` wait (its exposed part), and steps.jsonl sums the waits apart from tp's."""

from __future__ import annotations

import time

import pytest
import torch

from meshtrain.trainer.parallel import context
from meshtrain.trainer.telemetry import clocks, recording, stepstats
from tests.unit.test_telemetry_stepstats import facts


class SlowWork:
    """A transfer the wait is held on for ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def wait(self) -> bool:
        time.sleep(self.seconds)
        return True


def test_a_ring_transfer_records_its_flight_and_its_exposed_wait_apart() -> None:
    recorder = recording.MemoryRecorder()
    ctx = context.CPContext(
        group=None,  # type: ignore[arg-type]  # the stand-in works need no group
        grad_group=None,  # type: ignore[arg-type]
        rank=0,
        size=2,
        peers=(0, 1),
        recorder=recorder,
        clock=clocks.HostClock(),
    )
    launched = time.perf_counter()
    time.sleep(0.02)  # the attention tile beside the transfer
    context._finish([SlowWork(0.01)], torch.zeros(4, dtype=torch.float32), ctx, launched)
    (flight,) = [e for e in recorder.events if e.what == "collective"]
    (held,) = [e for e in recorder.events if e.what == "wait"]
    assert (flight.group, flight.kind, flight.nbytes) == ("cp", recording.RING_OP, 16)
    assert held.kind == "cp"
    assert flight.start == launched and held.end == flight.end
    assert flight.start + 0.02 <= held.start < held.end  # the tile's time is flight, not wait
    assert 0.01 <= held.end - held.start < flight.end - flight.start
    summary = recorder.summary()
    assert summary["cp_exposed_seconds"] == pytest.approx(held.end - held.start)
    assert summary["tp_exposed_seconds"] == 0.0


def test_cp_waits_are_their_own_exposed_time_in_the_step_record() -> None:
    events = [
        recording.Event("compute", "forward", 0.0, 10.0, microbatch=0, chunk=0),
        recording.Event("collective", recording.RING_OP, 1.0, 4.0, group="cp", nbytes=8),
        recording.Event("wait", "cp", 3.5, 4.0),  # the tile hid 2.5 s of the 3 s flight
        recording.Event("wait", "tp", 5.0, 5.25),
    ]
    stats = stepstats.summarise(
        events, facts(), step=1, loss=1.0, tokens=8, seconds=10.0, start=0.0
    )
    assert stats.cp_exposed_seconds == pytest.approx(0.5)
    assert stats.tp_exposed_seconds == pytest.approx(0.25)
    assert stats.wait_seconds == 0.0
    assert stats.log_record()["cp_exposed_seconds"] == pytest.approx(0.5)
    assert (
        "cp_exposed_seconds"
        not in stepstats.summarise(
            events[:1], facts(), step=1, loss=1.0, tokens=8, seconds=10.0, start=0.0
        ).log_record()
    )


class _Op:
    """A point-to-point op as :func:`context._exchange` builds it, recorded."""

    def __init__(self, op: object, tensor: torch.Tensor, peer: int, group: object) -> None:
        self.op, self.tensor, self.peer, self.group = op, tensor, peer, group


def test_the_gradient_ring_runs_on_its_own_group_never_the_key_value_one(monkeypatch) -> None:
    """NCCL ignores point-to-point tags: every key/value gradient message must go on the second
    group, every key/value message on the first (a shared group would match them by order)."""
    sent: list[tuple[object, torch.Tensor]] = []

    def batch(ops: list[_Op]) -> list[SlowWork]:
        for op in ops:
            if op.op is torch.distributed.irecv:
                op.tensor.zero_()  # what the peer sent: any finite value does
            else:
                sent.append((op.group, op.tensor.clone()))
        return [SlowWork(0.0)]

    monkeypatch.setattr(context.dist, "P2POp", _Op)
    monkeypatch.setattr(context.dist, "batch_isend_irecv", batch)
    kv_group, grad_group = object(), object()
    ctx = context.CPContext(
        group=kv_group,  # type: ignore[arg-type]  # stand-ins: the ops are recorded, not sent
        grad_group=grad_group,  # type: ignore[arg-type]
        rank=0,
        size=3,
        peers=(0, 1, 2),
        recorder=recording.MemoryRecorder(),
        clock=clocks.HostClock(),
    )
    q, k, v = (torch.randn(1, 2, 12, 4, requires_grad=True) for _ in range(3))
    out = context._RingAttention.apply(q, k, v, ctx, None)
    forward = len(sent)
    out.backward(torch.randn_like(out))
    kv = torch.stack([k, v]).detach()
    groups = [group for group, _ in sent]
    # forward: the keys and values travel size - 1 hops; backward: again, and their gradients
    # size hops home; the first of each ring carries this rank's own keys and values, or not
    assert groups[:forward] == [kv_group] * 2
    assert groups[forward:].count(kv_group) == 2 and groups[forward:].count(grad_group) == 3
    assert torch.equal(sent[0][1], kv) and torch.equal(sent[forward][1], kv)
    first_grad = next(t for group, t in sent[forward:] if group is grad_group)
    assert not torch.equal(first_grad, kv)
