"""Every layout trains like one device: a table of layouts (GPT and Llama rows) against one reference per model.

Same seed, same global batches: per-step losses (5 steps) and gradient norms
before clipping agree with a reference loop built only from torch (AdamW, LR
schedulers, ``clip_grad_norm_``) to ``LOSS_RTOL`` and ``NORM_RTOL`` relative,
and step-1 gradients, gathered to dense tensors, agree for every parameter
(rtol 1e-5, atol 4e-5).  Cases of one world size share one set of
processes (spawning dominates the cost on a small machine).
"""

from __future__ import annotations

import mt_harness
import mt_workers
import pytest
import torch

from tests.builders import LLAMA_MQA, LLAMA_TINY, JobBuilder

STEPS = 5
LOSS_RTOL = 1e-6
"""fp32 summation order differs between layouts; measured differences stay below 2e-7."""
NORM_RTOL = 1e-6
cpu = JobBuilder.cpu_run
# id -> spec; global batch 8 everywhere.
CASES_2 = {
    "dp2": cpu().layout(data=2),
    "dp2-accum2-smallbuckets": cpu().layout(data=2).parallelism(microBatches=2, bucketMb=0.05),
    "pp2-gpipe": cpu().layout(pipeline=2).parallelism(schedule="gpipe", microBatches=4),
    "pp2-1f1b": cpu().layout(pipeline=2).parallelism(schedule="1f1b", microBatches=4),
    "pp2-interleaved": (
        cpu()
        .layout(pipeline=2)
        .parallelism(schedule="interleaved-1f1b", virtualStages=2, microBatches=4)
    ),
    "tp2": cpu().layout(tensor=2),
    "tp2-sp-accum2": cpu().layout(tensor=2).parallelism(sequenceParallel=True, microBatches=2),
    # parallelism.overlap.tensor off: each tensor-parallel collective blocks (the other tp rows overlap)
    "tp2-serial": cpu().layout(tensor=2).parallelism(overlap={"tensor": False}),
    "tp2-sp-serial": (
        cpu().layout(tensor=2).parallelism(sequenceParallel=True, overlap={"tensor": False})
    ),
    # the overlapped row linears' recompute: their reduction after the save (tensor_overlap.replaying)
    "tp2-recompute": cpu().layout(tensor=2).training(activationCheckpointing=True),
    "tp2-sp-recompute": (
        cpu()
        .layout(tensor=2)
        .parallelism(sequenceParallel=True)
        .training(activationCheckpointing=True)
    ),
    "tp2-sp-selective": (
        cpu()
        .layout(tensor=2)
        .parallelism(sequenceParallel=True, microBatches=2)
        .training(selectiveRecompute=["attention", "mlp"])
    ),
    "pp2-1f1b-recompute": (
        cpu()
        .layout(pipeline=2)
        .parallelism(schedule="1f1b", microBatches=4)
        .training(activationCheckpointing=True)
    ),
    "dp2-zero1-accum2": (
        cpu().layout(data=2).parallelism(microBatches=2, bucketMb=0.05, zeroStage=1)
    ),
    "dp2-zero2-accum2": (
        cpu().layout(data=2).parallelism(microBatches=2, bucketMb=0.05, zeroStage=2)
    ),
    "dp2-zero3-accum2": cpu().layout(data=2).parallelism(microBatches=2, zeroStage=3),
    "llama-dp2-accum2": cpu().model(LLAMA_TINY).layout(data=2).parallelism(microBatches=2),
    "llama-pp2-1f1b": (
        cpu().model(LLAMA_TINY).layout(pipeline=2).parallelism(schedule="1f1b", microBatches=4)
    ),
    "llama-tp2-sp-recompute": (
        cpu()
        .model(LLAMA_TINY)
        .layout(tensor=2)
        .parallelism(sequenceParallel=True)
        .training(activationCheckpointing=True)
    ),
    "llama-tied-tp2": cpu().model(LLAMA_TINY, tieEmbeddings=True).layout(tensor=2),
    # a vocabulary tp does not divide: tables padded to 384 rows (2 x 192), padding out of the loss
    "vocab257-tp2": cpu().model(vocab=257).layout(tensor=2),
    "llama-tied-vocab257-tp2-sp": (
        cpu()
        .model(LLAMA_TINY, tieEmbeddings=True, vocab=257)
        .layout(tensor=2)
        .parallelism(sequenceParallel=True)
    ),
    # one key/value head over two tensor ranks: replicated, its gradient summed over both holders
    "llama-mqa-tp2-sp-accum2": (
        cpu().model(LLAMA_MQA).layout(tensor=2).parallelism(sequenceParallel=True, microBatches=2)
    ),
    # the embedding tied across stages: both copies' gradients summed (Megatron's embedding group)
    "llama-tied-pp2-1f1b": (
        cpu()
        .model(LLAMA_TINY, tieEmbeddings=True)
        .layout(pipeline=2)
        .parallelism(schedule="1f1b", microBatches=4)
    ),
    # context parallelism: each sequence over two ranks (ring attention, load-balanced chunks)
    "cp2-accum2": cpu().layout(context=2).parallelism(microBatches=2),
    "llama-cp2": cpu().model(LLAMA_TINY).layout(context=2),
    # top-k keeping every element is the one exact compression mode
    "dp2-topk-all": (
        cpu().layout(data=2).parallelism(gradientCompression={"mode": "topk", "topkRatio": 1.0})
    ),
}
# context parallelism composed with each other degree (ring attention over two ranks)
CASES_4 = {
    "dp2-cp2-zero1": cpu().layout(data=2, context=2).parallelism(microBatches=2, zeroStage=1),
    "dp2-cp2-zero2-recompute": (
        cpu()
        .layout(data=2, context=2)
        .parallelism(microBatches=2, bucketMb=0.05, zeroStage=2)
        .training(activationCheckpointing=True)
    ),
    "llama-dp2-cp2-zero3-accum2": (
        cpu().model(LLAMA_TINY).layout(data=2, context=2).parallelism(microBatches=2, zeroStage=3)
    ),
    "cp2-tp2-sp": cpu().layout(context=2, tensor=2).parallelism(sequenceParallel=True),
    "pp2-cp2-1f1b": cpu().layout(pipeline=2, context=2).parallelism(microBatches=2),
    "llama-mqa-cp2-tp2": cpu().model(LLAMA_MQA).layout(context=2, tensor=2),
    "llama-tied-pp2-cp2-1f1b": (
        cpu()
        .model(LLAMA_TINY, tieEmbeddings=True)
        .layout(pipeline=2, context=2)
        .parallelism(microBatches=2)
    ),
}
CASES_8 = {
    "dp2-pp2-tp2-1f1b": cpu().layout(data=2, pipeline=2, tensor=2).parallelism(microBatches=2),
    "dp2-pp2-tp2-gpipe-sp": (
        cpu()
        .layout(data=2, pipeline=2, tensor=2)
        .parallelism(schedule="gpipe", microBatches=2, sequenceParallel=True)
    ),
    "dp2-pp2-tp2-interleaved-sp": (
        cpu()
        .layout(data=2, pipeline=2, tensor=2)
        .parallelism(
            schedule="interleaved-1f1b",
            virtualStages=2,
            microBatches=2,
            sequenceParallel=True,
            bucketMb=0.02,
        )
    ),
}
# two simulated nodes of 4 ranks: reduce-scatter over 2 dp peers per node, all-reduce across the nodes
CASES_8["dp4-tp2-hierarchical-2nodes"] = (
    cpu()
    .layout(data=4, tensor=2, gpus_per_node=4)
    .parallelism(microBatches=2, bucketMb=0.05, allReduce="hierarchical")
)
CASES_8["dp2-pp2-tp2-interleaved-sp-zero3"] = (
    CASES_8["dp2-pp2-tp2-interleaved-sp"].clone().parallelism(zeroStage=3)
)
# replicated key/value head, and the embedding tied across stages under ZeRO-1
CASES_8["llama-mqa-tied-dp2-pp2-tp2-zero1"] = (
    cpu()
    .model(LLAMA_MQA, tieEmbeddings=True)
    .layout(data=2, pipeline=2, tensor=2)
    .parallelism(microBatches=2, zeroStage=1)
)
# ... and under sequence parallelism: the last stage's head is the embedding by name
CASES_8["llama-mqa-tied-dp2-pp2-tp2-sp-zero1"] = (
    CASES_8["llama-mqa-tied-dp2-pp2-tp2-zero1"].clone().parallelism(sequenceParallel=True)
)
CASES_8["llama-dp2-pp2-tp2-interleaved-sp"] = (
    CASES_8["dp2-pp2-tp2-interleaved-sp"].clone().model(LLAMA_TINY)
)


@pytest.fixture(scope="module")
def references():
    """The single-device reference of each model of the tables, by its case's model dict."""
    models = {
        repr(b.raw()["model"]): b.raw()["model"] for b in {**CASES_2, **CASES_4, **CASES_8}.values()
    }
    return {key: mt_workers.reference(cpu().model(m).raw(), STEPS) for key, m in models.items()}


def _reference_of(table: dict, case: str, references: dict) -> dict:
    return references[repr(table[case].raw()["model"])]


def _run(table: dict, world: int) -> dict:
    cases = [(name, builder.raw()) for name, builder in table.items()]
    merged: dict[str, dict] = {}
    for rank_result in mt_harness.run_distributed(mt_workers.train_cases, world, cases, STEPS):
        for name, result in rank_result.items():
            entry = merged.setdefault(name, {"grads": {}, "losses": result["losses"], "ranks": []})
            entry["grads"].update(result["grads"])
            entry["ranks"].append(result)
    return merged


@pytest.fixture(scope="module")
def world2():
    return _run(CASES_2, 2)


@pytest.fixture(scope="module")
def world4():
    return _run(CASES_4, 4)


@pytest.fixture(scope="module")
def world8():
    return _run(CASES_8, 8)


def _compare(result: dict, reference: dict) -> None:
    ref_losses = torch.tensor(reference["losses"])
    losses = torch.tensor(result["losses"])
    rel = ((losses - ref_losses).abs() / ref_losses.abs()).max().item()
    assert rel < LOSS_RTOL, (
        f"losses {result['losses']} vs reference {reference['losses']} (max rel diff {rel:.2e})"
    )
    for rank_result in result["ranks"]:
        norms, ref_norms = torch.tensor(rank_result["norms"]), torch.tensor(reference["norms"])
        rel = ((norms - ref_norms).abs() / ref_norms).max().item()
        assert rel < NORM_RTOL, (
            f"gradient norms {rank_result['norms']} vs reference {reference['norms']} (max rel {rel:.2e})"
        )
    assert set(result["grads"]) == set(reference["grads"]), (
        "gathered parameters differ from the dense model's"
    )
    for name, ref in reference["grads"].items():
        torch.testing.assert_close(
            result["grads"][name],
            ref,
            rtol=1e-5,
            atol=4e-5,
            msg=lambda m, name=name: f"{name}: {m}",
        )
    # every rank agrees on the loss
    for rank_result in result["ranks"]:
        assert rank_result["losses"] == result["losses"]


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_2))
def test_two_rank_layouts_match_single_device(case, world2, references):
    _compare(world2[case], _reference_of(CASES_2, case, references))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_4))
def test_context_parallel_layouts_match_single_device(case, world4, references):
    _compare(world4[case], _reference_of(CASES_4, case, references))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES_8))
def test_dp2_pp2_tp2_matches_single_device(case, world8, references):
    _compare(world8[case], _reference_of(CASES_8, case, references))


@pytest.mark.slow
def test_loss_falls(references):
    for reference in references.values():
        assert reference["losses"][-1] < reference["losses"][0]


@pytest.mark.slow
def test_gradient_collectives_per_step_equal_buckets(world2, world8):
    for result in (
        world2["dp2-accum2-smallbuckets"],
        world8["dp2-pp2-tp2-interleaved-sp"],
        world2["dp2"],
    ):
        for rank_result in result["ranks"]:
            assert rank_result["buckets"] >= 1
            assert rank_result["dp_collectives"] == [rank_result["buckets"]] * STEPS
    small = world2["dp2-accum2-smallbuckets"]["ranks"][0]
    assert 1 < small["buckets"] < small["param_tensors"]


@pytest.mark.slow
def test_hierarchical_all_reduce_runs_per_level_and_cuts_inter_node_bytes(world8):
    """Per bucket: reduce-scatter and all-gather inside the node, all-reduce across nodes of 1/k of it."""
    k = 2  # dp peers per simulated node (gpusPerNode 4 / tensor 2)
    for rank_result in world8["dp4-tp2-hierarchical-2nodes"]["ranks"]:
        padded = sum(
            -(-n // (4 * k)) * 4 * k for n in rank_result["bucket_bytes"]
        )  # fp32, k-padded
        buckets = len(rank_result["bucket_bytes"])
        assert rank_result["dp_levels"] == {
            "reduce_scatter/intra": [buckets, padded],
            "all_reduce/inter": [buckets, padded // k],
            "all_gather/intra": [buckets, padded],
        }


@pytest.mark.slow
def test_recorder_sees_every_microbatch_and_collective(world2, world8):
    cases = [(name, b.raw()["parallelism"], world2) for name, b in CASES_2.items()] + [
        (name, b.raw()["parallelism"], world8) for name, b in CASES_8.items()
    ]
    for name, kw, result_set in cases:
        m, v = kw["microBatches"], kw["virtualStages"]
        expected = sorted(
            (k, mb, c) for k in ("forward", "backward") for mb in range(m) for c in range(v)
        )
        for rank_result in result_set[name]["ranks"]:
            assert all(step == expected for step in rank_result["computes"]), name
            assert (rank_result["tp_collectives"] > 0) == (kw["tensor"] > 1), name
            if kw["pipeline"] > 1:
                assert rank_result["recv_waits"] > 0, name
