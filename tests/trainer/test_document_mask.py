"""``training.documentMask`` trains every layout like each document run alone (``make test`` tier).

The reference is independent of the mask: :func:`mt_workers.reference`, the one-process loop
of the equivalence tests, with the logits of :func:`per_document_logits`: each window of the
global batch cut at its end-of-text ids by a plain loop, every document run through the dense
model alone (no mask, positions from 0), the logits put back in window order.  The masked packed
run equals it on one device and on every layout of the equivalence matrix (``test_equivalence``'s
tables, the mask switched on), to the tolerances those tests use; the MFU figure follows the
FLOPs recounted from the batch's document lengths.
"""

from __future__ import annotations

import json

import mt_harness
import mt_workers
import numpy as np
import pytest
import test_equivalence as matrix
import test_resume_exact as resume
import torch
import torch.distributed as dist

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.data import dataset, token_files
from meshtrain.trainer.models import documents, gpt, llama
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.telemetry import recorder as recorder_mod
from tests.builders import LLAMA_TINY, TINY, JobBuilder

EOS = 0
STEPS = matrix.STEPS


def write_documents(directory, size: int) -> str:
    """Byte tokens of Python sources cut into documents of 1 to 40 ids, each ended by EOS, with
    the metadata ``meshtrain data prepare`` writes (windows of 32 hold 1 to 10 documents)."""
    text = np.fromfile(dataset.stdlib_corpus(), dtype="<u2")[:size]
    rng = np.random.default_rng(5)
    pieces, at = [], 0
    while at < len(text):
        size = int(rng.integers(1, 41))
        pieces += [text[at : at + size], np.array([EOS], dtype=np.uint16)]
        at += size
    path = directory / "docs.bin"
    tokens = np.concatenate(pieces).astype("<u2")
    tokens.tofile(path)
    meta = {"dtype": "uint16", "vocab": 256, "tokens": len(tokens), "eos_id": EOS}
    token_files.metadata_path(path).write_text(json.dumps(meta))
    return str(path)


@pytest.fixture(scope="module")
def documents_file(tmp_path_factory, corpus_cache) -> str:
    return write_documents(tmp_path_factory.mktemp("documents"), 60_000)


def masked(builder: JobBuilder, path: str) -> JobBuilder:
    return builder.clone().training(dataset=path, documentMask=True)


def split_documents(row: list[int]) -> list[tuple[int, int]]:
    """(start, end) of each document of a window: cut after every EOS."""
    spans, start = [], 0
    for i, token in enumerate(row):
        if token == EOS:
            spans.append((start, i + 1))
            start = i + 1
    return spans + ([(start, len(row))] if start < len(row) else [])


def per_document_logits(model: gpt.GPT, inputs: torch.Tensor) -> torch.Tensor:
    """(G, T, V): every document of every window run alone, the logits put back in place."""
    rows = []
    for row in inputs:
        pieces = [model(row[None, s:e])[0] for s, e in split_documents(row.tolist())]
        rows.append(torch.cat(pieces))
    return torch.stack(rows)


@pytest.fixture(scope="module")
def references(documents_file):
    models = {
        repr(b.raw()["model"]): b.raw()["model"]
        for b in {**matrix.CASES_2, **matrix.CASES_8}.values()
    }
    return {
        key: mt_workers.reference(
            masked(JobBuilder.cpu_run().model(m), documents_file).raw(),
            STEPS,
            forward=per_document_logits,
        )
        for key, m in models.items()
    }


def _run(table: dict, world: int, path: str) -> dict:
    return matrix._run({name: masked(b, path) for name, b in table.items()}, world)


@pytest.mark.parametrize("model", [TINY, LLAMA_TINY], ids=["gpt", "llama"])
def test_masked_logits_equal_each_document_run_alone(model, documents_file):
    """The dense model: logits of the masked window equal those of its documents run alone."""
    job = loading.parse_spec(masked(JobBuilder.cpu_run().model(model), documents_file).raw())
    config = gpt.GPTConfig.from_shape(job.model.shape())
    files = dataset.open_dataset(job.training, vocab=config.vocab, seq_len=config.seq_len)
    batch = mt_workers.whole_batches(files, job, 7).global_batch_at(0)[:, :-1]
    assert any(len(split_documents(r)) > 2 for r in batch.tolist())  # windows really hold several
    model_ = llama.build(config, seed=3)
    packed = model_(batch, documents=documents.of_tokens(batch, EOS))
    unmasked = model_(batch)
    alone = per_document_logits(model_, batch)
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=4e-5)
    assert not torch.allclose(unmasked, alone, rtol=1e-3, atol=1e-3)  # the mask changes something


@pytest.mark.slow
def test_one_device_masked_run_equals_the_per_document_reference(documents_file, references):
    one = {
        "one-device": JobBuilder.cpu_run(),
        "llama-one-device": JobBuilder.cpu_run().model(LLAMA_TINY),
    }
    result = _run(one, 1, documents_file)
    for name, builder in one.items():
        matrix._compare(result[name], references[repr(builder.raw()["model"])])


@pytest.mark.slow
@pytest.mark.parametrize("case", list(matrix.CASES_2))
def test_two_rank_masked_layouts_equal_the_per_document_reference(case, world2, references):
    matrix._compare(world2[case], matrix._reference_of(matrix.CASES_2, case, references))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(matrix.CASES_8))
def test_dp2_pp2_tp2_masked_layouts_equal_the_per_document_reference(case, world8, references):
    matrix._compare(world8[case], matrix._reference_of(matrix.CASES_8, case, references))


@pytest.fixture(scope="module")
def world2(documents_file):
    return _run(matrix.CASES_2, 2, documents_file)


@pytest.fixture(scope="module")
def world8(documents_file):
    return _run(matrix.CASES_8, 8, documents_file)


def _mfu_steps(raw: dict) -> list[dict]:
    """Two steps on one rank with the telemetry recorder: each step's model FLOPs, MFU and seconds."""
    job = loading.parse_spec(raw)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    layout = job.parallelism.layout
    recorder = recorder_mod.make_recorder(job, layout, dist.get_rank(), None, serve=False)
    eng = engine.Engine(job, mesh, recorder=recorder)
    out = []
    for _ in range(2):
        eng.train_step()
        stats = recorder.last
        out.append({"flops": stats.model_flops, "mfu": stats.mfu, "seconds": stats.seconds})
    recorder.close()
    return out


MFU_LAYOUTS = {
    "dp2": JobBuilder.cpu_run().layout(data=2),
    "tp2": JobBuilder.cpu_run().layout(tensor=2),
    "pp2": JobBuilder.cpu_run().layout(pipeline=2).parallelism(schedule="1f1b", microBatches=2),
}
"""Each rank adds 1 / (tensor x pipeline) of its replica's squares: every divisor exercised."""


@pytest.mark.parametrize("layout", list(MFU_LAYOUTS))
def test_mfu_counts_each_documents_attention_square(layout, documents_file):
    """model FLOPs = 6 N tokens + 12 L H sum(d^2) over the documents the batch really holds."""
    builder = masked(MFU_LAYOUTS[layout], documents_file)
    raw = builder.metrics(peakFlops=1e12).raw()
    ranks = mt_harness.run_distributed(_mfu_steps, 2, raw)
    job = loading.parse_spec(raw)
    config = gpt.GPTConfig.from_shape(job.model.shape())
    files = dataset.open_dataset(job.training, vocab=config.vocab, seq_len=config.seq_len)
    sampler = mt_workers.whole_batches(files, job, job.training.seed)
    n = gpt.dense_param_count(config, include_embeddings=False)
    for step in range(2):
        inputs = sampler.global_batch_at(step)[:, :-1].tolist()
        squares = sum((e - s) ** 2 for row in inputs for s, e in split_documents(row))
        assert squares < len(inputs) * config.seq_len**2  # fewer than one document per window
        expected = (
            6 * n * len(inputs) * config.seq_len + 12 * config.layers * config.hidden * squares
        )
        for rank in ranks:
            got = rank[step]
            assert got["flops"] == pytest.approx(expected, rel=1e-12)
            assert got["mfu"] == pytest.approx(expected / (got["seconds"] * 2 * 1e12), rel=1e-9)


@pytest.mark.parametrize("model", [TINY, LLAMA_TINY], ids=["gpt", "llama"])
def test_compiled_blocks_take_the_mask_in_one_graph(model):
    """``training.compile`` compiles each block's forward: the documents ride in as inputs of one
    full graph (no recompilation per batch) and give eager's logits and gradients."""
    job = loading.parse_spec(JobBuilder.cpu_run().model(model).raw())
    config = gpt.GPTConfig.from_shape(job.model.shape())
    eager, compiled = llama.build(config, seed=3), llama.build(config, seed=3)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for block in compiled.blocks.values():
        block.forward = torch.compile(block.forward, backend="aot_eager", fullgraph=True)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):  # three batches, three different masks
        tokens = torch.randint(0, 8, (2, config.seq_len), generator=generator)  # ids 0: ends
        docs = documents.of_tokens(tokens, EOS)
        want, got = eager(tokens, documents=docs), compiled(tokens, documents=docs)
        want.sum().backward()
        got.sum().backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for (name, p), q in zip(eager.named_parameters(), compiled.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


@pytest.mark.slow
def test_a_masked_epoch_run_resumes_exactly_on_two_stages(tmp_path, corpus_cache):
    """pp2 (each stage rebuilds the masks), epochs over a file of 19 windows (the third
    step's batch crosses into the second epoch): restored at step 2 from its checkpoint, the
    run continues with the uninterrupted run's losses, bit for bit."""
    path = write_documents(tmp_path, 600)
    raw = (
        JobBuilder.cpu_run()
        .layout(pipeline=2)
        .parallelism(schedule="1f1b", microBatches=2)
        .training(dataset=path, documentMask=True, sampling="epochs", steps=resume.STEPS)
        .raw()
    )
    for result in mt_harness.run_distributed(resume.resume_case, 2, raw, str(tmp_path / "ckpt")):
        assert result["restored"] == resume.SAVE_AT
        assert result["resumed"] == result["uninterrupted"][resume.SAVE_AT :]
