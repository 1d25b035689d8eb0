"""Under ZeRO-3 each data-parallel rank reads only its FSDP2 shard's rows of a Hugging Face directory.

Two gloo ranks build the engine of a dp2 ``zeroStage: 3`` job whose model starts from a Llama
directory saved by transformers.  On every rank, every read of the directory is counted: no
tensor is read whole (the whole-tensor read is never asked for), the rows a rank reads are the
rows its DTensor shard holds, the two ranks' reads together are each tensor once, and the shards
gathered back are bit for bit the tensors transformers saved (read here with safetensors).
The first-step loss against transformers' is test_hf_interop.py's ``dp2-zero3`` case.

Tier: ``make test`` (trainer, slow).
"""

from __future__ import annotations

import math

import mt_harness
import pytest
import torch
from safetensors.torch import load_file
from test_hf_interop import LLAMA, _config, _hf_model

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
            "rows": zero3.shard_rows(param),
            "shape": tuple(param.shape),
            "whole": param.full_tensor().detach().clone(),
        }
    return {"rows_read": rows_read, "whole": whole, "params": params}


@pytest.mark.slow
def test_each_zero3_rank_reads_only_its_shards_rows_and_they_are_the_saved_tensors(tmp_path):
    config = _config(LLAMA)
    _hf_model(config).save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    raw = (
        JobBuilder.cpu_run()
        .model(LLAMA, init={"fromHF": str(tmp_path)})
        .layout(data=2)
        .parallelism(zeroStage=3)
        .raw()
    )
    ranks = mt_harness.run_distributed(_build_counting_reads, 2, raw)

    assert all(not r["whole"] for r in ranks)
    numel = {key: tensor.numel() for key, tensor in saved.items()}
    total_read = {key: sum(r["rows_read"].get(key, 0) for r in ranks) for key in saved}
    # every tensor the model maps is read, once over the two ranks together
    mapped = {p.key for name in ranks[0]["params"] for p in name_map.hf_parts(config, name)}
    assert mapped and all(total_read[key] == numel[key] for key in mapped), {
        k: (total_read[k], numel[k]) for k in mapped if total_read[k] != numel[k]
    }
    for rank, result in enumerate(ranks):
        held = 0
        for name, param in result["params"].items():
            start, stop = param["rows"]
            held += (stop - start) * math.prod(param["shape"][1:])
            whole = torch.cat(
                [
                    saved[p.key].t() if p.transpose else saved[p.key]
                    for p in name_map.hf_parts(config, name)
                ],
                dim=0,
            ).float()
            assert torch.equal(param["whole"], whole.reshape(param["shape"])), (rank, name)
        # a rank reads what its shards hold: about half the model, not all of it
        assert sum(result["rows_read"].values()) == held, rank
        assert held < 0.6 * sum(numel[key] for key in mapped), rank
