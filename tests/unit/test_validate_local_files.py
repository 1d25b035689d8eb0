"""``meshtrain validate`` checks the files a spec names on this machine (issue #37 item 5): token
files where the path is local, and a ``model.init.fromHF`` directory with the checks ``meshtrain
run`` makes (the same torch-free module; ``run`` itself is the reference for the messages).

The Hugging Face directories are written as the exporter writes them (``config.json`` from
:func:`meshtrain.trainer.interop.config_json.hf_config`, tensors by the safetensors library).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors import numpy as safetensors_numpy
from safetensors import safe_open

from meshtrain.api import hf_config, hf_directory, loading
from meshtrain.api import spec as api_spec
from meshtrain.trainer.interop import config_json
from meshtrain.trainer.models import gpt
from tests.builders import JobBuilder


def meshtrain(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``meshtrain ARGS`` through the CLI's module in ``cwd``, as a user runs it."""
    return subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
    )


def _dataset(path: str) -> JobBuilder:
    return JobBuilder.cpu_run().training(dataset=path)


# --- token files -------------------------------------------------------------------------------


def test_a_missing_relative_dataset_is_refused_naming_the_field_and_path(tmp_path):
    run = meshtrain(tmp_path, "validate", str(_dataset("data/tokens.bin").write(tmp_path)))
    assert run.returncode == 2, run
    assert "spec.training.dataset: token file 'data/tokens.bin' does not exist" in run.stderr
    assert f"(relative to {tmp_path})" in run.stderr


def test_a_relative_dataset_that_exists_is_valid(tmp_path):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "tokens.bin").write_bytes(bytes(64))
    run = meshtrain(tmp_path, "validate", str(_dataset("data/tokens.bin").write(tmp_path)))
    assert run.returncode == 0, run.stderr
    assert "valid TrainingJob" in run.stdout


def test_a_glob_matching_nothing_is_refused_and_one_matching_a_file_is_valid(tmp_path):
    builder = JobBuilder.cpu_run().training(datasets=[{"path": "shards/*.bin", "weight": 1.0}])
    job = builder.write(tmp_path)
    run = meshtrain(tmp_path, "validate", str(job))
    assert run.returncode == 2, run
    assert "spec.training.datasets[0].path: the glob 'shards/*.bin' matches no file" in run.stderr
    (tmp_path / "shards").mkdir()
    (tmp_path / "shards" / "part-0.bin").write_bytes(bytes(64))
    assert meshtrain(tmp_path, "validate", str(job)).returncode == 0


def test_an_absolute_path_is_the_pods_unless_local(tmp_path):
    missing = str(tmp_path / "volume" / "tokens.bin")  # not on this machine: a pod's volume
    job = _dataset(missing).write(tmp_path)
    cluster = meshtrain(tmp_path, "validate", str(job))
    assert cluster.returncode == 0, cluster.stderr
    assert (
        f"note: spec.training.dataset {missing} is not on this machine: not checked"
        in cluster.stderr
    )
    local = meshtrain(tmp_path, "validate", "--local", str(job))
    assert local.returncode == 2, local
    assert f"spec.training.dataset: token file '{missing}' does not exist" in local.stderr


def test_meshtrain_run_refuses_what_validate_local_refuses(tmp_path):
    missing = str(tmp_path / "tokens.bin")
    job = _dataset(missing).write(tmp_path)
    validate = meshtrain(tmp_path, "validate", "--local", str(job))
    run = meshtrain(tmp_path, "run", str(job), "--log-dir", str(tmp_path / "log"))
    assert validate.returncode == 2 and run.returncode != 0, (validate, run)
    assert "spec.training.dataset" in run.stderr and missing in run.stderr  # run's own words


# --- fromHF ------------------------------------------------------------------------------------


def _from_hf(tmp_path: Path) -> tuple[JobBuilder, Path]:
    """A tiny job and a Hugging Face directory that fits it: the exporter's config.json and a
    safetensors file (validate reads its header; run checks every tensor)."""
    builder = JobBuilder.cpu_run()
    shape = loading.parse_spec(builder.raw()).model.shape()
    directory = tmp_path / "hf"
    directory.mkdir()
    config = config_json.hf_config(gpt.GPTConfig.from_shape(shape))
    (directory / hf_config.CONFIG).write_text(json.dumps(config))
    tensors = {"transformer.wte.weight": np.zeros((shape.vocab, shape.hidden), np.float32)}
    safetensors_numpy.save_file(tensors, str(directory / hf_config.WEIGHTS))
    return builder.model(init={"fromHF": str(directory)}), directory


def _rewrite_config(directory: Path, **changes: object) -> None:
    path = directory / hf_config.CONFIG
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def _index_naming_a_missing_shard(directory: Path) -> None:
    (directory / hf_config.WEIGHTS_INDEX).write_text(
        json.dumps({"weight_map": {"transformer.wte.weight": "model-00002-of-00002.safetensors"}})
    )


BROKEN = {
    "no config.json": (lambda d: (d / hf_config.CONFIG).unlink(), "config.json does not exist"),
    "config.json not JSON": (
        lambda d: (d / hf_config.CONFIG).write_text("{"),
        "config.json is not valid JSON",
    ),
    "an architecture meshtrain does not load": (
        lambda d: _rewrite_config(d, model_type="qwen2"),
        "model_type='qwen2' but spec.model.family=gpt",
    ),
    "a shape the spec does not have": (
        lambda d: _rewrite_config(d, vocab_size=512),
        "vocab_size=512 but spec.model.vocab=256",
    ),
    "no safetensors file": (
        lambda d: (d / hf_config.WEIGHTS).unlink(),
        "has no *.safetensors file",
    ),
    "an index naming a missing shard": (
        _index_naming_a_missing_shard,
        "names files that are not there",
    ),
    "a file that is not safetensors": (
        lambda d: (d / hf_config.WEIGHTS).write_bytes(b"\xff" * 16),
        "is not a safetensors file",
    ),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_validate_refuses_a_from_hf_directory_that_does_not_fit(tmp_path, case):
    builder, directory = _from_hf(tmp_path)
    job = builder.write(tmp_path)
    assert meshtrain(tmp_path, "validate", str(job)).returncode == 0  # fits before it is broken
    breaks, words = BROKEN[case]
    breaks(directory)
    run = meshtrain(tmp_path, "validate", str(job))
    assert run.returncode == 2, run
    line = next(line for line in run.stderr.splitlines() if "spec.model.init.fromHF:" in line)
    assert words in line and str(directory) in line, run.stderr


@pytest.mark.parametrize(
    "case", ["no config.json", "a shape the spec does not have", "an index naming a missing shard"]
)
def test_validate_and_run_refuse_a_from_hf_directory_in_the_same_words(tmp_path, case):
    builder, directory = _from_hf(tmp_path)
    BROKEN[case][0](directory)
    job = builder.write(tmp_path)
    validate = meshtrain(tmp_path, "validate", str(job))
    run = meshtrain(tmp_path, "run", str(job), "--log-dir", str(tmp_path / "log"))
    assert (validate.returncode, run.returncode) == (2, 2), (validate, run)
    said = next(line for line in validate.stderr.splitlines() if "spec.model.init.fromHF:" in line)
    assert said.removeprefix("  - ") in run.stderr, (said, run.stderr)


def test_validate_takes_what_the_spec_leaves_out_from_config_json_as_run_does(tmp_path):
    builder, directory = _from_hf(tmp_path)
    _rewrite_config(directory, n_inner=96)  # not the default 4 x hidden the spec would get
    stated = builder.write(tmp_path)
    refused = meshtrain(tmp_path, "validate", str(stated))
    assert refused.returncode == 2 and "n_inner=96 but spec.model.ffnHidden=128" in refused.stderr
    raw = builder.raw()
    del raw["model"]["ffnHidden"]
    silent = JobBuilder.from_manifest({"metadata": {"name": "hf"}, "spec": raw})
    run = meshtrain(tmp_path, "validate", str(silent.write(tmp_path)))
    assert run.returncode == 0, run.stderr


def test_the_header_reader_agrees_with_the_safetensors_library(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        "a": np.zeros((3, 5), np.float32),
        "b.weight": np.ones((7,), np.float16),
        "c": np.zeros((2, 2, 2), np.int64),
    }
    safetensors_numpy.save_file(tensors, str(path), metadata={"format": "pt"})
    read = hf_directory.header(path)
    with safe_open(str(path), framework="numpy") as handle:
        expected = {key: handle.get_slice(key).get_shape() for key in handle.keys()}  # noqa: SIM118
    assert {key: value["shape"] for key, value in read.items()} == expected


def test_a_header_longer_than_the_bound_is_refused_unread(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes((2**62).to_bytes(8, "little") + b"{}")
    with pytest.raises(hf_config.HFError, match="not a safetensors file"):
        hf_directory.header(path)


def _preset_job(directory: Path) -> api_spec.TrainingJobSpec:
    return loading.parse_spec(
        JobBuilder.cpu_run().model({"preset": "tiny", "init": {"fromHF": str(directory)}}).raw()
    )


def test_the_preset_hint_is_given_only_where_the_file_contradicts_a_preset_value(tmp_path):
    job = _preset_job(tmp_path / "hf")
    missing = tmp_path / "missing"
    with pytest.raises(hf_config.HFError) as err:
        hf_directory.check_spec(_preset_job(missing), missing)
    assert f"{missing} is not a directory" in str(err.value)
    assert "spec.model.preset" not in str(
        err.value
    )  # a missing directory is not the preset's doing
    directory = tmp_path / "hf"
    directory.mkdir()
    config = config_json.hf_config(gpt.GPTConfig.from_shape(job.model.shape()))
    (directory / hf_config.CONFIG).write_text(json.dumps({**config, "vocab_size": 512}))
    with pytest.raises(hf_config.HFError) as err:
        hf_directory.check_spec(job, directory)
    assert "vocab_size=512 but spec.model.vocab=256" in str(err.value)
    assert "spec.model.preset=tiny states the fields" in str(err.value)
