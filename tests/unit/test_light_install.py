"""The light install: the base commands run with no extra's package importable, and a command
that needs an extra says which one.

Each command runs in a subprocess whose ``sitecustomize`` (tests/unit/blocked_imports) makes every
package that pyproject declares only in extras unimportable, as a ``pip install meshtrain`` without
extras would leave them; it also records every blocked name a process tried, even one whose
ImportError the code caught, so a command that merely tries torch fails here too.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshtrain.cli import extras
from tests.unit import test_packaging, test_telemetry_timeline

ROOT = Path(__file__).resolve().parents[2]
BLOCKER = Path(__file__).with_name("blocked_imports")
EXAMPLE = ROOT / "manifests/examples/tiny-cpu.yaml"
ISSUE_LIST = {"torch", "kopf", "kubernetes", "kubernetes_asyncio", "aiohttp", "cryptography"}
"""What issue 37 names: the base install runs without any of these."""


def extras_only() -> set[str]:
    """Import names of every package pyproject requires in a runtime extra but not in the base."""
    declared = test_packaging.declared()
    dists = set().union(*(declared[e] for e in test_packaging.RUNTIME_EXTRAS)) - declared[""]
    return test_packaging.import_names(dists)


def meshtrain(
    args: list[str], tmp_path: Path, blocked: set[str], module: str = "meshtrain.cli.main"
) -> subprocess.CompletedProcess:
    """``python -m MODULE ARGS`` with ``blocked`` unimportable; the names it tried are in .tried."""
    tried = tmp_path / "tried.txt"
    tried.unlink(missing_ok=True)
    env = dict(
        os.environ,
        PYTHONPATH=str(BLOCKER),
        MESHTRAIN_BLOCKED_IMPORTS=",".join(sorted(blocked)),
        MESHTRAIN_BLOCKED_REPORT=str(tried),
        MPLBACKEND="Agg",
        MESHTRAIN_SANDBOX_DIR=str(tmp_path / "sandbox"),
    )
    out = subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    out.tried = set(tried.read_text().split()) if tried.exists() else set()  # type: ignore[attr-defined]
    return out


def test_the_blocked_set_holds_what_the_issue_names_and_blocks_it(tmp_path):
    blocked = extras_only()
    assert blocked >= ISSUE_LIST, sorted(ISSUE_LIST - blocked)
    probe = subprocess.run(
        [sys.executable, "-c", "import torch"],
        env=dict(os.environ, PYTHONPATH=str(BLOCKER), MESHTRAIN_BLOCKED_IMPORTS="torch"),
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "No module named 'torch' (blocked)" in probe.stderr


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small dp2 x pp2 run's log directory (steps.jsonl and trace/rank-N.jsonl)."""
    return test_telemetry_timeline.run(tmp_path_factory.mktemp("run"), "1f1b", 2, 4, dp=2, steps=2)


BASE_COMMANDS = {
    "help": (["--help"], "usage: meshtrain"),
    "version-flag": (["--version"], "meshtrain "),
    "version": (["version"], "meshtrain "),
    "validate": (["validate", str(EXAMPLE)], "valid TrainingJob"),
    "plan": (["plan", str(EXAMPLE)], "step"),
    "crd": (["crd"], "CustomResourceDefinition"),
    "run-help": (["run", "--help"], "usage: meshtrain run"),
}


@pytest.mark.parametrize("case", sorted(BASE_COMMANDS))
def test_base_commands_run_without_any_extra(case, tmp_path):
    args, expected = BASE_COMMANDS[case]
    out = meshtrain(args, tmp_path, extras_only())
    assert out.returncode == 0, out.stderr
    assert expected in out.stdout
    assert not out.tried, f"meshtrain {' '.join(args)} tried to import {sorted(out.tried)}"


def test_the_sandbox_commands_parse_their_arguments_without_any_extra(tmp_path):
    out = meshtrain(["--help"], tmp_path, extras_only(), module="meshtrain.sandbox")
    assert out.returncode == 0, out.stderr
    assert "run-example" in out.stdout
    assert not out.tried, f"the sandbox's --help tried to import {sorted(out.tried)}"


def test_the_sandbox_without_its_extra_names_it(tmp_path):
    out = meshtrain(["up"], tmp_path, extras_only(), module="meshtrain.sandbox")
    assert out.returncode == extras.EXIT_CODE, (out.returncode, out.stderr)
    line = (
        "python -m meshtrain.sandbox up needs the sandbox extra: pip install 'meshtrain[sandbox]'"
    )
    assert line in out.stderr and "Traceback" not in out.stderr


def test_report_and_timeline_of_a_run_without_any_extra(run_dir, tmp_path):
    for args, picture in (
        (["report", str(run_dir), "-o", "report.html"], tmp_path / "report.html"),
        (["timeline", str(run_dir), "-o", "timeline.png"], tmp_path / "timeline.png"),
    ):
        out = meshtrain(args, tmp_path, extras_only())
        assert out.returncode == 0, out.stderr
        assert picture.stat().st_size > 1000, f"{picture.name} was not drawn"
        assert not out.tried, f"meshtrain {args[0]} tried to import {sorted(out.tried)}"


NEEDS_AN_EXTRA = {
    "run": (["run", str(EXAMPLE)], "meshtrain run", "trainer"),
    "export": (["export", "ckpt", "-o", "hf"], "meshtrain export", "trainer"),
    "data": (
        ["data", "prepare", "in.txt", "--tokenizer", "t.json", "-o", "out.bin"],
        "meshtrain data",
        "hf",
    ),
    "operator": (["operator"], "meshtrain operator", "operator"),
    "operator-help": (["operator", "--help"], "meshtrain operator", "operator"),
    "calibrate": (["plan", "--calibrate", str(EXAMPLE)], "meshtrain plan --calibrate", "trainer"),
    "from-cluster": (
        ["plan", "--from-cluster", str(EXAMPLE)],
        "meshtrain plan --from-cluster",
        "operator",
    ),
}


@pytest.mark.parametrize("case", sorted(NEEDS_AN_EXTRA))
def test_a_command_without_its_extra_names_the_extra_and_the_install_line(case, tmp_path):
    args, command, extra = NEEDS_AN_EXTRA[case]
    out = meshtrain(args, tmp_path, extras_only())
    assert out.returncode == extras.EXIT_CODE, (out.returncode, out.stderr)
    line = f"{command} needs the {extra} extra: pip install 'meshtrain[{extra}]'"
    assert line in out.stderr
    assert "Traceback" not in out.stderr


def test_the_extra_alone_is_enough_for_its_command(tmp_path):
    """With the operator's and the sandbox's own packages blocked, ``meshtrain run`` passes the check."""
    out = meshtrain(
        ["run", str(tmp_path / "missing.yaml")],
        tmp_path,
        {"kopf", "kubernetes_asyncio", "cryptography"},
    )
    assert out.returncode not in (0, extras.EXIT_CODE), out.stderr
    assert "needs the" not in out.stderr and "missing.yaml" in out.stderr
