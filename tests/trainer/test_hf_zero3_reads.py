"""Under ZeRO-3 each data-parallel rank reads only its FSDP2 shard's rows of a Hugging Face directory.

Gloo ranks build the engine of a ``zeroStage: 3`` job whose model starts from a directory saved
by transformers: a Llama at dp2, a tied Llama whose vocabulary (255) leaves FSDP2 uneven shards,
and GPT-2 (Conv1D tensors stored transposed) at dp3, where some tensors leave a rank no rows.
On every rank every read of the directory is counted: no tensor is read whole, each parameter's
local shard has the rows ``torch.chunk`` gives that rank, the rank reads exactly the elements its
shards hold, the ranks together read each tensor once, and the shards gathered back are bit for
bit the tensors transformers saved (read here with safetensors).  The first-step loss against
transformers' is test_hf_interop.py's ``dp2-zero3`` case.  From the seed, the shards built on
``meta`` equal bit for bit those of the path that makes every parameter whole first.

Tier: ``make test`` (trainer, slow).
"""

from __future__ import annotations

import dataclasses

import mt_harness
import pytest
import torch
from safetensors.torch import load_file
from test_hf_interop import LLAMA, TINY, _config, _hf_model

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.interop import from_hf, name_map
from meshtrain.trainer.parallel import float8, tensor, zero3
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import LLAMA_TINY, JobBuilder


def _build_counting_reads(raw: dict) -> dict:
    """On each rank: the elements read per Hugging Face key, the tensors read whole, and each
    parameter's shard rows and gathered value."""
    rows_read: dict[str, int] = {}
    whole: list[str] = []
    block, whole_read = from_hf.HFWeights._block, from_hf.HFWeights.__call__

    def counting_block(self, part, rows=None, columns=None):
        tensor = block(self, part, rows, columns)
        rows_read[part.key] = rows_read.get(part.key, 0) + tensor.numel()
        return tensor

    def counting_whole(self, name, shape):
        whole.append(name)
        return whole_read(self, name, shape)

    from_hf.HFWeights._block = counting_block  # type: ignore[method-assign]
    from_hf.HFWeights.__call__ = counting_whole  # type: ignore[method-assign]
    job = loading.parse_spec(raw)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    eng = engine.Engine(job, mesh)
    plan = eng.model.tp_plan
    params = {}
    for name, param in eng.model.named:
        params[name] = {
            "local": zero3.local(param).detach().clone(),
            "shape": tuple(param.shape),
            "whole": param.full_tensor().detach().clone(),
            "spec": plan.shards.get(name) if plan is not None else None,
        }
    coords = {"dp": mesh.coords.dp, "tp": mesh.coords.tp}
    return {"rows_read": rows_read, "whole": whole, "params": params, "coords": coords}


MODELS = {
    "llama-dp2": (LLAMA, 2, 1),
    "llama-tied-vocab255-dp2": ({**LLAMA, "tieEmbeddings": True, "vocab": 255}, 2, 1),
    "gpt2-conv1d-dp3": (TINY, 3, 1),
    "llama-mqa-vocab257-dp2-tp2": ({**LLAMA, "kvHeads": 1, "vocab": 257}, 2, 2),
}
"""Model, data-parallel and tensor-parallel size: FSDP2's padding (vocabularies that do not split
evenly, a rank left no rows at dp3), GPT-2's transposed tensors, and tensor-parallel pieces
(a key/value head replicated over tp2, a vocabulary padded to 384 rows over it, so one rank's
piece is mostly zero rows that are never read) sharded again by FSDP2."""


@pytest.mark.slow
@pytest.mark.parametrize("model,data,tensor_size", list(MODELS.values()), ids=list(MODELS))
def test_each_zero3_rank_reads_only_its_shards_rows_and_they_are_the_saved_tensors(
    model, data, tensor_size, tmp_path
):
    config = _config(model)
    _hf_model(config).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    raw = (
        JobBuilder.cpu_run()
        .model(model, init={"fromHF": str(tmp_path)})
        .layout(data=data, tensor=tensor_size)
        .parallelism(zeroStage=3)
        .training(globalBatch=data * 2)
        .raw()
    )
    ranks = mt_harness.run_distributed(_build_counting_reads, data * tensor_size, raw)

    assert all(not r["whole"] for r in ranks)
    mapped = {p.key for name in ranks[0]["params"] for p in name_map.hf_parts(config, name)}
    if tensor_size == 1:  # every tensor the model maps is read once over the ranks together
        total = {key: sum(r["rows_read"].get(key, 0) for r in ranks) for key in mapped}
        assert mapped and all(total[key] == saved[key].numel() for key in mapped), {
            k: (total[k], saved[k].numel()) for k in mapped if total[k] != saved[k].numel()
        }
    uneven = False
    for result in ranks:
        dp, tp = result["coords"]["dp"], result["coords"]["tp"]
        stored = 0  # elements of this rank's shards that come from the directory (not padding)
        for name, param in result["params"].items():
            dense = torch.cat(
                [
                    saved[p.key].t() if p.transpose else saved[p.key]
                    for p in name_map.hf_parts(config, name)
                ],
                dim=0,
            ).float()
            spec = param["spec"]
            if spec is None:
                piece, marks = dense.reshape(param["shape"]), torch.ones(param["shape"])
            else:  # this tensor-parallel rank's piece, as the reference cut makes it
                piece = tensor.shard(dense, spec, tp, tensor_size)
                marks = tensor.shard(torch.ones_like(dense), spec, tp, tensor_size)
            rows = torch.chunk(torch.arange(piece.shape[0]), data)
            window = rows[dp] if dp < len(rows) else torch.arange(0)
            uneven |= len(window) != piece.shape[0] // data
            assert torch.equal(param["local"], piece[window]), (dp, tp, name)
            assert torch.equal(param["whole"], piece), (dp, tp, name)
            stored += int(marks[window].sum())
        # a rank reads what its shards hold, and no more
        assert sum(result["rows_read"].values()) == stored, (dp, tp)
    if model is not LLAMA and tensor_size == 1:  # the cases chosen for FSDP2's padding exercise it
        assert uneven


def _shards_both_ways(raw: dict) -> bool:
    """On each rank: whether every local shard built on meta equals, bit for bit, the one the
    materialise-then-shard path (every parameter made whole first) gives."""
    job = loading.parse_spec(raw)
    mesh = mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu"))
    on_meta = {n: zero3.local(p).detach().clone() for n, p in engine.Engine(job, mesh).model.named}
    zero3.shards_on_meta = lambda chunks: False  # this process only: the old path
    whole_first = {n: zero3.local(p).detach() for n, p in engine.Engine(job, mesh).model.named}
    return on_meta.keys() == whole_first.keys() and all(
        torch.equal(on_meta[n], whole_first[n]) for n in on_meta
    )


SEEDED = {
    "llama-tied-vocab255-dp2": ({**LLAMA, "tieEmbeddings": True, "vocab": 255}, {"data": 2}, {}),
    "gpt2-dp2-tp2-sequence-parallel": (TINY, {"data": 2, "tensor": 2}, {"sequenceParallel": True}),
    "llama-mqa-dp2-tp2": ({**LLAMA, "kvHeads": 1}, {"data": 2, "tensor": 2}, {}),
}
"""Uneven FSDP2 shards; GPT-2's position table under sequence parallelism; a replicated key/value head."""


@pytest.mark.slow
@pytest.mark.parametrize("model,layout,parallelism", list(SEEDED.values()), ids=list(SEEDED))
def test_from_the_seed_the_shards_built_on_meta_equal_those_of_the_whole_model(
    model, layout, parallelism
) -> None:
    run = JobBuilder.cpu_run().model(model).layout(**layout)
    raw = run.parallelism(zeroStage=3, **parallelism).training(globalBatch=4).raw()
    world = layout["data"] * layout.get("tensor", 1)
    assert mt_harness.run_distributed(_shards_both_ways, world, raw) == [True] * world


def _shards_both_ways_in_emulated_fp8(raw: dict) -> bool:
    """:func:`_shards_both_ways` with ``training.float8`` let through on this CPU rank (torchao
    emulating, as test_float8_layouts.py does): torchao's swap runs on ``meta`` too."""
    float8.device_problem = lambda device: None
    config_for = float8.config_for
    float8.config_for = lambda spec: dataclasses.replace(config_for(spec), emulate=True)
    return _shards_both_ways(raw)


@pytest.mark.slow
def test_with_float8_linears_the_shards_built_on_meta_equal_those_of_the_whole_model() -> None:
    pytest.importorskip("torchao.float8")
    run = JobBuilder.cpu_run().model(LLAMA_TINY).layout(data=2)
    raw = run.training(precision="bf16", float8={}).parallelism(zeroStage=3).raw()
    assert mt_harness.run_distributed(_shards_both_ways_in_emulated_fp8, 2, raw) == [True, True]
