"""Hugging Face interop against transformers, the peer implementation.

* import: a tiny random ``LlamaForCausalLM`` / ``GPT2LMHeadModel`` built here
  from a config and saved with ``save_pretrained`` gives transformers' logits
  when meshtrain builds its model from the directory (fp32, 1e-5), and the
  first-step loss of tp2, pp2 and dp2 runs started from it (``model.init.fromHF``)
  equals transformers' loss on the same global batch;
* export: a checkpoint meshtrain trained (tp2 wrote it; also with one key/value
  head, which tp2 replicates) exported with
  ``meshtrain export`` loads in transformers and gives meshtrain's logits;
* bad input: a directory whose config or tensors disagree with the spec is
  refused before any process starts, naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mt_harness
import mt_workers
import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtrain.api import loading
from meshtrain.api.spec import model as api_model
from meshtrain.cli import main
from meshtrain.trainer import engine, launch
from meshtrain.trainer.checkpointing import checkpointer
from meshtrain.trainer.data import dataset, special_tokens, token_files
from meshtrain.trainer.interop import config_json, export, from_hf, name_map, to_hf
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.parallel import mesh as mesh_mod
from tests.builders import LLAMA_TINY, TINY, JobBuilder

LLAMA = {**LLAMA_TINY, "ropeTheta": 500000.0}


def _config(model: dict) -> gpt.GPTConfig:
    return gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate(model).shape())


def _llama_style_fields(config: gpt.GPTConfig) -> dict[str, Any]:
    """transformers config fields of a Llama-architecture model (Llama, Mistral) of ``config``'s shape."""
    return {
        "vocab_size": config.vocab,
        "hidden_size": config.hidden,
        "intermediate_size": config.ffn_hidden,
        "num_hidden_layers": config.layers,
        "num_attention_heads": config.heads,
        "num_key_value_heads": config.key_value_heads,
        "max_position_embeddings": config.seq_len,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
    }


def _with_random_norms(model: transformers.PreTrainedModel) -> transformers.PreTrainedModel:
    """Random norm weights, so a swapped norm would show; in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _hf_model(config: gpt.GPTConfig, **llama_extra: Any) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    if config.family == "llama":
        hf_config = transformers.LlamaConfig(**_llama_style_fields(config), **llama_extra)
        return _with_random_norms(transformers.LlamaForCausalLM(hf_config))
    hf_config = transformers.GPT2Config(
        vocab_size=config.vocab,
        n_embd=config.hidden,
        n_inner=config.ffn_hidden,
        n_layer=config.layers,
        n_head=config.heads,
        n_positions=config.seq_len,
        activation_function="gelu",
        tie_word_embeddings=False,
    )
    model = transformers.GPT2LMHeadModel(hf_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("ln_1.bias") or name.endswith("ln_f.weight"):
                p.uniform_(-0.5, 0.5)  # LayerNorm biases carry over; linear biases must be 0
    return model.eval()


def _meshtrain_from(directory: Path, config: gpt.GPTConfig) -> gpt.GPT:
    from_hf.check_directory(directory, config)
    with torch.device("meta"):
        model = llama.build(config)
    model.initial_weights = from_hf.HFWeights(directory, config)
    gpt.materialize(model)
    return model.eval()


@pytest.mark.parametrize("model", [LLAMA, TINY], ids=["llama", "gpt2"])
def test_imported_model_gives_transformers_logits(model, tmp_path):
    config = _config(model)
    peer = _hf_model(config)
    peer.save_pretrained(tmp_path)
    ours = _meshtrain_from(tmp_path, config)
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", [LLAMA, {**LLAMA, "kvHeads": 4}], ids=["gqa", "mha"])
def test_imported_llama_gives_transformers_gradients(model, tmp_path):
    """Backward too: the rotary and RMSNorm autograd functions that keep less for backward."""
    config = _config(model)
    peer = _hf_model(config)
    peer.save_pretrained(tmp_path)
    ours = _meshtrain_from(tmp_path, config)
    tokens = torch.randint(0, config.vocab, (2, config.seq_len + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:].reshape(-1)
    F.cross_entropy(ours(inputs).reshape(-1, config.vocab), targets).backward()
    F.cross_entropy(peer(inputs).logits.reshape(-1, config.vocab), targets).backward()
    grads = name_map.to_hf(config, {n: p.grad for n, p in ours.named_parameters()})
    peer_grads = dict(peer.named_parameters())
    assert set(grads) == set(peer_grads)
    for key, grad in grads.items():
        torch.testing.assert_close(grad, peer_grads[key].grad, rtol=1e-4, atol=1e-6, msg=key)


@pytest.mark.slow
def test_every_layout_starts_from_the_directory(tmp_path):
    config = _config(LLAMA)
    peer = _hf_model(config)
    peer.save_pretrained(tmp_path)
    imported = JobBuilder.cpu_run().model(LLAMA, init={"fromHF": str(tmp_path)})
    cases = {
        "tp2-sp": imported.clone().layout(tensor=2).parallelism(sequenceParallel=True),
        "pp2": imported.clone().layout(pipeline=2).parallelism(microBatches=2),
        "dp2": imported.clone().layout(data=2),
        "dp2-zero3": imported.clone().layout(data=2).parallelism(zeroStage=3),
    }
    specs = [(name, run.raw()) for name, run in cases.items()]
    results = mt_harness.run_distributed(mt_workers.train_cases, 2, specs, 1)
    job = loading.parse_spec(specs[0][1])
    files = dataset.open_dataset(job.training, vocab=config.vocab, seq_len=config.seq_len)
    sampler = mt_workers.whole_batches(files, job, seed=7)
    batch = sampler.global_batch_at(0)
    with torch.no_grad():
        logits = peer(batch[:, :-1]).logits
    expected = F.cross_entropy(logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1)).item()
    for name, _ in specs:
        loss = results[0][name]["losses"][0]
        assert abs(loss - expected) / expected < 1e-5, (name, loss, expected)


def _train_and_save(raw: dict, root: str) -> dict:
    job = loading.parse_spec(raw)
    eng = engine.Engine(job, mesh_mod.build_mesh(job.parallelism.layout, torch.device("cpu")))
    for _ in range(3):
        eng.train_step()
    checkpointer.Checkpointer(eng, root=root).save()
    return {}


@pytest.mark.slow
@pytest.mark.parametrize(
    "model",
    [
        LLAMA,
        {**LLAMA, "tieEmbeddings": True},
        {**LLAMA, "kvHeads": 1},
        TINY,
        {**LLAMA, "vocab": 257},
    ],
    ids=[
        "llama",
        "llama-tied",
        "llama-mqa-replicated-over-tp2",
        "gpt2",
        "llama-vocab257-padded-on-tp2",
    ],
)
def test_exported_checkpoint_gives_meshtrain_logits_in_transformers(model, tmp_path):
    raw = JobBuilder.cpu_run().model(model).layout(tensor=2).training(steps=3).raw()
    mt_harness.run_distributed(_train_and_save, 2, raw, str(tmp_path / "ckpt"))
    out = tmp_path / "hf"
    assert main.main(["export", str(tmp_path / "ckpt"), "-o", str(out)]) == 0
    config = _config(model)
    auto = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(auto).__name__ == (
        "LlamaForCausalLM" if config.family == "llama" else "GPT2LMHeadModel"
    )
    ours = llama.build(config)  # meshtrain's model with the checkpoint's weights
    directory, _ = export.find_checkpoint(tmp_path / "ckpt")
    result = ours.load_state_dict(export.read_dense(directory), strict=False)
    assert result.missing_keys == (
        ["head.weight"] if config.tie_embeddings else []
    )  # the shared one
    assert not result.unexpected_keys
    if config.family == "llama":  # the spec's key/value heads, not one per tensor rank
        assert auto.config.num_key_value_heads == config.key_value_heads
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(auto(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)


def test_directory_disagreeing_with_the_spec_is_refused_naming_file_and_field(tmp_path, capsys):
    config = _config(LLAMA)
    _hf_model(config).save_pretrained(tmp_path / "hf")
    wrong = {**LLAMA, "kvHeads": 4, "init": {"fromHF": str(tmp_path / "hf")}}
    code = launch.run_local(
        mt_harness.write_job(tmp_path, JobBuilder.cpu_run().model(wrong).raw()),
        log_dir=tmp_path / "logs",
    )
    err = capsys.readouterr().err
    assert code == 2 and not (tmp_path / "logs").exists()
    assert "config.json: num_key_value_heads=2 but spec.model.kvHeads=4" in err
    assert "spec.model.init.fromHF" in err

    weights = tmp_path / "hf" / "model.safetensors"  # config agrees, one tensor does not
    tensors = load_file(weights)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(config.ffn_hidden + 8, config.hidden)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(config_json.HFError) as bad:
        from_hf.check_directory(tmp_path / "hf", config)
    assert str(weights) in str(bad.value)
    assert "model.layers.1.mlp.up_proj.weight has shape [104, 32]" in str(bad.value)

    config_path = tmp_path / "hf" / "config.json"  # Llama 3.1's scaled RoPE: refused, not ignored
    raw = json.loads(config_path.read_text())
    raw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    config_path.write_text(json.dumps(raw))
    with pytest.raises(config_json.HFError, match="config.json: rope_type='llama3'"):
        from_hf.check_directory(tmp_path / "hf", config)


def test_fields_a_config_leaves_out_are_judged_at_transformers_defaults(tmp_path):
    """A config.json without rope_theta / rms_norm_eps means what transformers makes of it, not a pass."""
    config = _config(LLAMA)  # ropeTheta 500000, normEps 1e-5: not transformers' defaults
    _hf_model(config).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    for key in ("rope_theta", "rope_parameters", "rope_scaling", "rms_norm_eps"):
        raw.pop(key, None)
    path.write_text(json.dumps(raw))
    peer = transformers.AutoConfig.from_pretrained(tmp_path)  # what transformers will run
    theta = (getattr(peer, "rope_parameters", None) or {}).get("rope_theta") or peer.rope_theta
    eps_only = {**LLAMA, "normEps": float(peer.rms_norm_eps)}  # ropeTheta still 500000
    with pytest.raises(config_json.HFError, match=f"rope_theta={float(theta)}"):
        config_json.check_config(tmp_path, _config(eps_only))
    theta_only = {**LLAMA, "ropeTheta": float(theta)}  # normEps still 1e-5
    with pytest.raises(config_json.HFError, match=f"rms_norm_eps={peer.rms_norm_eps!r}"):
        config_json.check_config(tmp_path, _config(theta_only))
    agreeing = {**LLAMA, "ropeTheta": float(theta), "normEps": float(peer.rms_norm_eps)}
    # the peer's effective values are accepted
    config_json.check_config(tmp_path, _config(agreeing))


@pytest.mark.parametrize(
    "extra", [{"attention_bias": True}, {"mlp_bias": True}, {"hidden_act": "gelu"}], ids=str
)
def test_llama_architecture_meshtrain_lacks_is_refused(extra, tmp_path):
    config = _config(LLAMA)
    _hf_model(config, **extra).save_pretrained(tmp_path)
    [(key, value)] = extra.items()
    with pytest.raises(config_json.HFError, match=f"config.json: {key}={value!r}"):
        from_hf.check_directory(tmp_path, config)


def test_tensor_the_spec_does_not_map_is_refused_naming_file_and_tensor(tmp_path):
    config = _config(LLAMA)
    _hf_model(config).save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    tensors = load_file(weights)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.ones(config.hidden)
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(config_json.HFError) as bad:
        from_hf.check_directory(tmp_path, config)
    assert f"{weights}: tensor model.layers.0.self_attn.q_proj.bias has no place" in str(bad.value)


def test_pretraining_tp_is_accepted_as_transformers_ignores_it(tmp_path):
    config = _config(LLAMA)
    peer = _hf_model(config, pretraining_tp=2)
    peer.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["pretraining_tp"] == 2
    ours = _meshtrain_from(tmp_path, config)
    tokens = torch.randint(0, config.vocab, (1, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), peer(tokens).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "scaling",
    [{"type": "linear", "factor": 4.0}, {"rope_type": "dynamic", "factor": 2.0}, {"factor": 4.0}],
    ids=str,
)
def test_scaled_rope_in_either_spelling_is_refused(scaling, tmp_path):
    """transformers < 4.45 wrote ``rope_scaling: {type: ...}``; that is no plain RoPE either."""
    config = _config(LLAMA)
    _hf_model(config).save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    raw = json.loads(path.read_text())
    raw["rope_scaling"] = scaling
    path.write_text(json.dumps(raw))
    with pytest.raises(config_json.HFError, match=r"config.json: rope_type="):
        from_hf.check_directory(tmp_path, config)


LLAMA3_SCALING = {  # one frequency kept, one blended, the rest slowed down (head_dim 16)
    "factor": 4.0,
    "low_freq_factor": 0.25,
    "high_freq_factor": 2.0,
    "original_max_position_embeddings": 16,
}


def test_llama3_scaled_rope_imports_and_exports_with_transformers_logits(tmp_path):
    """Llama 3.1's rope_type llama3, compared past original_max_position_embeddings (16 of 32)."""
    spec_scaling = {
        "factor": 4.0,
        "lowFreqFactor": 0.25,
        "highFreqFactor": 2.0,
        "originalMaxPositionEmbeddings": 16,
    }
    model = {**LLAMA, "hidden": 64, "ropeScaling": spec_scaling}
    config = _config(model)
    peer = _hf_model(config, rope_scaling={"rope_type": "llama3", **LLAMA3_SCALING})
    peer.save_pretrained(tmp_path / "in")
    with pytest.raises(config_json.HFError, match="set spec.model.ropeScaling: {factor: 4.0"):
        config_json.check_config(tmp_path / "in", _config({**LLAMA, "hidden": 64}))
    ours = _meshtrain_from(tmp_path / "in", config)
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        expected = peer(tokens).logits
        torch.testing.assert_close(ours(tokens), expected, rtol=1e-5, atol=1e-5)
        plain = llama.build(_config({**LLAMA, "hidden": 64})).eval()  # same weights, plain RoPE
        plain.load_state_dict(ours.state_dict())
        assert (plain(tokens) - expected)[:, 16:].abs().max() > 1e-3  # the rewrite matters here
    to_hf.write(tmp_path / "out", config, dict(ours.named_parameters()))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        torch.testing.assert_close(back(tokens).logits, expected, rtol=1e-5, atol=1e-5)


def test_export_keeps_the_imported_models_context_length(tmp_path):
    """A model made for 4096 positions, fine-tuned at seqLen 32, is exported for 4096, not 32."""
    config = _config(LLAMA)
    peer = _hf_model(config)
    peer.config.max_position_embeddings = 4096
    peer.save_pretrained(tmp_path / "in")
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config.vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    fast.save_pretrained(tmp_path / "in")
    raw = (
        JobBuilder.cpu_run()
        .model(LLAMA, init={"fromHF": str(tmp_path / "in")})
        .training(steps=1)
        .raw()
    )
    mt_harness.run_distributed(_train_and_save, 1, raw, str(tmp_path / "ckpt"))
    assert main.main(["export", str(tmp_path / "ckpt"), "-o", str(tmp_path / "out")]) == 0
    exported = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert exported.max_position_embeddings == 4096
    # the imported directory's tokenizer came along
    text = "w3 w9 nothing w4"
    original = transformers.AutoTokenizer.from_pretrained(tmp_path / "in")
    loaded = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert loaded(text)["input_ids"] == original(text)["input_ids"]
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")


def test_every_eos_id_of_the_imported_model_and_the_data_reaches_transformers(tmp_path):
    """Llama 3 Instruct stops at three ids; its generation_config lists them and config.json names one."""
    config = _config(LLAMA)
    peer = _hf_model(config)
    peer.config.eos_token_id = 1
    peer.generation_config = transformers.GenerationConfig(bos_token_id=0, eos_token_id=[1, 8, 9])
    peer.save_pretrained(tmp_path / "in")
    tokens = tmp_path / "data.bin"
    meta = {"bos_id": 0, "eos_id": 5, "pad_id": None}  # what `meshtrain data prepare` records
    token_files.metadata_path(tokens).write_text(json.dumps(meta))
    files = [token_files.TokenFile(tokens, None, 1.0)]  # type: ignore[arg-type]
    ids = special_tokens.for_job(files, str(tmp_path / "in"))
    to_hf.write(
        tmp_path / "out", config, dict(llama.build(config).named_parameters()), token_ids=ids
    )
    generation = transformers.GenerationConfig.from_pretrained(tmp_path / "out")
    assert generation.eos_token_id == [1, 8, 9, 5]
    assert transformers.AutoConfig.from_pretrained(tmp_path / "out").eos_token_id == [1, 8, 9, 5]


def test_a_sharded_directory_is_read_through_its_index(tmp_path):
    """transformers loads what model.safetensors.index.json names; a stray copy beside it is not read."""
    config = _config(LLAMA)
    peer = _hf_model(config)
    peer.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / config_json.WEIGHTS_INDEX).is_file()
    stray = {k: torch.zeros_like(v) for k, v in peer.state_dict().items()}
    save_file(stray, tmp_path / "original.safetensors", metadata={"format": "pt"})
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        want = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()(tokens).logits
        torch.testing.assert_close(
            _meshtrain_from(tmp_path, config)(tokens), want, rtol=1e-5, atol=1e-5
        )
    (tmp_path / config_json.WEIGHTS_INDEX).unlink()
    with pytest.raises(
        config_json.HFError,
        match=r"is in both .*model-\d+-of-\d+\.safetensors and .*original\.safetensors",
    ):
        from_hf.check_directory(tmp_path, config)


def _mistral(config: gpt.GPTConfig, sliding_window: int | None) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    hf_config = transformers.MistralConfig(
        **_llama_style_fields(config), sliding_window=sliding_window
    )
    return _with_random_norms(transformers.MistralForCausalLM(hf_config))


@pytest.mark.parametrize("window", [None, "seq_len"])
def test_mistral_without_a_window_shorter_than_the_sequence_imports_with_its_logits(
    window, tmp_path
):
    config = _config(LLAMA)
    peer = _mistral(config, config.seq_len if window else None)
    peer.save_pretrained(tmp_path)
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(
            _meshtrain_from(tmp_path, config)(tokens), peer(tokens).logits, rtol=1e-5, atol=1e-5
        )


def test_mistral_sliding_window_and_other_head_dim_are_refused_naming_the_key(tmp_path):
    config = _config(LLAMA)
    _mistral(config, config.seq_len // 2).save_pretrained(tmp_path / "window")
    with pytest.raises(
        config_json.HFError, match=f"sliding_window={config.seq_len // 2} but spec.model.seqLen"
    ):
        from_hf.check_directory(tmp_path / "window", config)
    _hf_model(config, head_dim=2 * config.head_dim).save_pretrained(tmp_path / "wide")
    with pytest.raises(config_json.HFError, match=f"head_dim={2 * config.head_dim} but"):
        from_hf.check_directory(tmp_path / "wide", config)
