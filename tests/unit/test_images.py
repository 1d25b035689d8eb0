"""Static checks of the operator and trainer Dockerfiles (no Docker engine here).

Each image: the base is pinned (digest or an exact x.y.z tag, never latest),
the final stage runs as a numeric non-root USER, the entrypoint is the
meshtrain command, and the build context is filtered by a .dockerignore.
"""

from __future__ import annotations

import json
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "operator" / "Dockerfile", ROOT / "trainer" / "Dockerfile"]


def _instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", path.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def _args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
    return args


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_base_images_are_pinned(path: pathlib.Path) -> None:
    instructions = _instructions(path)
    args = _args(instructions)
    for word, rest in instructions:
        if word != "FROM":
            continue
        image = rest.split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], image)
        if image in {r.split()[-1] for w, r in instructions if w == "FROM" and " AS " in r.upper()}:
            continue  # a previous stage
        assert "@sha256:" in image or re.search(r":\d+\.\d+\.\d+[-\w.]*$", image), (
            f"{path}: base {image} not pinned"
        )
        assert not image.endswith(":latest")


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_final_stage_runs_as_numeric_non_root_user(path: pathlib.Path) -> None:
    instructions = _instructions(path)
    last_from = max(i for i, (w, _) in enumerate(instructions) if w == "FROM")
    users = [rest for w, rest in instructions[last_from:] if w == "USER"]
    assert users, f"{path}: no USER in the final stage"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) != 0


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_entrypoint_is_the_meshtrain_command(path: pathlib.Path) -> None:
    entrypoints = [rest for w, rest in _instructions(path) if w == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["meshtrain"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_context_is_filtered(path: pathlib.Path) -> None:
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    assert "*" in ignore and "!meshtrain/" in ignore


def test_trainer_installs_exact_torch_from_pypi_and_operator_has_no_torch() -> None:
    trainer = (ROOT / "trainer" / "Dockerfile").read_text()
    assert re.search(r"ARG TORCH_VERSION=\d+\.\d+\.\d+", trainer)
    assert '"torch==${TORCH_VERSION}"' in trainer
    runs = " ".join(
        rest for word, rest in _instructions(ROOT / "operator" / "Dockerfile") if word == "RUN"
    )
    assert "torch" not in runs


def test_operator_image_libraries_cover_the_operator_dependencies() -> None:
    """The operator image installs meshtrain --no-deps: it must list every non-trainer dependency."""
    text = (ROOT / "operator" / "Dockerfile").read_text()
    for lib in ("kopf", "kubernetes", "prometheus-client", "pyyaml", "pydantic"):
        assert f'"{lib}' in text, lib


def test_operator_runs_without_the_trainer_dependencies() -> None:
    """The operator image leaves out torch, numpy, matplotlib, tqdm and cryptography: the operator must not import them."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'matplotlib', 'tqdm', 'numpy', 'cryptography'):\n"
        "            raise ImportError('not in the operator image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import meshtrain.cli, meshtrain.operator.command, meshtrain.operator.handlers\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
