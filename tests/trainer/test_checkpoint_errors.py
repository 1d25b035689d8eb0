"""An exception on one rank while saving or loading a checkpoint stops every rank with the checkpoint code.

Two ``python -m meshtrain.trainer`` ranks in a gloo group, started with torchrun's environment (not
torchrun itself: it exits 1 whatever its workers exit with, and stops the others once one fails, so
it would hide the code each rank chose).  The last rank raises an OSError (the fault injection of
:mod:`meshtrain.trainer.checkpointing.checkpointer`); rank 0 must learn of it and exit
``exitcodes.CHECKPOINT`` too, within seconds, instead of waiting in the next collective until the
process group's timeout.  ``make test`` tier.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from meshtrain.api import exitcodes
from meshtrain.trainer import launch
from meshtrain.trainer.checkpointing import checkpointer, store
from tests.builders import JobBuilder

WORLD = 2
HANG = 120.0
"""Seconds after which a rank still running is hung (the process group's timeout is 300 s)."""


def _ranks(job: Path, root: Path, **extra: str) -> list[tuple[int, str]]:
    """Every rank's (exit code, stderr)."""
    port = str(launch.free_port())
    procs = []
    for rank in range(WORLD):
        env = {
            **launch.rank_env(rank, WORLD, int(port), root.parent / "rank-logs", cuda=False),
            "MESHTRAIN_CHECKPOINT_DIR": str(root),
            "OMP_NUM_THREADS": "1",
            **extra,
        }
        command = [sys.executable, "-m", "meshtrain.trainer", "--spec", str(job)]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        )
    results = []
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=HANG)
            results.append((proc.returncode, err.decode(errors="replace")))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [True, False])
def test_an_exception_on_one_rank_exits_every_rank_with_the_checkpoint_code(
    tmp_path: Path, async_save: bool
) -> None:
    raw = (
        JobBuilder.cpu_run()
        .layout(data=WORLD)
        .training(steps=4)
        .checkpoint(intervalSteps=2, keep=2, asyncSave=async_save)
        .raw()
    )
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(raw))
    root = tmp_path / "ckpt"

    saved = _ranks(job, root, **{checkpointer.FAULT_ENV: "4:raise"})
    assert [code for code, _ in saved] == [exitcodes.CHECKPOINT] * WORLD, saved[0][1][-3000:]
    for _, err in saved:
        assert f"injected fault on rank {WORLD - 1} while saving step 4" in err
    assert [p.step for p in store.scan(root)] == [2], "the failed save was not published"

    # a rank failing to make its DCP writer, before DCP's first collective: every rank exits 4 too
    setup = _ranks(job, root, **{checkpointer.FAULT_ENV: "4:writer"})
    assert [code for code, _ in setup] == [exitcodes.CHECKPOINT] * WORLD, setup[0][1][-3000:]
    for _, err in setup:
        assert f"injected fault on rank {WORLD - 1} while making the writer of" in err
    assert [p.step for p in store.scan(root)] == [2]

    loaded = _ranks(job, root, **{checkpointer.LOAD_FAULT_ENV: "raise"})
    assert [code for code, _ in loaded] == [exitcodes.CHECKPOINT] * WORLD, loaded[0][1][-3000:]
    for _, err in loaded:
        assert f"injected fault on rank {WORLD - 1} while loading {root / 'step-00000002'}" in err

    setup = _ranks(job, root, **{checkpointer.LOAD_FAULT_ENV: "reader"})
    assert [code for code, _ in setup] == [exitcodes.CHECKPOINT] * WORLD, setup[0][1][-3000:]
    for _, err in setup:
        assert f"injected fault on rank {WORLD - 1} while making the reader of" in err

    resumed = _ranks(job, root)
    assert [code for code, _ in resumed] == [0] * WORLD, resumed[0][1][-3000:]
    assert "resumed from" in resumed[0][1] and [p.step for p in store.scan(root)] == [2, 4]
