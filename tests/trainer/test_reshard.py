"""Reshard: a checkpoint written at dp2·pp2·tp2 (ZeRO-3; Llama: dp1·pp2·tp2, also with a replicated
key/value head and tied embeddings) loads at dp4·pp1·tp2 (ZeRO-2), dp1·pp1·tp1 (ZeRO-0) and dp2·pp1·tp2 (ZeRO-3).

Parameters must be equal after loading, and the next steps' losses must match
the run that wrote the checkpoint and simply went on (1e-5 relative).  The
optimizer state is checked through those losses: the step after loading
uses both AdamW moments, and the one after that the updated weights.
"""

from __future__ import annotations

import mt_harness
import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.checkpointing import checkpointer
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.parallel import tensor
from tests.builders import LLAMA_MQA, LLAMA_TINY, JobBuilder

STEPS, SAVE_AT = 5, 3


def _engine(raw: dict) -> engine.Engine:
    job = loading.parse_spec(raw)
    return engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))


def dense_params(eng: engine.Engine) -> dict[str, torch.Tensor]:
    """This rank's parameters as dense tensors (gathered over TP); only dp0/tp0 ranks return them."""
    mesh, plan = eng.mesh, eng.model.tp_plan
    out = {}
    for name, param in eng.model.named_params:
        value = param.detach().clone()
        if isinstance(value, DTensor):  # ZeRO-3: rows spread over dp
            value = value.full_tensor()
        if plan is not None and name in plan.shards:
            pieces = [torch.empty_like(value) for _ in range(mesh.layout.tensor)]
            dist.all_gather(pieces, value.contiguous(), group=mesh.group("tp"))
            value = tensor.unshard(pieces, plan.shards[name])
        out[name] = value
    return out if mesh.coords.dp == 0 and mesh.coords.tp == 0 else {}


def save_and_continue(raw: dict, root: str) -> dict:
    """Train to SAVE_AT, save, record dense parameters, then go on to the end (the uninterrupted reference)."""
    eng = _engine(raw)
    for _ in range(SAVE_AT):
        eng.train_step()
    checkpointer.Checkpointer(eng, root=root).save()
    params = dense_params(eng)
    return {"params": params, "losses": [eng.train_step().loss for _ in range(STEPS - SAVE_AT)]}


def load_and_continue(raw: dict, root: str) -> dict:
    """Restore the checkpoint at this layout, record dense parameters, then train to the end."""
    eng = _engine(raw)
    step = checkpointer.Checkpointer(eng, root=root).restore()
    params = dense_params(eng)
    return {
        "step": step,
        "params": params,
        "losses": [eng.train_step().loss for _ in range(STEPS - SAVE_AT)],
    }


def _merged(results: list[dict]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in results:
        merged.update(r["params"])
    return merged


cpu = JobBuilder.cpu_run
SOURCES = {
    # family -> (the run that writes the checkpoint: model, layout, ZeRO stage; world, parameter tensors)
    "gpt": (cpu().layout(data=2, pipeline=2, tensor=2).parallelism(zeroStage=3), 8, 4 * 8 + 5),
    # a vocabulary tp2 does not divide: tables padded to 384 rows, checkpoint written at 257
    # (ZeRO-1 moments: flat ranges crossing the padding), loaded unpadded at tp1 and padded again
    "gpt-vocab257": (
        cpu().model(vocab=257).layout(data=2, tensor=2).parallelism(zeroStage=1),
        4,
        4 * 8 + 5,
    ),
    # grouped-query QKV split over tp2 (one key/value head per rank) is the piece to get right
    "llama": (
        cpu().model(LLAMA_TINY).layout(pipeline=2, tensor=2).parallelism(zeroStage=0),
        4,
        4 * 6 + 3,
    ),
    # one key/value head held by both tp ranks, and the embedding tied across the two stages:
    # each is written by two ranks and must load as one dense tensor
    "llama-mqa-tied": (
        cpu()
        .model(LLAMA_MQA, tieEmbeddings=True)
        .layout(pipeline=2, tensor=2)
        .parallelism(zeroStage=0),
        4,
        4 * 6 + 2,
    ),
}


@pytest.fixture(scope="module", params=list(SOURCES))
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple:
    source, world, tensors = SOURCES[request.param]
    root = tmp_path_factory.mktemp(f"reshard-{request.param}")
    raw = source.clone().parallelism(microBatches=2).training(steps=STEPS).raw()
    written = mt_harness.run_distributed(save_and_continue, world, raw, str(root), timeout_s=400)
    return root, written, raw["model"], tensors


@pytest.mark.slow
@pytest.mark.parametrize(
    ("target", "zero_stage", "world"),
    [({"data": 4, "tensor": 2}, 2, 8), ({}, 0, 1), ({"data": 2, "tensor": 2}, 3, 4)],
    ids=["dp4-pp1-tp2-zero2", "dp1-pp1-tp1-zero0", "dp2-pp1-tp2-zero3"],
)
def test_reshard_loads_equal_params_and_continues_the_same(
    saved: tuple, target: dict, zero_stage: int, world: int
) -> None:
    root, written, model, tensors = saved
    raw = (
        cpu()
        .model(model)
        .layout(**target)
        .parallelism(zeroStage=zero_stage)
        .training(steps=STEPS)
        .raw()
    )
    loaded = mt_harness.run_distributed(load_and_continue, world, raw, str(root), timeout_s=400)
    before, after = _merged(written), _merged(loaded)
    assert sorted(before) == sorted(after) and len(before) == tensors
    for name in before:
        assert torch.equal(before[name], after[name]), name
    reference = written[0]["losses"]
    for result in loaded:
        assert result["step"] == SAVE_AT
        for want, got in zip(reference, result["losses"]):
            assert abs(want - got) / abs(want) < 1e-5, (reference, result["losses"])
