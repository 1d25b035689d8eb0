"""pytest for the whole repository: the checkout's root after the standard library on ``sys.path``.

Tests import ``tests.*`` and ``benchmarks`` from the root (pyproject's
``pythonpath``).  Ahead of the standard library, where pytest puts it, the
root's ``operator/`` (meshtrain.operator's source) shadows the standard
library's ``operator`` for every fresh import: in torch.compile's worker
processes, which take ``sys.path`` as their PYTHONPATH (they died at start,
and compiles failed or silently ran eagerly), in the ranks tests spawn, and
in dynamo's polyfill of ``operator``, made once when ``torch._dynamo`` is
first imported.  So the root goes last: now, before dynamo is imported
here, and before each fixture and test.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def _root_last() -> None:
    def is_root(entry: str) -> bool:
        return Path(entry or os.getcwd()).resolve() == ROOT

    sys.path[:] = [entry for entry in sys.path if not is_root(entry)] + [str(ROOT)]


_root_last()
# dynamo's operator polyfill is made at its first import: with the standard library's operator
# (importing it here costs a few seconds in every pytest process)
import torch._dynamo  # noqa: E402,F401


@pytest.hookimpl(tryfirst=True)
def pytest_fixture_setup() -> None:
    """Before each fixture: pytest's prepend import mode puts the root first again whenever it
    imports a module from it, a test's package included when the test is set up."""
    _root_last()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call() -> None:
    """And before each test."""
    _root_last()
