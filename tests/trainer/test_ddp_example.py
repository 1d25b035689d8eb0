"""The shipped DDP example survives a preemption: SIGTERM saves the step it reached, a rerun resumes there."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]


def _torchrun(checkpoint_dir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
         "-m", "meshtrain.examples.ddp", "--steps", str(steps), "--checkpoint-every", "5"],
        env={**os.environ, "MESHTRAIN_CHECKPOINT_DIR": str(checkpoint_dir), "OMP_NUM_THREADS": "1"},
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def _finish(run: subprocess.Popen) -> str:
    output, _ = run.communicate(timeout=120)
    return output


def _saved_steps(output: str) -> list[int]:
    return [int(s) for s in re.findall(r"^saved step (\d+) to ", output, re.MULTILINE)]


@pytest.mark.slow
def test_sigterm_saves_the_reached_step_and_a_rerun_resumes_there(tmp_path):
    preempted, reference = tmp_path / "preempted", tmp_path / "reference"
    preempted.mkdir(), reference.mkdir()
    run = _torchrun(preempted, steps=1_000_000)  # cannot finish before the signal
    seen = []
    for line in run.stdout:
        seen.append(line)
        if line.startswith("saved step 10 "):  # two periodic checkpoints: training is under way
            break
    else:
        pytest.fail("no periodic checkpoint before the program ended:\n" + "".join(seen)[-3000:])
    run.send_signal(signal.SIGTERM)  # what the kubelet sends torchrun when Kueue evicts the pod
    output = "".join(seen) + _finish(run)
    assert run.returncode != 0, "a stopped run is not a finished one"
    saved = _saved_steps(output)
    stopped_at = saved[-1]
    assert f"saved step {stopped_at} to " in output and output.count("(SIGTERM)") == 1, output[
        -3000:
    ]
    assert saved[:2] == [5, 10] and stopped_at >= 10, output[-3000:]
    assert torch.load(preempted / "ddp-example.pt")["step"] == stopped_at
    assert not (preempted / "ddp-example.tmp").exists()

    total = stopped_at + 3
    rerun = _torchrun(preempted, steps=total)
    resumed = _finish(rerun)
    assert rerun.returncode == 0, resumed
    assert f"(step {stopped_at})" in re.search(r"resumed from .*", resumed).group(0), resumed
    assert _saved_steps(resumed)[-1] == total, resumed
    assert "step 0 loss" not in resumed, "the resumed run does not start over"

    # An uninterrupted run of the same length is the reference for the resumed weights.
    straight = _finish(_torchrun(reference, steps=total))
    assert _saved_steps(straight)[-1] == total, straight
    got = torch.load(preempted / "ddp-example.pt")["model"]
    want = torch.load(reference / "ddp-example.pt")["model"]
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor, rtol=1e-6, atol=1e-7)
