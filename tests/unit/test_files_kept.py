"""Files never lost (issue 33, item 4): ``data prepare`` and the Hugging Face writer keep users' files.

* ``data prepare -o X`` with X one of its inputs (the same path, a symlink to it, a hard link
  to it) or the tokenizer is refused naming ``-o/--output``, exits 2, and the input is unchanged;
* a Hugging Face directory written into an existing one keeps the files it does not write,
  replaces the old weights only once the new are complete (a failure leaves the directory as
  it was), and removes an earlier export's stale shards;
* a killed export's staging directory (its process gone, or nothing written for an hour) is
  removed by the next export into the same directory, a running one's and another output's are
  kept; an output URL is refused naming ``-o/--output`` (no local ``s3:`` directory appears);
  an existing output whose parent an unprivileged user may not write is staged inside it, and a
  new one there is refused naming ``-o/--output`` (the kernel's permission checks, as uid 65534);
* ``data prepare`` into a previous run's output that fails once the new token file is in place
  leaves no metadata beside it (the previous run's would vouch for the new file's ids);
* the files get the modes a plain ``open()`` gets under the process umask (the OS is the
  reference: a file created here with ``open`` under the same umask), for 022 and 027.

Tier: ``make test`` (unit).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

from meshtrain.api.spec import model as api_model
from meshtrain.cli import main
from meshtrain.trainer.data import file_modes, token_files, vocab_scan
from meshtrain.trainer.interop import to_hf
from meshtrain.trainer.models import gpt, llama
from tests.builders import LLAMA_TINY


def _tokenizer(path: Path) -> Path:
    words = {"<unk>": 0, "</s>": 1, **{f"w{i}": i for i in range(2, 40)}}
    tokenizer = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path))
    return path


def _prepare(inputs: list[Path], tokenizer: Path, output: Path) -> int:
    argv = ["data", "prepare", *map(str, inputs), "--tokenizer", str(tokenizer), "-o", str(output)]
    return main.main(argv)


@pytest.fixture(params=[0o022, 0o027], ids=["umask022", "umask027"])
def umask(request: pytest.FixtureRequest) -> object:
    old = os.umask(request.param)
    yield request.param
    os.umask(old)


def _mode_open_gives(directory: Path) -> int:
    """The permission bits the OS gives a file made by a plain ``open()`` under the current umask."""
    probe = directory / "probe-open"
    probe.write_text("")
    mode = probe.stat().st_mode & 0o777
    probe.unlink()
    return mode


@pytest.mark.parametrize("alias", ["same", "symlink", "hardlink"])
def test_prepare_refuses_an_output_that_is_an_input(alias, tmp_path, capsys):
    tok = _tokenizer(tmp_path / "tokenizer.json")
    text = tmp_path / "a.txt"
    text.write_text("w2 w3 w4 w5")
    output = {"same": text, "symlink": tmp_path / "link.txt", "hardlink": tmp_path / "hard.txt"}[
        alias
    ]
    if alias == "symlink":
        output.symlink_to(text)
    elif alias == "hardlink":
        os.link(text, output)
    code = _prepare([text], tok, output)
    err = capsys.readouterr().err
    assert code == 2
    assert "-o/--output" in err and str(text) in err
    assert text.read_text() == "w2 w3 w4 w5"
    assert not (tmp_path / "a.txt.json").exists()


def test_prepare_refuses_writing_its_metadata_over_an_input_or_the_tokenizer(tmp_path, capsys):
    tok = _tokenizer(tmp_path / "tokenizer.json")
    before = tok.read_bytes()
    text = tmp_path / "a.txt"
    text.write_text("w2 w3")
    assert _prepare([text], tok, tmp_path / "tokenizer") == 2  # would write tokenizer.json
    assert "--tokenizer" in capsys.readouterr().err
    assert tok.read_bytes() == before and not (tmp_path / "tokenizer").exists()


def test_prepared_token_file_and_metadata_get_the_umasks_modes(umask, tmp_path):
    tok = _tokenizer(tmp_path / "tokenizer.json")
    text = tmp_path / "a.txt"
    text.write_text("w2 w3 w4 w5 " * 10)
    out = tmp_path / "out" / "tokens.bin"
    assert _prepare([text], tok, out) == 0
    expected = _mode_open_gives(tmp_path)
    assert expected == 0o666 & ~umask
    for path in (out, out.with_name("tokens.bin.json")):
        assert path.stat().st_mode & 0o777 == expected, path


def _model() -> tuple[gpt.GPTConfig, dict[str, torch.Tensor]]:
    config = gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate(LLAMA_TINY).shape())
    return config, dict(llama.build(config).named_parameters())


def test_writing_into_a_model_directory_keeps_its_other_files_and_drops_stale_shards(tmp_path):
    config, params = _model()
    directory = tmp_path / "model"
    to_hf.write(directory, config, params, max_shard_bytes=20_000)  # an earlier, sharded export
    assert (directory / "model.safetensors.index.json").is_file()
    (directory / "README.md").write_text("the user's notes")
    (directory / "tokenizer.json").write_text("{}")
    to_hf.write(directory, config, params)  # one file now
    names = {p.name for p in directory.iterdir()}
    assert {"README.md", "tokenizer.json", "model.safetensors", "config.json"} <= names
    assert not [n for n in names if n.startswith("model-") or n.endswith(".index.json")]
    assert (directory / "README.md").read_text() == "the user's notes"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model.tmp-")]


def test_a_failed_write_leaves_the_directory_as_it_was(tmp_path):
    config, params = _model()
    directory = tmp_path / "model"
    to_hf.write(directory, config, params)
    before = {p.name: p.read_bytes() for p in directory.iterdir()}
    broken = dict(params)
    broken.pop(next(iter(broken)))  # a parameter the writer cannot map
    with pytest.raises(KeyError):
        to_hf.write(directory, config, {**broken, "not.a.parameter": torch.zeros(1)})
    assert {p.name: p.read_bytes() for p in directory.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_written_model_files_and_a_new_directory_get_the_umasks_modes(umask, tmp_path):
    config, params = _model()
    directory = tmp_path / "new" / "model"
    to_hf.write(directory, config, params)
    expected = _mode_open_gives(tmp_path)
    probe_dir = tmp_path / "probe-dir"
    probe_dir.mkdir()
    assert directory.stat().st_mode & 0o777 == probe_dir.stat().st_mode & 0o777
    for path in directory.iterdir():
        assert path.stat().st_mode & 0o777 == expected, path
    assert json.loads((directory / "config.json").read_text())["model_type"] == "llama"


def test_umask_is_read_without_changing_it(umask):
    assert file_modes.umask() == umask
    assert os.umask(umask) == umask


def test_a_directory_named_through_a_symlink_is_written_where_it_points(tmp_path):
    config, params = _model()
    real = tmp_path / "volume" / "model"
    real.mkdir(parents=True)
    (real / "README.md").write_text("kept")
    link = tmp_path / "link"
    link.symlink_to(real)
    to_hf.write(link, config, params)
    assert link.is_symlink() and (real / "model.safetensors").is_file()
    assert (real / "README.md").read_text() == "kept"
    assert not [p for p in (tmp_path / "volume").iterdir() if ".tmp-" in p.name]


def _gone_pid() -> int:
    child = subprocess.Popen(["true"])
    child.wait()
    return child.pid


def test_a_killed_exports_staging_is_removed_and_a_running_ones_kept(tmp_path):
    config, params = _model()
    host = socket.gethostname()
    names = {
        "killed": f".model.tmp-{host}-{_gone_pid()}-abc",
        "old": ".model.tmp-elsewhere-7-old",
        "running": f".model.tmp-{host}-{os.getpid()}-run",
        "fresh": ".model.tmp-elsewhere-7-new",
        "other output": f".model2.tmp-{host}-{_gone_pid()}-abc",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "model-00001-of-00002.safetensors").write_bytes(b"x" * 1000)
    two_hours_ago = time.time() - 2 * 3600
    for path in (
        tmp_path / names["old"],
        tmp_path / names["old"] / "model-00001-of-00002.safetensors",
    ):
        os.utime(path, (two_hours_ago, two_hours_ago))

    to_hf.write(tmp_path / "model", config, params)

    left = {p.name for p in tmp_path.iterdir()}
    assert left == {"model", names["running"], names["fresh"], names["other output"]}


def test_an_output_url_is_refused_not_written_as_a_local_path(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main.main(["export", str(tmp_path / "no-checkpoint"), "-o", "s3://bucket/model"]) == 2
    err = capsys.readouterr().err
    assert "-o/--output s3://bucket/model" in err and "local directory" in err
    config, params = _model()
    with pytest.raises(to_hf.OutputError, match="upload it"):
        to_hf.write("gs://bucket/model", config, params)
    assert list(tmp_path.iterdir()) == []


_WRITE_AS_NOBODY = """
import sys
from meshtrain.api.spec import model as api_model
from meshtrain.trainer.interop import to_hf
from meshtrain.trainer.models import gpt, llama
config = gpt.GPTConfig.from_shape(api_model.ModelSpec.model_validate_json(sys.argv[2]).shape())
try:
    to_hf.write(sys.argv[1], config, dict(llama.build(config).named_parameters()))
except to_hf.OutputError as err:
    print(err)
    sys.exit(2)
"""


def _write_as_nobody(directory: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-c", _WRITE_AS_NOBODY, str(directory), json.dumps(LLAMA_TINY)]
    if os.geteuid() == 0:  # as root every permission check passes
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    env = {**os.environ, "HOME": str(directory.parent.parent)}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)


def test_an_output_whose_parent_is_read_only_is_staged_inside_it():
    base = Path(tempfile.mkdtemp())  # pytest's tmp_path is 0700: uid 65534 could not reach it
    try:
        base.chmod(0o755)
        parent = base / "volume"
        (parent / "model").mkdir(parents=True)
        (parent / "model" / "README.md").write_text("kept")
        os.chown(parent / "model", 65534, 65534)
        parent.chmod(0o555)
        done = _write_as_nobody(parent / "model")
        assert done.returncode == 0, done.stdout + done.stderr
        assert {p.name for p in (parent / "model").iterdir()} == {
            "README.md",
            "config.json",
            "generation_config.json",
            "model.safetensors",
        }
        refused = _write_as_nobody(parent / "new")
        assert refused.returncode == 2, refused.stdout + refused.stderr
        assert "-o/--output" in refused.stdout and "writable" in refused.stdout
        assert sorted(p.name for p in parent.iterdir()) == ["model"]
    finally:
        parent.chmod(0o755)
        shutil.rmtree(base)


def test_prepare_failing_after_the_new_tokens_are_in_place_leaves_no_old_metadata(
    tmp_path, monkeypatch
):
    tok = _tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.txt").write_text("w2 w3 w4 w5 " * 10)
    (tmp_path / "b.txt").write_text("w7 " * 30)
    out = tmp_path / "out" / "tokens.bin"
    assert _prepare([tmp_path / "a.txt"], tok, out) == 0
    assert token_files.metadata_path(out).is_file()

    def crash(path):
        raise OSError("injected: the machine went down")

    monkeypatch.setattr(vocab_scan, "sampled_digest", crash)  # read once the tokens are in place
    with pytest.raises(OSError, match="injected"):
        _prepare([tmp_path / "b.txt"], tok, out)

    assert out.stat().st_size == (30 + 1) * 2  # the new run's tokens and its end-of-text
    assert sorted(p.name for p in out.parent.iterdir()) == ["tokens.bin"]
