"""Lean initialisation: a rank builds only the weights it keeps, and they equal a single device's."""

from __future__ import annotations

import mt_harness
import pytest
import torch

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.models import gpt
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder


def built_names_case(raw: dict) -> dict:
    """Build the engine while recording every dense tensor ``initial_value`` makes on this rank."""
    built: list[str] = []
    original = gpt.initial_value

    def recording(config, seed, name, shape):  # same signature as gpt.initial_value
        built.append(name)
        return original(config, seed, name, shape)

    gpt.initial_value = recording
    try:
        job = loading.parse_spec(raw)
        trainer = engine.Engine(
            job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        )
    finally:
        gpt.initial_value = original
    kept = [name for name, _ in trainer.model.named_params]
    reference = dict(gpt.GPT(trainer.config, seed=job.training.seed).named_parameters())
    unsharded_equal = all(
        torch.equal(p.detach(), reference[n])
        for n, p in trainer.model.named_params
        if trainer.model.tp_plan is None or n not in trainer.model.tp_plan.shards
    )
    return {"built": built, "kept": kept, "unsharded_equal": unsharded_equal}


@pytest.mark.slow
def test_each_rank_builds_only_its_own_parameters_once():
    run = JobBuilder.cpu_run().layout(pipeline=2, tensor=2).parallelism(microBatches=2)
    raw = run.training(steps=1).raw()
    results = mt_harness.run_distributed(built_names_case, 4, raw)
    everything = set(
        dict(
            gpt.GPT(
                gpt.GPTConfig.from_shape(loading.parse_spec(raw).model.shape())
            ).named_parameters()
        )
    )
    for result in results:
        assert sorted(result["built"]) == sorted(result["kept"]), (
            "built exactly the kept parameters, each once"
        )
        assert set(result["kept"]) < everything, "a pipeline stage keeps only part of the model"
        assert result["unsharded_equal"], "replicated weights equal a single device's"
