"""Progress where a user waits (meshtrain/api/console.py): a bar on a terminal (a real pseudo-terminal
here), one plain line per phase when stderr is a pipe; ``data prepare``, ``export`` and the sandbox's
start through their own code."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors import safe_open
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from meshtrain.api import console
from meshtrain.api.spec import model as api_model
from meshtrain.sandbox import watch
from meshtrain.trainer.interop import to_hf
from meshtrain.trainer.models import gpt, llama
from tests import terminal


@pytest.fixture(autouse=True)
def _unforced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(console.FORCE_ENV, raising=False)


def test_a_phase_off_a_terminal_writes_one_line_when_it_ends() -> None:
    stream = io.StringIO()
    phase = console.Phase("tiny-cpu", total=8, unit="ranks ready", stream=stream)
    for ready in (1, 3, 3, 8):
        phase.to(ready)
    assert stream.getvalue() == ""  # nothing while it runs
    phase.close()
    phase.close()  # once
    [line] = stream.getvalue().splitlines()
    assert line.startswith("tiny-cpu: 8 of 8 ranks ready (") and line.endswith(" s)")


def test_a_phase_on_a_terminal_is_a_bar_that_counts() -> None:
    master, slave = terminal.open_terminal()
    with os.fdopen(slave, "w") as screen:
        assert console.on_terminal(screen)
        phase = console.Phase("tiny-cpu", total=8, unit="ranks ready", stream=screen)
        phase.to(3)
        phase.close()  # draws the bar as it ends
        screen.flush()
        shown = terminal.read_all(master)
    os.close(master)
    assert "tiny-cpu: 3 of 8 ranks ready" in shown


def test_a_terminal_without_a_size_gets_the_plain_line() -> None:
    """A fresh pseudo-terminal is 0x0 (``script``, ``docker exec -t`` before a resize): a bar would
    show nothing there, so it gets the plain line a log gets."""
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as screen:
        assert os.get_terminal_size(screen.fileno()).columns == 0
        assert not console.on_terminal(screen)
        phase = console.Phase("tiny-cpu", total=8, unit="ranks ready", stream=screen)
        phase.to(8)
        phase.close()
        screen.flush()
        shown = terminal.read_all(master)
    os.close(master)
    assert "tiny-cpu: 8 of 8 ranks ready (" in shown, repr(shown)


def test_the_variable_forces_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(console.FORCE_ENV, "bar")
    assert console.on_terminal(io.StringIO())
    monkeypatch.setenv(console.FORCE_ENV, "plain")
    master, slave = terminal.open_terminal()
    with os.fdopen(slave, "w") as screen:
        assert not console.on_terminal(screen)
    os.close(master)


def _tokenizer(path: Path) -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<unk>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    tokenizer.save(str(path))


def _prepare_command(tmp_path: Path) -> list[str]:
    _tokenizer(tmp_path / "tokenizer.json")
    lines = [json.dumps({"text": f"document {i}: the lazy dog"}) for i in range(300)]
    (tmp_path / "docs.jsonl").write_text("\n".join(lines) + "\n")
    return [
        sys.executable,
        "-m",
        "meshtrain.cli.main",
        "data",
        "prepare",
        str(tmp_path / "docs.jsonl"),
        "--tokenizer",
        str(tmp_path / "tokenizer.json"),
        "-o",
        str(tmp_path / "tokens.bin"),
    ]


def test_data_prepare_shows_a_bar_on_a_terminal_and_one_line_in_a_log(tmp_path: Path) -> None:
    command = _prepare_command(tmp_path)
    master, slave = terminal.open_terminal()
    proc = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    shown = terminal.read_all(master, proc)
    os.close(master)
    assert proc.wait(timeout=120) == 0, shown
    assert "tokenising into" in shown and "300 documents" in shown and "\r" in shown
    piped = subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)
    [line] = [x for x in piped.stderr.splitlines() if "tokenising" in x]
    assert "300 documents" in line and "\r" not in piped.stderr, piped.stderr
    assert "wrote" in piped.stdout  # the result on stdout, the progress on stderr


def test_export_reports_the_tensors_and_bytes_it_wrote(tmp_path: Path) -> None:
    config = gpt.GPTConfig.from_shape(api_model.ModelSpec(preset="tiny").shape())
    dense = dict(llama.build(config).named_parameters())
    told: list[tuple[int, int, int]] = []
    files = to_hf.write_sharded(
        tmp_path,
        config,
        {name: tuple(t.shape) for name, t in dense.items()},
        lambda names: {n: dense[n] for n in names},
        max_shard_bytes=200_000,
        written=lambda *report: told.append(report),
    )
    shards = [f for f in files if f.suffix == ".safetensors"]
    assert len(told) == len(shards) > 1  # once per shard
    tensors = nbytes = 0
    for shard in shards:  # the files as safetensors reads them
        with safe_open(str(shard), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                tensors += 1
                nbytes += handle.get_tensor(key).numel() * 4
    assert told[-1] == (tensors, nbytes, nbytes)
    assert [t[1] for t in told] == sorted(t[1] for t in told)


def test_sandbox_up_shows_each_finished_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shown = watch.StartProgress(tmp_path)
    (tmp_path / "supervisor.log").write_text(
        "2026-11-29 10:00:00 sandbox INFO control plane ready in 12.3s\n"
        "2026-11-29 10:00:01 sandbox INFO something else\n"
    )
    (tmp_path / "images.log").write_text(
        "[images    0s] building meshtrain-trainer:0.2.0 from trainer/Dockerfile ...\n"
        "[images   41s] built meshtrain-trainer:0.2.0 in 41s (1.2 GB)\n"
        "[images   45s] pushed 10.201.1.1:5000/meshtrain/trainer:0.2.0 in 4s\n"
        "[images   46s] done in"  # not a complete line yet
    )
    shown.poll()
    with (tmp_path / "images.log").open("a") as log:
        log.write(" 46s\n")
    shown.close("ready")
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "sandbox up: control plane ready in 12.3s",
        "sandbox up: built meshtrain-trainer:0.2.0 in 41s (1.2 GB)",
        "sandbox up: pushed 10.201.1.1:5000/meshtrain/trainer:0.2.0 in 4s",
        "sandbox up: done in 46s",
        lines[-1],
    ]
    assert lines[-1].startswith("sandbox up: 4 steps, done in 46s, ready (")


def test_every_step_images_sh_logs_is_one_the_sandbox_shows() -> None:
    """Each ``log "..."`` of scripts/images.sh, rendered with its shell expansions filled in, is
    a finished step (or a started one, ending in ``...``) by watch's patterns: a reworded log line
    fails here, not silently in the user's progress."""
    script = (Path(__file__).resolve().parents[2] / "scripts" / "images.sh").read_text()
    messages = re.findall(r'^\s*log "(.+)"$', script, flags=re.M)
    assert len(messages) >= 8, messages
    for message in messages:
        rendered = re.sub(r"\$\(\(.+?\)\)|\$\(.+?\)|\$\{#?\w+(\[@\])?\}|\$\w+", "7", message)
        line = f"[images   12s] {rendered}"
        assert watch.FINISHED.search(line) or watch.STARTED.search(line), line
