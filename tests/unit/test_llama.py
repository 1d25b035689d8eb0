"""The Llama decoder's shape accounting against transformers' LlamaForCausalLM (the peer implementation)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from meshtrain.api import loading
from meshtrain.api.spec import model as api_model
from meshtrain.planner import parameters
from meshtrain.trainer.interop import config_json
from meshtrain.trainer.models import gpt, llama
from tests.builders import JobBuilder


def _hf_count(shape: api_model.ModelShape) -> int:
    config = transformers.LlamaConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.ffn_hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.key_value_heads,
        tie_word_embeddings=shape.tie_embeddings,
    )
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "model",
    [
        {"preset": "llama3-8b"},
        {"preset": "llama3-70b"},
        {"preset": "llama-tiny"},
        {"preset": "llama-tiny", "tieEmbeddings": True},
    ],
    ids=["8b", "70b", "tiny", "tiny-tied"],
)
def test_parameter_count_equals_transformers(model):
    shape = api_model.ModelSpec.model_validate(model).shape()
    expected = _hf_count(shape)
    config = gpt.GPTConfig.from_shape(shape)
    assert gpt.dense_param_count(config) == expected
    assert parameters.total_params(shape) == expected
    with torch.device("meta"):
        built = llama.build(config)
    assert built.num_params() == expected


def test_llama3_8b_is_eight_billion_and_tp8_splits_kv_heads():
    shape = api_model.ModelSpec(preset="llama3-8b").shape()
    assert 8.0e9 < parameters.total_params(shape) < 8.1e9
    job = loading.parse_spec(JobBuilder().model(preset="llama3-8b").layout(tensor=8).raw())
    assert job.model.shape().key_value_heads // job.parallelism.tensor == 1


def test_kv_heads_and_tensor_that_do_not_divide_one_another_are_refused_naming_the_fix():
    replicated = {"preset": "llama-tiny"}  # 2 kv heads over 4 ranks: each held by 2
    loading.parse_spec(JobBuilder().model(replicated).layout(tensor=4).raw())
    odd = {"preset": "llama-tiny", "heads": 12, "hidden": 96, "kvHeads": 6, "vocab": 264}
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(JobBuilder().model(odd).layout(tensor=4).raw())
    assert "spec.model.kvHeads: kvHeads=6 and tensor=4" in str(err.value)


def test_tied_embeddings_share_one_parameter_after_meta_materialisation():
    config = gpt.GPTConfig.from_shape(
        api_model.ModelSpec(preset="llama-tiny", tieEmbeddings=True).shape()
    )
    with torch.device("meta"):
        model = llama.build(config, seed=3)
    gpt.materialize(model)
    assert model.head.weight is model.tok_emb.weight
    eager = llama.build(config, seed=3)
    assert torch.equal(model(torch.arange(8)[None]), eager(torch.arange(8)[None]))


def test_embeddings_tied_across_stages_are_accepted_except_under_zero2():
    def job(zero_stage: int) -> dict:
        return (
            JobBuilder()
            .model(preset="llama-tiny", tieEmbeddings=True)
            .layout(pipeline=2, data=2)
            .parallelism(zeroStage=zero_stage)
            .raw()
        )

    assert loading.parse_spec(job(1)).model.shape().tie_embeddings
    with pytest.raises(loading.SpecError) as err:
        loading.parse_spec(job(2))
    assert "spec.model.tieEmbeddings: tieEmbeddings with pipeline=2" in str(err.value)
    assert "use zeroStage 0 or 1" in str(err.value)


LLAMA_3_2_1B_CONFIG = {
    # meta-llama/Llama-3.2-1B's config.json as published on the Hugging Face Hub
    "architectures": ["LlamaForCausalLM"],
    "attention_bias": False,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "max_position_embeddings": 131072,
    "mlp_bias": False,
    "model_type": "llama",
    "num_attention_heads": 32,
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "pretraining_tp": 1,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 32.0,
        "high_freq_factor": 4.0,
        "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
    "vocab_size": 128256,
}


def test_llama3_2_1b_preset_is_metas_published_model(tmp_path):
    """The preset passes the fromHF shape check against Meta's config.json, and counts its parameters."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_2_1B_CONFIG))
    shape = api_model.ModelSpec(preset="llama3.2-1b").shape()
    config = gpt.GPTConfig.from_shape(shape)
    config_json.check_config(tmp_path, config)  # raises naming the first field that differs
    with torch.device("meta"):
        published = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA_3_2_1B_CONFIG))
        built = llama.build(config)
    expected = sum(p.numel() for p in published.parameters())
    assert gpt.dense_param_count(config) == parameters.total_params(shape) == expected
    assert built.num_params() == expected
