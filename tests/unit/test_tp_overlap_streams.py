"""The overlapped tensor-parallel linears on the CUDA clock, run on a CPU stand-in device.

NCCL cannot run here, so the collectives are stand-ins for a group of one (they log the stream
they were issued from and keep a weak reference to what they send); the clock is the real
CudaClock on tests/unit/fake_device.py.  Checked: every chunk's input is still referenced when
the compute stream is ordered after its collective (on NCCL, earlier frees let the next matmul
reuse memory the collective still reads: torch >= 2.7's ``work.wait()`` drops NCCL's own
reference), tensor-parallel and data-parallel collectives go out on different side streams, and
each landing waits for its own chunk, not for chunks launched after it.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from meshtrain.trainer.parallel import tensor, tensor_overlap
from meshtrain.trainer.telemetry import clocks
from tests.unit import fake_device


class Wire:
    """Stand-in collectives for a group of one, and what they saw."""

    def __init__(self, device: fake_device.FakeDevice) -> None:
        self.device = device
        self.sent: list[weakref.ref[torch.Tensor]] = []
        """What each collective sends, in launch order (weakly: only its caller may keep it)."""
        self.streams: list[str] = []
        """The stream each was issued from."""
        self.alive_at_wait: list[bool] = []
        """Per compute-stream wait, in order: was that collective's input still referenced."""

    def work(self, sent: torch.Tensor) -> Any:
        self.sent.append(weakref.ref(sent))
        self.streams.append(self.device.current.name)
        device = self.device

        class Work:
            def wait(self) -> bool:
                device.log.append(("work.wait", device.current.name))
                return True

        return Work()

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        def all_gather(out: torch.Tensor, x: torch.Tensor, **_: Any) -> Any:
            out.copy_(x)
            return self.work(x)

        def reduce_scatter(out: torch.Tensor, x: torch.Tensor, **_: Any) -> Any:
            out.copy_(x)
            return self.work(x)

        def all_reduce(x: torch.Tensor, **_: Any) -> Any:
            return self.work(x)

        monkeypatch.setattr(dist, "all_gather_into_tensor", all_gather)
        monkeypatch.setattr(dist, "reduce_scatter_tensor", reduce_scatter)
        monkeypatch.setattr(dist, "all_reduce", all_reduce)
        compute_wait = self.device.compute.wait_event

        def wait_event(event: fake_device.FakeEvent) -> None:
            landing = len(self.alive_at_wait)  # chunks land in launch order
            self.alive_at_wait.append(self.sent[landing]() is not None)
            compute_wait(event)

        monkeypatch.setattr(self.device.compute, "wait_event", wait_event)


def tp_clock() -> tuple[clocks.CudaClock, fake_device.FakeDevice]:
    device = fake_device.FakeDevice(names=("side", "tp-side", "exchange"))
    return clocks.CudaClock(torch.device("cuda", 0), device_api=device), device


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("which", ["column", "row"])
def test_each_chunk_input_lives_until_the_compute_stream_waits_for_its_collective(
    monkeypatch: pytest.MonkeyPatch, which: str, sequence_parallel: bool
) -> None:
    clock, device = tp_clock()
    clock.launch(lambda: Wire(device).work(torch.zeros(1)))  # a data-parallel bucket first: "side"
    wire = Wire(device)
    wire.install(monkeypatch)
    ctx = tensor.TPContext(
        group=None,  # type: ignore[arg-type]  # the stand-in collectives take no group
        rank=0,
        size=1,
        sequence_parallel=sequence_parallel,
        clock=clock,
        overlap=True,
    )
    torch.manual_seed(0)
    x = torch.randn(3, 8, 5, dtype=torch.float64, requires_grad=True)  # (B, T, H): B > 1, so
    weight = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)  # chunk copies are new
    linear = tensor_overlap.column_linear if which == "column" else tensor_overlap.row_linear
    y = linear(x, weight, ctx)
    y.backward(torch.ones_like(y))
    reference_x = x.detach().clone().requires_grad_()
    reference_w = weight.detach().clone().requires_grad_()
    reference = F.linear(reference_x, reference_w)  # a group of one: the plain linear
    reference.backward(torch.ones_like(reference))
    torch.testing.assert_close(y, reference, rtol=0, atol=1e-12)
    torch.testing.assert_close(x.grad, reference_x.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(weight.grad, reference_w.grad, rtol=0, atol=1e-12)

    assert wire.sent, "no collective was overlapped"
    assert len(wire.alive_at_wait) == len(wire.sent)  # every collective landed once
    assert all(wire.alive_at_wait), wire.alive_at_wait
    assert set(wire.streams) == {"tp-side"}  # never the data-parallel lane's "side"
    waits = [entry for entry in device.log if entry[0] == "wait_event" and entry[1] == "compute"]
    assert waits == [("wait_event", "compute", "tp-side")] * len(wire.sent)  # per chunk, its event
    assert ("wait_stream", "compute", "tp-side") not in device.log  # not every chunk launched since


def test_tp_and_dp_launches_run_on_their_own_side_streams() -> None:
    clock, device = tp_clock()
    wire = Wire(device)
    dp = clock.launch(lambda: wire.work(torch.zeros(1)))
    tp = clock.launch(lambda: wire.work(torch.zeros(1)), lane="tp")
    assert wire.streams == ["side", "tp-side"]
    assert dp.stream is not tp.stream
    # the tp side stream waits for the compute stream, never for the data-parallel stream
    assert ("wait_stream", "tp-side", "compute") in device.log
    assert not any(e[0] == "wait_stream" and e[1:] == ("tp-side", "side") for e in device.log)
    assert ("work.wait", "tp-side") in device.log  # the tp collective holds only its own stream
    del device.log[:]
    assert tp.wait() is tp.end
    assert device.log == [("wait_event", "compute", "tp-side")]
    assert clock.launch(lambda: wire.work(torch.zeros(1)), lane="tp").stream is tp.stream
