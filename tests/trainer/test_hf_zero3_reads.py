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

import mt_harness
import pytest
import torch
from safetensors.torch import load_file
from test_hf_interop import LLAMA, TINY, _config, _hf_model

from meshtrain.api import loading
from meshtrain.trainer import engine
from meshtrain.trainer.interop import from_hf, name_map
from meshtrain.trainer.parallel import mesh as mesh_mod
from meshtrain.trainer.parallel import zero3
from tests.builders import JobBuilder


def _build_counting_reads(raw: dict) -> dict:
    """On each rank: the elements read per Hugging Face key, the tensors read whole, and each
    parameter's shard rows and gathered value."""
    rows_read: dict[str, int] = {}
    whole: list[str] = []
    sliced, whole_read = from_hf.HFWeights._slice, from_hf.HFWeights.__call__

    def counting_slice(self, part, dim, start, stop):
        tensor = sliced(self, part, dim, start, stop)
        rows_read[part.key] = rows_read.get(part.key, 0) + tensor.numel()
        return tensor

    def counting_whole(self, name, shape):
        whole.append(name)
        return whole_read(self, name, shape)

    from_hf.HFWeights._slice = counting_slice  # type: ignore[method-assign]
    from_hf.HFWeights.__call__ = counting_whole  # type: ignore[method-assign]
    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    params = {}
    for name, param in eng.model.named:
        params[name] = {
            "local": zero3.local(param).detach().clone(),
            "shape": tuple(param.shape),
            "whole": param.full_tensor().detach().clone(),
        }
    return {"rows_read": rows_read, "whole": whole, "params": params}


MODELS = {
    "llama-dp2": (LLAMA, 2),
    "llama-tied-vocab255-dp2": ({**LLAMA, "tieEmbeddings": True, "vocab": 255}, 2),
    "gpt2-conv1d-dp3": (TINY, 3),
}


@pytest.mark.slow
@pytest.mark.parametrize("model,world", list(MODELS.values()), ids=list(MODELS))
def test_each_zero3_rank_reads_only_its_shards_rows_and_they_are_the_saved_tensors(
    model, world, tmp_path
):
    config = _config(model)
    _hf_model(config).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    raw = (
        JobBuilder.cpu_run()
        .model(model, init={"fromHF": str(tmp_path)})
        .layout(data=world)
        .parallelism(zeroStage=3)
        .training(globalBatch=world * 2)
        .raw()
    )
    ranks = mt_harness.run_distributed(_build_counting_reads, world, raw)

    assert all(not r["whole"] for r in ranks)
    mapped = {p.key for name in ranks[0]["params"] for p in name_map.hf_parts(config, name)}
    total_read = {key: sum(r["rows_read"].get(key, 0) for r in ranks) for key in mapped}
    # every tensor the model maps is read once over the ranks together
    assert mapped and all(total_read[key] == saved[key].numel() for key in mapped), {
        k: (total_read[k], saved[k].numel()) for k in mapped if total_read[k] != saved[k].numel()
    }
    uneven = False
    for rank, result in enumerate(ranks):
        for name, param in result["params"].items():
            rows = param["shape"][0]
            chunks = torch.chunk(torch.arange(rows), world)
            expected_rows = len(chunks[rank]) if rank < len(chunks) else 0
            assert param["local"].shape[0] == expected_rows, (rank, name)
            uneven |= expected_rows != rows // world
            whole = torch.cat(
                [
                    saved[p.key].t() if p.transpose else saved[p.key]
                    for p in name_map.hf_parts(config, name)
                ],
                dim=0,
            ).float()
            assert torch.equal(param["whole"], whole.reshape(param["shape"])), (rank, name)
        # a rank reads what its shards hold, and no more
        held = sum(param["local"].numel() for param in result["params"].values())
        assert sum(result["rows_read"].values()) == held, rank
    if model is not LLAMA:  # the cases chosen for FSDP2's padding exercise it
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


@pytest.mark.slow
def test_from_the_seed_the_shards_built_on_meta_equal_those_of_the_whole_model() -> None:
    tied = {**LLAMA, "tieEmbeddings": True, "vocab": 255}
    raw = JobBuilder.cpu_run().model(tied).layout(data=2).parallelism(zeroStage=3).raw()
    assert mt_harness.run_distributed(_shards_both_ways, 2, raw) == [True, True]
