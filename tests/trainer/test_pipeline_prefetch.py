"""Pipeline point-to-point: batched, and on gloo each receive posted one action ahead.

gloo hands a sent tensor over only once the matching receive is posted; a
receive posted when its data is needed puts that hand-over on the critical
path of every micro-batch (measured: 2-5 ms per hop for 512 KiB on this VM,
+0.01..0.02 of measured bubble at m = 8).  Two gloo ranks run dp1·pp2 for
gpipe and 1f1b with a recorder that also notes when each receive is posted;
every receive except a stage's first must be posted before the compute of
the action before the one that needs it begins.  The interleaved schedule
keeps receives at the point of need (p = 2 sends both ways on one group),
batched with the send before them.  Every send and receive goes through
``torch.distributed.batch_isend_irecv`` (NCCL groups a batch, so two stages
sending to each other at once cannot both block).
"""

from __future__ import annotations

import time

import mt_harness
import pytest
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder


def posting_order(schedule: str, virtual: int) -> dict:
    """This rank's stage, when each receive was posted and when each compute began, for one step."""
    raw = (
        JobBuilder.cpu_run()
        .layout(pipeline=2)
        .parallelism(schedule=schedule, virtualStages=virtual, microBatches=4)
        .training(steps=1)
        .raw()
    )
    job = loading.parse_spec(raw)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    recorder = recording.MemoryRecorder()
    eng = engine.Engine(job, mesh, recorder=recorder)
    batches: list[tuple[float, list[str]]] = []  # when each batch was issued, and its ops
    real_batch = dist.batch_isend_irecv

    def noting_batch(ops):  # a pass-through
        kinds = ["recv" if op.op is dist.irecv else "send" for op in ops]
        batches.append((time.perf_counter(), kinds))
        return real_batch(ops)

    dist.batch_isend_irecv = noting_batch
    try:
        eng.train_step()
    finally:
        dist.batch_isend_irecv = real_batch
    posts = [t for t, kinds in batches if "recv" in kinds]
    computes = [
        e.start for e in recorder.events if e.what == "compute"
    ]  # one per action, in action order
    stage = mesh.coords.pp
    needs = [
        i
        for i, a in enumerate(
            eng.model.executor.actions
        )  # p = 2: stage 0 receives gradients, 1 activations
        if a.kind == ("backward" if stage == 0 else "forward")
    ]
    return {
        "stage": stage,
        "posts": posts,
        "computes": computes,
        "needs": needs,
        "prefetch": eng.model.executor._prefetch(),
        "batches": [kinds for _, kinds in batches],
        "transfers": _transfers(eng.model.executor),
    }


def _transfers(executor) -> dict[str, int]:
    """Sends and receives the schedule implies for this stage (virtual stage j of P: none beyond the ends)."""
    last = executor.ctx.stages * executor.virtual_stages - 1
    counts = {"send": 0, "recv": 0}
    for action in executor.actions:
        j = action.chunk * executor.ctx.stages + executor.ctx.stage
        inbound = j > 0 if action.kind == "forward" else j < last
        outbound = j < last if action.kind == "forward" else j > 0
        counts["recv"] += inbound
        counts["send"] += outbound
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_receives_are_posted_one_action_ahead_on_gloo(schedule: str) -> None:
    for result in mt_harness.run_distributed(posting_order, 2, schedule, 1):
        assert result["prefetch"]
        posts, computes, needs = result["posts"], result["computes"], result["needs"]
        assert len(posts) == len(needs) == 4  # stage 0: 4 gradients; stage 1: 4 activations
        for post, action in zip(posts, needs):
            if (
                action > 0
            ):  # posted before the action ahead of the one that needs it began computing
                assert post < computes[action - 1], (result["stage"], action, posts, computes)


@pytest.mark.slow
def test_interleaved_receives_at_the_point_of_need() -> None:
    for result in mt_harness.run_distributed(posting_order, 2, "interleaved-1f1b", 2):
        assert not result["prefetch"]


@pytest.mark.slow
@pytest.mark.parametrize(("schedule", "virtual"), [("1f1b", 1), ("interleaved-1f1b", 2)])
def test_every_send_and_receive_goes_through_batch_isend_irecv(schedule: str, virtual: int) -> None:
    for result in mt_harness.run_distributed(posting_order, 2, schedule, virtual):
        ops = [kind for batch in result["batches"] for kind in batch]
        assert {k: ops.count(k) for k in ("send", "recv")} == result["transfers"]
        if not result["prefetch"]:  # receives ride with the send before them where the group allows
            assert ["send", "recv"] in result["batches"], result["batches"]
