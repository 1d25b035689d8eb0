"""How ``make test`` spreads the suite over two xdist workers (tests/conftest.py): a file runs
whole on one worker, and the files sharing a costly session run go to one worker together."""

from __future__ import annotations

import re
from pathlib import Path

from tests import conftest

ROOT = Path(__file__).resolve().parents[2]


def test_every_file_using_a_shared_run_is_listed_with_it() -> None:
    for fixture in set(conftest.SHARED_RUNS.values()):
        users = {
            str(path.relative_to(ROOT))
            for path in (ROOT / "tests").rglob("test_*.py")
            if re.search(rf"\b{fixture}\b", path.read_text())
        }
        listed = {path for path, name in conftest.SHARED_RUNS.items() if name == fixture}
        assert users == listed, f"files using {fixture}: list them in tests/conftest.py"


def test_a_file_is_one_unit_and_the_shared_runs_files_one_together() -> None:
    scope = conftest.SharedRunScheduling._split_scope
    prometheus, timeline = conftest.SHARED_RUNS
    unit = "tests/unit/test_spec.py"
    assert scope(None, f"{unit}::test_a[x]") == scope(None, f"{unit}::test_b") == unit
    assert scope(None, f"{prometheus}::test_a") == scope(None, f"{timeline}::test_b")
    assert scope(None, f"{prometheus}::test_a") != unit
