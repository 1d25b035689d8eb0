"""Static checks of the operator and trainer Dockerfiles.

Each image: the base is pinned (digest or an exact x.y.z tag, never latest),
every package set is installed under requirements.lock's pins with pip's
cache as a build cache mount, the final stage runs as a numeric non-root
USER, the entrypoint is the meshtrain command, and the build context is
filtered by a .dockerignore.  The operator image lists every dependency in
pyproject.toml but the trainer's, and the operator runs without those.
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
def test_the_user_has_a_passwd_entry(path: pathlib.Path) -> None:
    """getpass.getuser() (kopf's peer identity) raises for a uid without one: the operator crash-looped."""
    instructions = _instructions(path)
    last_from = max(i for i, (w, _) in enumerate(instructions) if w == "FROM")
    final = instructions[last_from:]
    uid = [rest for w, rest in final if w == "USER"][-1].split(":")[0]
    runs = " ".join(rest for w, rest in final if w == "RUN")
    assert re.search(rf"useradd .*--uid {uid}\b", runs), f"{path}: no passwd entry for uid {uid}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_entrypoint_is_the_meshtrain_command(path: pathlib.Path) -> None:
    entrypoints = [rest for w, rest in _instructions(path) if w == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["meshtrain"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_context_is_filtered(path: pathlib.Path) -> None:
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    assert "*" in ignore and "!meshtrain/" in ignore


TRAINER_ONLY = (
    "torch",
    "numpy",
    "tqdm",
    "matplotlib",
    "cryptography",
    "safetensors",
    "tokenizers",
    "fsspec",
    "s3fs",
)
"""Dependencies the operator never imports: the image leaves out the trainer, hf and sandbox
extras' ones; numpy, tqdm and matplotlib come with the light base but the operator must not pay
for importing them."""


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_every_pip_install_is_constrained_by_the_lock(path: pathlib.Path) -> None:
    """One lock pins .venv, CI and both images: each install of a package set names it as
    constraints (the torch layer the lock's own pins of torch and what it needs, /opt/torch.txt,
    which test_packaging holds to the lock), and every install that downloads has pip's cache."""
    installs = [
        rest
        for word, rest in _instructions(path)
        if word == "RUN" and "pip install" in rest and "--no-deps" not in rest
    ]
    assert installs, f"{path}: no pip install"
    for rest in installs:
        assert "-c /opt/requirements.lock" in rest or "-c /opt/torch.txt" in rest, f"{path}: {rest}"
        if "--no-index" not in rest:
            assert "--mount=type=cache,target=/var/cache/pip" in rest, (
                f"{path}: no pip cache mount: {rest}"
            )
    ignore = path.with_name(path.name + ".dockerignore").read_text().splitlines()
    assert "!requirements.lock" in ignore


def test_trainer_installs_through_its_extras_and_operator_has_no_torch() -> None:
    trainer = (ROOT / "trainer" / "Dockerfile").read_text()
    assert "'meshtrain[trainer,tracking,hf]'" in trainer
    runs = " ".join(
        rest for word, rest in _instructions(ROOT / "operator" / "Dockerfile") if word == "RUN"
    )
    assert "torch" not in runs and "'meshtrain[operator]'" in runs


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.parent.name)
def test_meshtrain_itself_installs_offline_so_a_missing_dependency_fails_the_build(
    path: pathlib.Path,
) -> None:
    """The image's last install resolves meshtrain's requirements (base and extras) from what the
    layers above installed, with no index: a dependency they missed is a build error, not an
    ImportError in a pod."""
    finals = [
        rest
        for word, rest in _instructions(path)
        if word == "RUN" and "pip install" in rest and "'meshtrain[" in rest
    ]
    assert len(finals) == 1, finals
    assert "--no-index" in finals[0] and "--no-deps" not in finals[0], finals[0]


def test_operator_runs_without_the_trainer_dependencies() -> None:
    """The operator image leaves out the trainer's dependencies: the operator must not import them."""
    code = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name.split('.')[0] in {TRAINER_ONLY!r}:\n"
        "            raise ImportError('not in the operator image: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import meshtrain.cli.main, meshtrain.operator.command, meshtrain.operator.handlers\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
