"""``meshtrain export`` into the model's own ``fromHF`` directory, and into its checkpoint (issue 33, item 4).

* exported into the directory it was imported from, the model's tokenizer files are the same
  bytes as before, a file of the user's stays, the old weights are replaced by the checkpoint's
  (transformers loads the directory and gives meshtrain's logits), and every file has the
  mode a plain ``open()`` gets under the umask (the OS, probed here, is the reference);
* an output inside the checkpoint it exports is refused naming ``-o/--output``, exit 2,
  the checkpoint's files unchanged;
* an export into an earlier export's directory that fails between two of its renames leaves a
  directory that neither transformers nor ``fromHF`` loads (never the two exports' shards mixed),
  and exporting again gives the new model.

Tier: ``make test`` (trainer).
"""

from __future__ import annotations

import os

import mt_harness
import pytest
import torch
import transformers
from test_hf_interop import LLAMA, _config, _hf_model, _train_and_save
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtrain.cli import main
from meshtrain.trainer.interop import config_json, export, from_hf, to_hf
from meshtrain.trainer.models import llama
from tests.builders import JobBuilder


@pytest.mark.slow
def test_export_into_its_fromhf_directory_keeps_the_tokenizer_and_the_users_files(tmp_path):
    old_umask = os.umask(0o022)
    try:
        _export_into_source(tmp_path)
    finally:
        os.umask(old_umask)


def _export_into_source(tmp_path):
    config = _config(LLAMA)
    source = tmp_path / "in"
    _hf_model(config).save_pretrained(source)
    words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, config.vocab)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    ).save_pretrained(source)
    (source / "README.md").write_text("model card")
    kept = {n: (source / n).read_bytes() for n in ("tokenizer.json", "tokenizer_config.json")}
    old_weights = (source / "model.safetensors").read_bytes()
    raw = JobBuilder.cpu_run().model(LLAMA, init={"fromHF": str(source)}).training(steps=2).raw()
    mt_harness.run_distributed(_train_and_save, 1, raw, str(tmp_path / "ckpt"))

    assert main.main(["export", str(tmp_path / "ckpt"), "-o", str(source)]) == 0

    for name, data in kept.items():
        assert (source / name).read_bytes() == data, name
    assert (source / "README.md").read_text() == "model card"
    assert (source / "model.safetensors").read_bytes() != old_weights
    probe = tmp_path / "probe"
    probe.write_text("")
    expected = probe.stat().st_mode & 0o777
    assert expected == 0o644
    for path in source.iterdir():
        assert path.stat().st_mode & 0o777 == expected, path
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
    auto = transformers.AutoModelForCausalLM.from_pretrained(source).eval()
    ours = llama.build(config)
    directory, _ = export.find_checkpoint(tmp_path / "ckpt")
    ours.load_state_dict(export.read_dense(directory))
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(auto(tokens).logits, ours.eval()(tokens), rtol=1e-5, atol=1e-5)
    loaded = transformers.AutoTokenizer.from_pretrained(source)
    assert (loaded.bos_token, loaded.eos_token) == ("<s>", "</s>")


@pytest.mark.slow
def test_export_into_its_checkpoint_is_refused_naming_the_option(tmp_path, capsys):
    raw = JobBuilder.cpu_run().model(LLAMA).training(steps=1).raw()
    mt_harness.run_distributed(_train_and_save, 1, raw, str(tmp_path / "ckpt"))
    directory, _ = export.find_checkpoint(tmp_path / "ckpt")
    before = sorted((p.relative_to(directory), p.stat().st_size) for p in directory.rglob("*"))
    for inside in (directory, directory / "hf"):
        assert main.main(["export", str(tmp_path / "ckpt"), "-o", str(inside)]) == 2
        err = capsys.readouterr().err
        assert "-o/--output" in err and "elsewhere" in err
    after = sorted((p.relative_to(directory), p.stat().st_size) for p in directory.rglob("*"))
    assert after == before


def _sharded_export(directory, config, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    dense = dict(llama.build(config).named_parameters())
    files = to_hf.write(directory, config, dense, max_shard_bytes=40_000)
    assert len(files) > 3  # shards and their index
    return dense


def test_an_export_interrupted_between_two_renames_leaves_no_loadable_mix(tmp_path, monkeypatch):
    config = _config(LLAMA)
    out = tmp_path / "out"
    _sharded_export(out, config, seed=1)
    renames = []

    def second_rename_fails(src, dst):
        renames.append(dst)
        if len(renames) == 2:
            raise OSError("injected: the machine went down")
        os.rename(src, dst)

    with monkeypatch.context() as patch:
        patch.setattr(to_hf.os, "replace", second_rename_fails)
        with pytest.raises(OSError, match="injected"):
            _sharded_export(out, config, seed=2)

    assert any(p.name.startswith("model-0000") for p in out.iterdir())
    with pytest.raises((OSError, ValueError)):  # no config.json: no model to build
        transformers.AutoModelForCausalLM.from_pretrained(out)
    with pytest.raises(config_json.HFError, match="config.json does not exist"):
        from_hf.check_directory(out, config)
    new = _sharded_export(out, config, seed=2)
    auto = transformers.AutoModelForCausalLM.from_pretrained(out)
    ours = llama.build(config)
    ours.load_state_dict({k: v.detach() for k, v in new.items()})
    tokens = torch.randint(0, config.vocab, (2, config.seq_len))
    with torch.no_grad():
        torch.testing.assert_close(auto(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)
