"""LiveBytes against the CPU allocator's own record, over a ZeRO-3 (FSDP2) training step.

FSDP2 allocates and frees every unit's gathered parameters by resizing
storages (``UntypedStorage.resize_``), which a dispatch mode does not see;
:class:`~meshtrain.trainer.telemetry.live_bytes.LiveBytes` must count them anyway.  The
reference is independent of it: with ``profile_memory=True`` the profiler
records every allocation and free the CPU allocator makes (a resize is a new
block and a freed one), and the running sum of those sizes from the start of
the step is the allocator's live-bytes curve.  Left out of that curve: what
a collective allocates inside itself (gloo's staging copies, freed on gloo's
threads, where the profiler records no free), which LiveBytes does not claim
to see either.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch
from torch._C._profiler import _EventType
from torch.distributed.device_mesh import init_device_mesh
from torch.profiler import ProfilerActivity, profile

from meshtrain.api import loading
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import state_bytes, zero3
from meshtrain.trainer.telemetry import clocks, live_bytes, recording
from tests.builders import JobBuilder

SHAPE = {"layers": 4, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32, "ffnHidden": 256}


def _inside_collective(event) -> bool:
    parent = event.parent
    while parent is not None:
        if parent.name.startswith(("c10d::", "gloo:")):
            return True
        parent = parent.parent
    return False


def _allocator_rise(prof: profile) -> int:
    """The allocator's highest live bytes above the profile's start (collectives' own staging left out)."""
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        event = pending.pop()
        pending.extend(event.children)
        if event.typed[0] == _EventType.Allocation:
            fields = event.typed[1]
            events.append(
                (event.start_time_ns, fields.alloc_size, fields.ptr, _inside_collective(event))
            )
    staging: set[int] = set()  # addresses a collective allocated and no free has been seen for
    live = peak = 0
    for _, size, ptr, in_collective in sorted(events):
        if size > 0 and in_collective:
            staging.add(ptr)
        elif size < 0 and ptr in staging:
            staging.discard(ptr)
        else:
            staging.discard(ptr)  # an allocation here: that block was freed unrecorded
            live += size
            peak = max(peak, live)
    return peak


def rises(steps: int) -> dict[str, int]:
    """The last step's rise of live bytes above its start, by LiveBytes and by the allocator.

    The trainer's GPT wrapped as the trainer wraps it for ZeRO-3, on one rank:
    FSDP2 then gathers and frees every unit by resizing its storages as on
    many, with no collective threads whose frees race the step's.
    """
    model = gpt.GPT(
        gpt.GPTConfig.from_shape(
            loading.parse_spec(JobBuilder.cpu_run().model(SHAPE).raw()).model.shape()
        )
    )
    dp_mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("dp",))
    zero3.apply_zero3([model], dp_mesh, recorder=recording.NullRecorder(), clock=clocks.HostClock())
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(
        0, SHAPE["vocab"], (2, SHAPE["seqLen"] + 1), generator=torch.Generator().manual_seed(0)
    )

    def step() -> None:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(steps - 1):
        step()  # FSDP2's lazy set-up and AdamW's moments
    tracker = live_bytes.LiveBytes()
    tracker.track(state_bytes.state_tensors(model, optimizer, None))
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, tracker:
        start = tracker.current
        step()
    return {"live_bytes": tracker.peak - start, "allocator": _allocator_rise(prof)}


@pytest.mark.slow
def test_live_bytes_sees_what_the_allocator_holds_under_zero3() -> None:
    (result,) = mt_harness.run_distributed(rises, 1, 2)
    assert result["live_bytes"] == pytest.approx(result["allocator"], rel=0.01), result
