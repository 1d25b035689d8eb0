"""Datasets and Hugging Face directories in a bucket of a real S3 server (versitygw, make test tier).

* a token file in a bucket is read by byte ranges: the batches equal those of the same file on disk,
  and s3fs's request log shows only ranged GETs whose bytes are a small share of the file;
* a glob in a bucket leaves out the ``data prepare`` sidecars; an id outside the vocabulary in a
  window read is refused naming the object;
* ``model.init.fromHF`` from a bucket: the directory's model files are copied once into the cache
  (not its other objects) and the imported weights equal those imported from the local directory;
  a directory above the size bound is refused naming the field and the fix; the values a spec
  leaves out are taken from the bucket's ``config.json``; a run started from the bucket's directory
  trains the losses of a run started from the local one.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import mt_harness
import numpy as np
import pytest
import s3fs
import torch
import transformers

from meshtrain.api import loading
from meshtrain.api.spec import model as api_model
from meshtrain.trainer import launch, storage
from meshtrain.trainer.data import batches, token_files
from meshtrain.trainer.interop import config_json, from_hf
from meshtrain.trainer.models import gpt, llama
from meshtrain.trainer.telemetry import steplog
from tests.builders import LLAMA_TINY, JobBuilder

VOCAB = 1000
SEQ_LEN = 64
FIELD = "spec.training.dataset"


def _client(server) -> s3fs.S3FileSystem:
    return s3fs.S3FileSystem(endpoint_url=server.endpoint, skip_instance_cache=True)


def _token_file(path: Path, tokens: np.ndarray) -> Path:
    path.write_bytes(tokens.astype("<u2").tobytes())
    meta = {"dtype": "uint16", "vocab": VOCAB, "tokens": len(tokens), "bytes": 2 * len(tokens)}
    path.with_name(path.name + ".json").write_text(json.dumps(meta))
    return path


def _sampler(files: list[token_files.TokenFile]) -> batches.BatchSampler:
    return batches.BatchSampler(
        files, seq_len=SEQ_LEN, micro_batch=4, micro_batches=2, dp_rank=1, dp_size=2, seed=7
    )


def _ranged_bytes(records: list[logging.LogRecord], key: str) -> tuple[int, int, int]:
    """(ranged GETs, their bytes, GETs without a range) of object ``key`` in s3fs's request log."""
    ranged = unranged = total = 0
    for record in records:
        message = record.getMessage()
        if not message.startswith("CALL: get_object") or f"'Key': '{key}'" not in message:
            continue
        found = re.search(r"'Range': 'bytes=(\d+)-(\d+)'", message)
        if found is None:
            unranged += 1
            continue
        ranged += 1
        total += int(found.group(2)) - int(found.group(1)) + 1
    return ranged, total, unranged


def test_token_file_in_a_bucket_is_read_by_ranges(s3_server, tmp_path, caplog):
    bucket = s3_server.make_bucket("tokens")
    rng = np.random.default_rng(0)
    local = _token_file(tmp_path / "big.bin", rng.integers(0, VOCAB, 4_000_000, dtype=np.uint16))
    size = local.stat().st_size  # 8 MB
    client = _client(s3_server)
    client.put(str(local), f"{bucket}/corpus/big.bin")
    client.put(str(local) + ".json", f"{bucket}/corpus/big.bin.json")

    caplog.set_level(logging.DEBUG, logger="s3fs")
    remote = token_files.open_sources(
        [(f"{bucket}/corpus/*.bin", 1.0, FIELD)], dtype="uint16", vocab=VOCAB, seq_len=SEQ_LEN
    )
    assert [str(f.path) for f in remote] == [f"{bucket}/corpus/big.bin"]  # no sidecar
    on_disk = token_files.open_sources(
        [(str(local), 1.0, FIELD)], dtype="uint16", vocab=VOCAB, seq_len=SEQ_LEN
    )
    ours, reference = _sampler(remote), _sampler(on_disk)
    for _ in range(5):
        for got, want in zip(ours.next(), reference.next()):
            assert torch.equal(got.inputs, want.inputs) and torch.equal(got.targets, want.targets)

    ranged, read, unranged = _ranged_bytes(caplog.records, "corpus/big.bin")
    assert unranged == 0, "a GET without a Range header: the object was downloaded whole"
    windows = 5 * 8  # steps x this rank's rows (micro_batch x micro_batches)
    assert ranged >= windows
    assert read < size / 50, f"read {read} of {size} bytes"
    assert "s3_GetObject" in s3_server.operations()  # the server saw them


def test_an_id_outside_the_vocabulary_is_refused_when_read(s3_server, tmp_path):
    bucket = s3_server.make_bucket("bad-tokens")
    ids = np.zeros(200_000, dtype=np.uint16)
    ids[-100:] = VOCAB + 5  # past the first ids the type sniff reads; no metadata vouches for it
    local = tmp_path / "bad.bin"
    local.write_bytes(ids.tobytes())
    _client(s3_server).put(str(local), f"{bucket}/bad.bin")
    (tokens,) = token_files.open_sources(
        [(f"{bucket}/bad.bin", 1.0, FIELD)], dtype="uint16", vocab=VOCAB, seq_len=SEQ_LEN
    )
    assert len(tokens.tokens) == len(ids)
    with pytest.raises(
        storage.ObjectStorageError, match=rf"{bucket}/bad.bin: token id {VOCAB + 5}"
    ):
        np.asarray(tokens.tokens[-SEQ_LEN:])
    with pytest.raises(token_files.TokenFileError, match="does not exist"):
        token_files.expand(f"{bucket}/missing.bin", FIELD)


def _config() -> gpt.GPTConfig:
    return gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate(LLAMA_TINY).shape())


def _weights(directory: str | Path, config: gpt.GPTConfig) -> dict[str, torch.Tensor]:
    from_hf.check_directory(directory, config)
    with torch.device("meta"):
        model = llama.build(config)
    model.initial_weights = from_hf.HFWeights(directory, config)
    gpt.materialize(model)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_hf(config: gpt.GPTConfig, directory: Path) -> None:
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab,
            hidden_size=config.hidden,
            intermediate_size=config.ffn_hidden,
            num_hidden_layers=config.layers,
            num_attention_heads=config.heads,
            num_key_value_heads=config.key_value_heads,
            max_position_embeddings=config.seq_len,
            rope_theta=config.rope_theta,
            rms_norm_eps=config.norm_eps,
            tie_word_embeddings=config.tie_embeddings,
        )
    )
    hf.save_pretrained(directory)


def test_from_hf_directory_in_a_bucket(s3_server, tmp_path, monkeypatch):
    config = _config()
    _save_hf(config, tmp_path / "hf")
    bucket = s3_server.make_bucket("models")
    client = _client(s3_server)
    client.put(str(tmp_path / "hf"), f"{bucket}/llama", recursive=True)
    client.pipe(f"{bucket}/llama/original/consolidated.00.pth", b"x" * 1000)  # not copied

    url = f"{bucket}/llama"
    assert config_json.max_positions(url) == config.seq_len
    remote, local = _weights(url, config), _weights(tmp_path / "hf", config)
    assert remote.keys() == local.keys()
    for key in local:
        assert torch.equal(remote[key], local[key]), key
    copy = storage.local_path(url, config_json.FIELD)
    assert sorted(p.name for p in copy.iterdir()) == [
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    stale = storage.cache_dir() / ".tmp-dead-copy"  # a copy killed halfway
    stale.mkdir()
    client.pipe(f"{bucket}/llama/generation_config.json", b"{}")  # the directory changed
    storage.local_directory.cache_clear()
    newer = storage.local_path(url, config_json.FIELD)
    assert newer != copy and (newer / "model.safetensors").is_file()
    assert not copy.exists() and not stale.exists(), "the older copy and the dead one are deleted"
    assert newer.stat().st_mode & 0o777 == 0o777 & ~storage._umask()

    monkeypatch.setenv(storage.DIRECTORY_LIMIT_ENV, "1000")
    client.pipe(f"{bucket}/llama2/config.json", (tmp_path / "hf" / "config.json").read_bytes())
    client.put(str(tmp_path / "hf" / "model.safetensors"), f"{bucket}/llama2/model.safetensors")
    with pytest.raises(
        config_json.HFError, match=rf"spec.model.init.fromHF: {bucket}/llama2 holds"
    ):
        from_hf.check_directory(f"{bucket}/llama2", config)


def test_values_a_spec_leaves_out_are_taken_from_config_json_in_a_bucket(s3_server, tmp_path):
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=256,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=160,
            max_position_embeddings=64,
            rms_norm_eps=1e-6,
            rope_theta=250000.0,
        )
    ).save_pretrained(tmp_path / "hf")
    url = s3_server.make_bucket("silent-models") + "/llama"
    _client(s3_server).put(str(tmp_path / "hf"), url, recursive=True)
    stated = {"family": "llama", "layers": 2, "hidden": 64, "heads": 4, "vocab": 256, "seqLen": 32}
    raw = (
        JobBuilder.cpu_run()
        .model({**stated, "init": {"fromHF": url}})
        .object_storage(endpoint=s3_server.endpoint)
        .raw()
    )

    shape = from_hf.check_spec(loading.parse_spec(raw)).model.shape()

    assert (shape.kv_heads, shape.ffn_hidden, shape.norm_eps) == (2, 160, 1e-6)
    assert shape.rope_theta == 250000.0


def _first_losses(tmp_path: Path, name: str, from_hf: str, endpoint: str) -> list[float]:
    raw = (
        JobBuilder.cpu_run()
        .model({**LLAMA_TINY, "init": {"fromHF": from_hf}})
        .training(steps=2)
        .object_storage(endpoint=endpoint)
        .raw()
    )
    log_dir = tmp_path / name
    assert (
        launch.run_local(mt_harness.write_job(tmp_path, raw, f"{name}.yaml"), log_dir=log_dir) == 0
    )
    return [r["loss"] for r in steplog.read(log_dir / steplog.FILENAME)]


@pytest.mark.slow
def test_a_run_starts_from_a_directory_in_a_bucket(s3_server, tmp_path):
    _save_hf(_config(), tmp_path / "hf")
    url = s3_server.make_bucket("run-models") + "/llama"
    _client(s3_server).put(str(tmp_path / "hf"), url, recursive=True)
    from_bucket = _first_losses(tmp_path, "bucket", url, s3_server.endpoint)
    from_disk = _first_losses(tmp_path, "disk", str(tmp_path / "hf"), s3_server.endpoint)
    assert from_bucket == from_disk and len(from_bucket) == 2
