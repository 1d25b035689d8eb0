"""Fixtures of the multi-process trainer tests (helpers live in mt_harness, importable by child processes)."""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

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


@pytest.fixture(scope="session")
def fake_nvml(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A directory holding ``libnvidia-ml.so.1`` built from ``fake_nvml.c``: NVML's few calls the
    GPU probe makes, answering as ``FAKE_NVML_*`` say (no GPU here; a process finds it through
    ``LD_LIBRARY_PATH``, as the NVIDIA container runtime's mount is found)."""
    compiler = shutil.which("gcc")
    assert compiler, "gcc is missing: apt-get install gcc (the machine's base image has it)"
    directory = tmp_path_factory.mktemp("fake-nvml")
    source = pathlib.Path(__file__).with_name("fake_nvml.c")
    library = directory / "libnvidia-ml.so.1"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", library, source],
        check=True,
    )
    return str(directory)
