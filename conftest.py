"""pytest for the whole repository: the checkout's root after the standard library on ``sys.path``.

Tests import ``tests.*`` and ``benchmarks`` from the root (pyproject's
``pythonpath``).  Ahead of the standard library, where pytest puts it, the
root's ``operator/`` (meshtrain.operator's source) shadows the standard
library's ``operator`` for every fresh import: in torch.compile's worker
processes, which take ``sys.path`` as their PYTHONPATH (they died at start,
and compiles failed or silently ran eagerly), in the ranks tests spawn, and
in dynamo's polyfill of ``operator``, made once when ``torch._dynamo`` is
first imported.  So the root goes last: now, before dynamo is imported
here, and before each test.
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
import torch._dynamo  # noqa: E402,F401 - its operator polyfill, made with the standard library's operator


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_call(item: pytest.Item) -> None:
    """Again before each test: pytest's prepend import mode puts the root first whenever it
    imports a module from it, up to the setup of a test's package."""
    _root_last()
