"""``meshtrain export`` for large models and for ``generate``, checked by transformers (the peer).

* sharded: a tiny shard size makes several safetensors files and
  ``model.safetensors.index.json``; transformers loads the directory and
  gives meshtrain's logits, and the export never held the whole model (peak
  live tensor bytes, counted by :class:`~meshtrain.trainer.telemetry.live_bytes.LiveBytes`);
* token ids: data prepared with a tokenizer built here records its
  begin/end-of-text ids, the checkpoint carries them, and the exported
  config.json / generation_config.json hold them as transformers reads them;
  with ``--tokenizer`` naming a tokenizer whose end-of-text is the model's
  greedy next token, ``generate`` stops right after it;
* ``--dtype bfloat16``: transformers loads the export as bf16, every tensor
  exactly the fp32 export rounded, and (upcast) gives the logits of
  meshtrain's model with its weights rounded to bf16 (GPT-2 and Llama).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mt_harness
import pytest
import torch
import transformers
from test_hf_interop import LLAMA, _config, _train_and_save
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtrain.cli import main
from meshtrain.trainer.interop import export, to_hf
from meshtrain.trainer.models import llama
from meshtrain.trainer.telemetry import live_bytes
from tests.builders import TINY, JobBuilder

SPECIAL = {"<unk>": 0, "<s>": 7, "</s>": 11, "<pad>": 13}
"""Ids away from transformers' LlamaConfig defaults (bos 1, eos 2), so a default cannot pass for ours."""


def _tokenizer(path: Path, vocab: int, special: dict[str, int]) -> Path:
    ids = set(special.values())
    words = {f"w{i}": i for i in range(vocab) if i not in ids}
    tokenizer = Tokenizer(models.WordLevel({**words, **special}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A llama checkpoint trained on data prepared with the test tokenizer, exported in 20 kB shards."""
    root = tmp_path_factory.mktemp("export")
    config = _config(LLAMA)
    tok = _tokenizer(root / "tokenizer.json", config.vocab, SPECIAL)
    rng = random.Random(0)
    lines = [
        json.dumps({"text": " ".join(f"w{rng.randrange(20, 200)}" for _ in range(60))})
        for _ in range(40)
    ]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    tokens = root / "tokens.bin"
    argv = ["data", "prepare", str(root / "docs.jsonl"), "--tokenizer", str(tok), "-o", str(tokens)]
    assert main.main(argv) == 0
    raw = (
        JobBuilder.cpu_run()
        .model(LLAMA)
        .training(steps=3, dataset=str(tokens), tokenDtype="uint16")
        .raw()
    )
    mt_harness.run_distributed(_train_and_save, 1, raw, str(root / "ckpt"))
    directory, _ = export.find_checkpoint(root / "ckpt")
    shapes = export.model_shapes(directory)
    out = root / "hf"
    with live_bytes.LiveBytes() as live:
        written = export.export(root / "ckpt", out, max_shard_bytes=export.parse_size("20KB"))
    return {
        "root": root,
        "out": out,
        "written": written,
        "peak": live.peak,
        "total": sum(4 * torch.Size(s).numel() for s in shapes.values()),
        "config": config,
        "directory": directory,
    }


def _meshtrain_model(exported: dict) -> torch.nn.Module:
    ours = llama.build(exported["config"])
    ours.load_state_dict(export.read_dense(exported["directory"]))
    return ours.eval()


@pytest.mark.slow
def test_sharded_export_loads_in_transformers_without_holding_the_model(exported):
    out, limit = exported["out"], export.parse_size("20KB")
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 3 and not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    config = exported["config"]
    one_table = config.vocab * config.hidden * 4  # the largest single tensor may exceed the limit
    assert all(p.stat().st_size <= max(limit, one_table) + 4096 for p in shards)
    assert exported["peak"] < exported["total"] / 2, (exported["peak"], exported["total"])

    auto = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert set(auto.state_dict()) == set(index["weight_map"])  # every tensor from the shards
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(
            auto(tokens).logits, _meshtrain_model(exported)(tokens), rtol=1e-5, atol=1e-5
        )


@pytest.mark.slow
def test_token_ids_of_the_data_reach_transformers_and_generate_stops_at_eos(exported):
    out = exported["out"]
    peer = transformers.AutoConfig.from_pretrained(out)
    generation = transformers.GenerationConfig.from_pretrained(out)
    for found in (peer, generation):
        assert (found.bos_token_id, found.eos_token_id, found.pad_token_id) == (7, 11, 13)

    prompt = torch.tensor([[30, 31, 32, 33]])
    with torch.no_grad():
        greedy = int(_meshtrain_model(exported)(prompt)[0, -1].argmax())
    special = {"<unk>": 0, "<s>": 7, "</s>": greedy, "<pad>": 13}
    if greedy in (0, 7, 13):
        special = {"<unk>": 0, "</s>": greedy}
    tok = _tokenizer(exported["root"] / "stop.json", exported["config"].vocab, special)
    stop_dir = exported["root"] / "hf-stop"
    argv = ["export", str(exported["root"] / "ckpt"), "-o", str(stop_dir), "--tokenizer", str(tok)]
    assert main.main(argv) == 0
    text = " ".join(f"w{i}" for i in range(30, 34))
    loaded = transformers.AutoTokenizer.from_pretrained(stop_dir)  # the --tokenizer came along
    assert loaded(text)["input_ids"] == Tokenizer.from_file(str(tok)).encode(text).ids
    assert loaded.eos_token_id == greedy
    auto = transformers.AutoModelForCausalLM.from_pretrained(stop_dir).eval()
    generated = auto.generate(prompt, max_new_tokens=8, do_sample=False)
    assert generated[0, 4:].tolist() == [greedy]  # stopped at end-of-text, 7 tokens early


def test_shard_size_is_parsed_like_transformers_and_bad_ones_are_refused(tmp_path, capsys):
    assert export.parse_size("5GB") == 5 * 10**9
    assert export.parse_size("2GiB") == 2 * 2**30
    assert export.parse_size("1500") == 1500
    argv = ["export", str(tmp_path), "-o", str(tmp_path / "o"), "--max-shard-size", "lots"]
    assert main.main(argv) == 2
    assert "--max-shard-size 'lots'" in capsys.readouterr().err


def _rounded_to_bf16(model: torch.nn.Module) -> torch.nn.Module:
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


@pytest.mark.slow
def test_bf16_export_loads_in_transformers_as_bf16_with_the_rounded_weights(exported):
    out = exported["root"] / "hf-bf16"
    argv = ["export", str(exported["root"] / "ckpt"), "-o", str(out), "--dtype", "bfloat16"]
    assert main.main(argv) == 0
    auto = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert auto.dtype == torch.bfloat16 and auto.config.dtype == torch.bfloat16
    fp32 = transformers.AutoModelForCausalLM.from_pretrained(exported["out"]).eval()
    assert fp32.dtype == torch.float32  # the default stays as trained
    theirs, rounded = auto.state_dict(), fp32.state_dict()
    assert set(theirs) == set(rounded)
    for key, tensor in theirs.items():  # exactly the fp32 export rounded to bf16, name by name
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, rounded[key].bfloat16()), key
    weights = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert weights < 0.55 * sum(p.stat().st_size for p in exported["out"].glob("*.safetensors"))
    config = exported["config"]
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    ours = _rounded_to_bf16(_meshtrain_model(exported))
    with torch.no_grad():
        torch.testing.assert_close(auto.float()(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_bf16_export_of_a_gpt2_model_gives_its_rounded_logits_in_transformers(tmp_path):
    config = _config(TINY)
    torch.manual_seed(0)
    ours = llama.build(config).eval()
    to_hf.write(tmp_path, config, dict(ours.named_parameters()), dtype="bfloat16")
    auto = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(auto).__name__ == "GPT2LMHeadModel" and auto.dtype == torch.bfloat16
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(
            auto.float()(tokens).logits, _rounded_to_bf16(ours)(tokens), rtol=1e-5, atol=1e-5
        )
