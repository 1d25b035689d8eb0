"""The gradient noise scale the engine measures from its data-parallel replicas equals, on the first
step, McCandlish's estimator applied to gradients a plain one-process model computes on the same
sequences (each replica's rows, and the whole global batch)."""

from __future__ import annotations

import mt_harness
import pytest
import torch
import torch.nn.functional as F

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.data import batches, dataset
from meshtrain.trainer.guards import noise_scale
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import JobBuilder

cpu = JobBuilder.cpu_run
CASES = {
    "dp2-tp2": cpu().layout(data=2, tensor=2).training(steps=2),
    "dp2-pp2-accum2": (
        cpu().layout(data=2, pipeline=2).parallelism(microBatches=2).training(steps=2)
    ),
}


def first_step_noise(cases: dict[str, JobBuilder]) -> dict[str, tuple]:
    out = {}
    for case, run in cases.items():
        job = loading.parse_spec(run.raw())
        mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
        eng = engine.Engine(job, mesh)
        result = eng.train_step()
        if eng.noise is None:
            out[case] = (None, None, result.noise_scale)
            continue
        out[case] = (eng.noise.gradient_square, eng.noise.trace, result.noise_scale)
    return out


def reference(raw: dict) -> noise_scale.Estimate:
    """Dense model, one process: squared norms of each replica's rows' gradient and of the whole batch's."""
    job = loading.parse_spec(raw)
    config = gpt.GPTConfig.from_shape(job.model.shape())
    tokens = dataset.open_dataset(job.training, vocab=config.vocab, seq_len=config.seq_len)
    batch = batches.BatchSampler(
        tokens,
        seq_len=config.seq_len,
        micro_batch=job.global_batch,
        micro_batches=1,
        dp_rank=0,
        dp_size=1,
        seed=job.training.seed,
    ).global_batch_at(0)  # (G, T+1)

    def squared_norm(rows: torch.Tensor) -> float:
        model = llama.build(config, seed=job.training.seed)
        logits = model(rows[:, :-1])  # (rows, T, V)
        F.cross_entropy(logits.reshape(-1, config.vocab), rows[:, 1:].reshape(-1)).backward()
        return sum(float(p.grad.double().square().sum()) for p in model.parameters())

    replicas = job.parallelism.data
    small = job.global_batch // replicas
    smalls = [squared_norm(batch[r * small : (r + 1) * small]) for r in range(replicas)]
    return noise_scale.estimate(
        sum(smalls) / replicas, squared_norm(batch), small, job.global_batch
    )


COMPRESSED = {
    "dp4-int8": (
        cpu().layout(data=4).parallelism(gradientCompression={"mode": "int8"}).training(steps=2)
    )
}
"""Lossy compression: the all-reduced gradient is an approximation, so nothing is measured."""


@pytest.mark.timeout(600)
def test_first_step_noise_scale_matches_a_one_process_reference():
    [measured, *_] = mt_harness.run_distributed(first_step_noise, 4, {**CASES, **COMPRESSED})
    for case in COMPRESSED:
        assert measured[case] == (None, None, None), case
    for case, run in CASES.items():
        expected = reference(run.raw())
        gradient_square, trace, value = measured[case]
        assert gradient_square == pytest.approx(expected.gradient_square, rel=1e-4), case
        assert trace == pytest.approx(expected.trace, rel=1e-4), case
        if expected.trace > 0 and expected.gradient_square > 0:
            assert value == pytest.approx(expected.trace / expected.gradient_square, rel=1e-4)
