"""Every file of the fuzz corpus through ``meshtrain validate`` and ``meshtrain plan`` (issue #32
item 8; unit tier, ``make test``).

Each is refused by both, with the same message naming the field (or what is wrong with the
file), no traceback, within 2 s of CPU time and 200 MB of memory.  Each command runs in a
process of its own: forked from this one after the import (the CLI's entry point, its exit
status and output; a few hundred interpreter starts would take minutes), and for a sample of
files the installed console script itself.  CPU time and peak RSS are the child's own
(``os.wait4``), so the other processes of a busy machine do not count.  Valid jobs at the
bounds are accepted, so the bounds are not too tight.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path
from typing import IO

import pytest
import yaml

from meshtrain.cli import main
from tests import fuzz_corpus

MAX_CPU_SECONDS = 2.0
MAX_RSS_BYTES = 200 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class Run:
    """One command's outcome."""

    code: int
    """Exit status."""
    stdout: str
    """What it printed."""
    stderr: str
    """What it printed as errors."""
    cpu_seconds: float
    """User and system time of the command itself."""
    rss_bytes: int
    """Its peak resident memory (a forked child: the interpreter's allowance plus what it grew)."""


INTERPRETER_BYTES = 64 * 1024 * 1024
"""What a forked child counts for the interpreter and the CLI's imports, which it inherits
(the console script, measured whole, needs about 40 MB for them)."""


def _measured(pid: int, out: IO[bytes], err: IO[bytes], grown: IO[bytes] | None = None) -> Run:
    _, status, usage = os.wait4(pid, 0)
    rss_bytes = usage.ru_maxrss * 1024
    if grown is not None:  # the parent's pages, a test run's torch among them, are not the child's
        grown.seek(0)
        rss_bytes = INTERPRETER_BYTES + int(grown.read() or 1 << 40)
    out.seek(0)
    err.seek(0)
    return Run(
        code=os.waitstatus_to_exitcode(status),
        stdout=out.read().decode(errors="replace"),
        stderr=err.read().decode(errors="replace"),
        cpu_seconds=usage.ru_utime + usage.ru_stime,
        rss_bytes=rss_bytes,
    )


def _forked(*args: str) -> Run:
    """``meshtrain ARGS`` through the CLI's entry point in a forked child (killed after 60 s)."""
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        tempfile.TemporaryFile() as grown,
    ):
        pid = os.fork()
        if pid == 0:  # the child: a user's process from here on
            code = 70
            inherited = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            try:
                signal.alarm(60)
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115 - the child's own stdout
                sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
                code = main.main(list(args))
            except SystemExit as stop:
                code = stop.code if isinstance(stop.code, int) else 1
            except BaseException:  # noqa: BLE001 - what a user would see: the traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
                os.write(grown.fileno(), str((peak - inherited) * 1024).encode())
                os._exit(code)
        return _measured(pid, out, err, grown)


LAUNCHER = """
import os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[2], sys.argv[2:])
_, status, usage = os.wait4(pid, 0)
with open(sys.argv[1], "w") as report:
    report.write(f"{usage.ru_maxrss * 1024} {usage.ru_utime + usage.ru_stime}")
sys.exit(os.waitstatus_to_exitcode(status))
"""
"""Runs a command and reports its peak RSS and CPU time.  A child forked by this test process
would count this process's pages (Linux carries the peak RSS over fork and exec); one forked
by a fresh small interpreter counts only its own."""


def _console(*args: str) -> Run:
    """The installed ``meshtrain`` console script, as a user types it."""
    script = Path(sys.executable).with_name("meshtrain")
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "usage"
        child = subprocess.run(
            [sys.executable, "-c", LAUNCHER, str(report), str(script), *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        rss, cpu = report.read_text().split()
    return Run(child.returncode, child.stdout, child.stderr, float(cpu), int(rss))


@pytest.fixture(scope="module")
def verdicts() -> dict[str, tuple[Run, Run]]:
    """(validate, plan) of every corpus file, two at a time."""

    found = {}
    for name in fuzz_corpus.INDEX:
        path = str(fuzz_corpus.CASES / name)
        found[name] = (_forked("validate", path), _forked("plan", path))
    return found


def test_the_corpus_is_large_and_covers_every_kind():
    assert len(fuzz_corpus.INDEX) >= 100
    names = " ".join(fuzz_corpus.INDEX)
    for kind in ("binary", "deep-nesting", "2-pow-70", "unicode", "alias-bomb", "duplicate",
                 "traversal", "above-parallelism-data", "inf", "nan", "bool", "oversized"):  # fmt: skip
        assert kind in names, kind


@pytest.mark.parametrize("name", list(fuzz_corpus.INDEX))
def test_validate_and_plan_refuse_it_alike_naming_the_field(verdicts, name):
    validate, plan = verdicts[name]
    names = fuzz_corpus.INDEX[name]["names"]
    for run in (validate, plan):
        assert run.code == 2, run
        assert "Traceback" not in run.stderr, run.stderr
        assert names in run.stderr, (names, run.stderr)
        assert run.cpu_seconds < MAX_CPU_SECONDS, run
        assert run.rss_bytes < MAX_RSS_BYTES, run
    assert plan.stderr == f"meshtrain plan: {validate.stderr}"  # the same verdict, word for word


@pytest.mark.parametrize(
    "name",
    ["data-2-pow-70.yaml", "alias-bomb.yaml", "binary-random.yaml", "checkpoint-traversal.yaml"],
)
def test_the_console_script_gives_the_same_verdict(verdicts, name):
    for command, forked in zip(("validate", "plan"), verdicts[name], strict=True):
        run = _console(command, str(fuzz_corpus.CASES / name))
        assert (run.code, run.stderr) == (forked.code, forked.stderr)
        assert run.cpu_seconds < MAX_CPU_SECONDS and run.rss_bytes < MAX_RSS_BYTES, run


@pytest.mark.parametrize("name", list(fuzz_corpus.VALID_AT_BOUNDS))
def test_a_job_at_the_bounds_is_accepted(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(fuzz_corpus.VALID_AT_BOUNDS[name]))
    validate, plan = _forked("validate", str(path)), _forked("plan", str(path))
    assert validate.code == 0, validate.stderr
    # accepted: planned, not refused (2); a job at the bounds may not fit a device (exit 3, issue 37)
    assert plan.code == 0 or (plan.code == 3 and "DOES NOT FIT" in plan.stdout), plan.stderr
