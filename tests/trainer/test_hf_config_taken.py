"""``config.json`` states what the spec leaves out (issue 33, item 6).

A Llama directory saved by transformers with an ``rms_norm_eps``, a RoPE base, grouped-query
heads, an MLP width, tied embeddings and Llama 3.1 RoPE scaling that the spec does not state:
the job takes each from the file and gives transformers' logits (the peer, 1e-5); a value the
spec states and the file contradicts is refused naming both, before any process starts; so is a
value a named preset states (the file does not override it), naming the preset.

Tier: ``make test`` (trainer).
"""

from __future__ import annotations

import mt_harness
import pytest
import torch
import transformers
from test_hf_interop import LLAMA3_SCALING, _config, _meshtrain_from

from meshtrain.api import loading
from meshtrain.trainer import launch
from meshtrain.trainer.interop import config_json, from_hf
from meshtrain.trainer.models import gpt
from tests.builders import JobBuilder

STATED = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32}
"""What the spec states: the shape every spec needs; the rest is left to config.json."""
FILE = {
    "num_key_value_heads": 2,
    "intermediate_size": 160,
    "rms_norm_eps": 1e-6,
    "rope_theta": 250000.0,
    "tie_word_embeddings": True,
}
"""What only the file says: every value away from meshtrain's defaults."""


def _directory(tmp_path, **extra) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    fields = {
        "vocab_size": 256,
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 64,
    }
    peer = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields, **FILE, **extra))
    peer.save_pretrained(tmp_path)
    return peer.eval()


def _job(tmp_path, **model):
    raw = JobBuilder.cpu_run().model({**STATED, **model, "init": {"fromHF": str(tmp_path)}}).raw()
    return loading.parse_spec(raw)


def test_fields_the_spec_leaves_out_are_config_jsons_and_give_transformers_logits(tmp_path):
    peer = _directory(tmp_path)
    job = from_hf.check_spec(_job(tmp_path))
    shape = job.model.shape()
    assert (shape.kv_heads, shape.ffn_hidden, shape.norm_eps) == (2, 160, 1e-6)
    assert (shape.rope_theta, shape.tie_embeddings) == (250000.0, True)
    config = gpt.GPTConfig.from_shape(shape)
    ours = _meshtrain_from(tmp_path, config)
    tokens = torch.randint(0, 256, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens).logits, rtol=1e-5, atol=1e-5)


def test_llama3_rope_scaling_left_out_of_the_spec_is_taken(tmp_path):
    scaling = {"rope_type": "llama3", **LLAMA3_SCALING}
    peer = _directory(tmp_path, rope_scaling=scaling)
    job = from_hf.check_spec(_job(tmp_path))
    assert job.model.shape().rope_scaling is not None
    assert job.model.shape().rope_scaling.factor == LLAMA3_SCALING["factor"]
    ours = _meshtrain_from(tmp_path, gpt.GPTConfig.from_shape(job.model.shape()))
    tokens = torch.randint(0, 256, (1, 32))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens).logits, rtol=1e-5, atol=1e-5)


def test_a_stated_value_the_file_contradicts_is_refused_naming_both(tmp_path, capsys):
    _directory(tmp_path)
    raw = (
        JobBuilder.cpu_run()
        .model({**STATED, "normEps": 1e-5, "init": {"fromHF": str(tmp_path)}})
        .raw()
    )
    code = launch.run_local(mt_harness.write_job(tmp_path, raw), log_dir=tmp_path / "logs")
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "logs").exists()
    assert "config.json: rms_norm_eps=1e-06 but spec.model.normEps=1e-05" in err
    assert "leave it out to take config.json's" in err


def test_a_job_without_fromhf_is_unchanged():
    job = loading.parse_spec(JobBuilder.cpu_run().model(STATED).raw())
    assert from_hf.check_spec(job) is job


def test_meshtrain_run_of_a_spec_silent_on_what_the_file_states_trains(tmp_path):
    """Refused before (rms_norm_eps differs from the spec's default normEps): now it trains."""
    _directory(tmp_path)
    assert _config(STATED).norm_eps != FILE["rms_norm_eps"]  # the spec's own default differs
    raw = (
        JobBuilder.cpu_run()
        .model({**STATED, "init": {"fromHF": str(tmp_path)}})
        .training(steps=1)
        .raw()
    )
    code = launch.run_local(mt_harness.write_job(tmp_path, raw), log_dir=tmp_path / "logs")
    assert code == 0


def test_a_presets_value_the_file_contradicts_is_refused_naming_the_preset(tmp_path):
    _directory(tmp_path)  # 2 layers, ffn 160, where llama-tiny says 4 and 192
    preset = {"preset": "llama-tiny", "init": {"fromHF": str(tmp_path)}}
    raw = JobBuilder.cpu_run().model(preset).raw()
    with pytest.raises(config_json.HFError) as refused:
        from_hf.check_spec(loading.parse_spec(raw))
    assert "intermediate_size=160 but spec.model.ffnHidden=192" in str(refused.value)
    assert "spec.model.preset=llama-tiny" in str(refused.value)

    raw = JobBuilder.cpu_run().model({**preset, "layers": 2, "ffnHidden": 160}).raw()
    shape = from_hf.check_spec(loading.parse_spec(raw)).model.shape()
    assert (shape.layers, shape.ffn_hidden, shape.norm_eps, shape.tie_embeddings) == (
        2,
        160,
        FILE["rms_norm_eps"],
        True,
    )  # what the preset leaves out is the file's
