"""Hierarchical and compressed bucket exchanges overlap backward, as the flat all-reduce does.

Two gloo ranks train one step of a tiny GPT with small buckets (the head's
bucket is ready long before the embedding's gradient).  A test hook on the
token embedding, the last gradient backward produces, holds backward until
the trainer's recorder has seen a collective of bucket 1: the exchange
thread runs buckets in order, so bucket 0's whole exchange is then done.
The recorded timeline must then show every collective of bucket 0 ending
before the last backward ends.  An exchange run after backward (in the
reducer's ``finish``) never lets the hold go: the hold gives up after
``HOLD_S`` and the test fails.  No timing under load is compared: the hold
orders the events.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recording
from tests.builders import JobBuilder

HOLD_S = 60.0


def _dp2() -> JobBuilder:
    """Two data ranks, buckets of 0.01 MiB: several of them."""
    return JobBuilder.cpu_run().layout(data=2).parallelism(bucketMb=0.01)


CASES = {
    "hierarchical": _dp2().parallelism(allReduce="hierarchical").gpus(1),
    "bf16": _dp2().parallelism(gradientCompression={"mode": "bf16"}),
    "int8": _dp2().parallelism(gradientCompression={"mode": "int8"}),
    "topk": _dp2().parallelism(gradientCompression={"mode": "topk", "topkRatio": 0.1}),
    "powersgd": _dp2().parallelism(
        gradientCompression={"mode": "powersgd", "rank": 2, "warmupSteps": 0}
    ),
}


class _Watch(recording.MemoryRecorder):
    """Records, and says when a dp collective of bucket 1 has been reported."""

    def __init__(self) -> None:
        super().__init__()
        self.second_bucket = threading.Event()

    def collective(
        self,
        group: recording.Group,
        op: str,
        nbytes: int,
        start: float,
        end: float,
        bucket: int | None = None,
        level: recording.Level = "flat",
        cpu_seconds: float | None = None,
    ) -> None:
        super().collective(
            group, op, nbytes, start, end, bucket=bucket, level=level, cpu_seconds=cpu_seconds
        )
        if group == "dp" and bucket == 1:
            self.second_bucket.set()


def _hold(until: threading.Event, released: list[bool]) -> Callable[[torch.Tensor], None]:
    """A gradient hook that blocks backward until ``until`` is set (or HOLD_S passes)."""

    def hook(_param: torch.Tensor) -> None:
        released.append(until.wait(HOLD_S))

    return hook


def timelines() -> dict:
    """On every rank, per case: whether the hold was released, and bucket 0's and backward's ends."""
    out, mesh = {}, None
    for case, run in CASES.items():
        raw = run.clone().training(steps=1).raw()
        job = loading.parse_spec(raw)
        mesh = mesh or mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        watch = _Watch()
        eng = engine.Engine(job, mesh, recorder=watch)
        released = []
        embedding = next(
            eng.model.chunks[0].parameters()
        )  # tok_emb.weight: its gradient comes last
        embedding.register_post_accumulate_grad_hook(_hold(watch.second_bucket, released))
        eng.train_step()
        events = watch.events
        out[case] = {
            "released": released,
            "buckets": len(eng.model.reducer.buckets),
            "backward_end": max(e.end for e in events if e.kind == "backward"),
            "bucket0": [(e.kind, e.level, e.end) for e in events if e.bucket == 0],
        }
    return out


@pytest.mark.slow
def test_bucket_exchanges_finish_while_backward_still_runs() -> None:
    for rank, result in enumerate(mt_harness.run_distributed(timelines, 2)):
        for case, seen in result.items():
            where = f"rank {rank} {case}"
            assert seen["buckets"] > 2, f"{where}: the tiny buckets must be several"
            assert seen["released"] == [True], (
                f"{where}: bucket 1's exchange had not started {HOLD_S} s into the hold, "
                "so the exchanges do not run during backward"
            )
            assert seen["bucket0"], f"{where}: bucket 0 recorded no collective"
            late = [e for e in seen["bucket0"] if e[2] > seen["backward_end"]]
            assert not late, f"{where}: bucket 0's {late} ended after the last backward"
    # the hierarchical chain shows its three legs, each level named
    levels = {(kind, level) for kind, level, _ in result["hierarchical"]["bucket0"]}
    assert levels == {
        ("reduce_scatter", "intra"),
        ("all_reduce", "inter"),
        ("all_gather", "intra"),
    }


NUMBER_CASES = {
    "int8": _dp2().parallelism(gradientCompression={"mode": "int8"}),
    "powersgd": _dp2().parallelism(
        gradientCompression={"mode": "powersgd", "rank": 2, "warmupSteps": 0}
    ),
    # both ranks on one simulated node: an intra-node group of 2 (reduce-scatter and all-gather
    # carry data) and an inter-node group of 1
    "hierarchical": _dp2().parallelism(allReduce="hierarchical").gpus(2),
}


def exchanged(overlap: bool) -> dict:
    """Per case, two steps' reduced gradients (every bucket after ``finish``) and reducer state;
    ``overlap=False`` removes the reducer's hooks, so every exchange is issued from ``finish``."""
    out, mesh = {}, None
    for case, run in NUMBER_CASES.items():
        raw = run.clone().training(steps=2).raw()
        job = loading.parse_spec(raw)
        mesh = mesh or mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        torch.manual_seed(0)
        eng = engine.Engine(job, mesh, recorder=recording.MemoryRecorder())
        reducer = eng.model.reducer
        if not overlap:
            for hook in reducer._hooks:
                hook.remove()
        grads: list[list[torch.Tensor]] = []
        finish = reducer.finish

        def finish_and_keep(finish=finish, reducer=reducer, grads=grads) -> None:
            finish()
            grads.append([b.buffer.clone() for b in reducer.buckets])

        reducer.finish = finish_and_keep
        states = []
        for _ in range(2):
            eng.train_step()
            states.append({k: v.clone() for k, v in getattr(reducer, "state", {}).items()})
        out[case] = {"buckets": len(reducer.buckets), "grads": grads, "states": states}
    return out


def _run_both() -> dict:
    return {"overlapped": exchanged(True), "after_backward": exchanged(False)}


@pytest.mark.slow
def test_overlapped_exchanges_give_the_same_numbers_as_exchanges_after_backward() -> None:
    for rank, result in enumerate(mt_harness.run_distributed(_run_both, 2)):
        for case in NUMBER_CASES:
            over, after = result["overlapped"][case], result["after_backward"][case]
            where = f"rank {rank} {case}"
            assert over["buckets"] > 2, f"{where}: the tiny buckets must be several"
            assert len(over["grads"]) == len(after["grads"]) == 2
            for step, (a, b) in enumerate(zip(over["grads"], after["grads"], strict=True)):
                for index, (x, y) in enumerate(zip(a, b, strict=True)):
                    assert torch.equal(x, y), f"{where} step {step + 1}: bucket {index} differs"
            for step, (a, b) in enumerate(zip(over["states"], after["states"], strict=True)):
                assert a.keys() == b.keys()
                if case != "hierarchical":
                    assert a, f"{where}: no error-feedback / Q state to compare"
                for key in a:
                    assert torch.equal(a[key], b[key]), f"{where} step {step + 1}: {key} differs"
