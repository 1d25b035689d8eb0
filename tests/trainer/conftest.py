"""Fixtures of the multi-process trainer tests (helpers live in mt_harness, importable by child processes)."""

from __future__ import annotations

import os

import pytest

from meshtrain.trainer.data import dataset


@pytest.fixture(scope="session", autouse=True)
def corpus_cache(tmp_path_factory: pytest.TempPathFactory):
    """Build the stdlib corpus once per session in a private cache; ranks inherit the env var."""
    directory = tmp_path_factory.mktemp("meshtrain-cache")
    old = os.environ.get("MESHTRAIN_CACHE_DIR")
    os.environ["MESHTRAIN_CACHE_DIR"] = str(directory)
    dataset.stdlib_corpus()
    yield directory
    if old is None:
        os.environ.pop("MESHTRAIN_CACHE_DIR", None)
    else:
        os.environ["MESHTRAIN_CACHE_DIR"] = old
