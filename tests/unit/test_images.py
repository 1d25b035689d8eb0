"""Static checks of the operator and trainer Dockerfiles.

Each image: the base is pinned (digest or an exact x.y.z tag, never latest),
every package set is installed under requirements.lock's pins with pip's
cache as a build cache mount, the final stage runs as a numeric non-root
USER, the entrypoint is the meshtrain command, and the build context is
filtered by a .dockerignore.  The operator image lists every dependency in
pyproject.toml but the trainer's, and the operator runs without those.
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest
from packaging.specifiers import SpecifierSet

from tests.unit import test_packaging

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


LOCKS = {"13": "requirements.lock", "12": "requirements-cu12.lock"}
"""The trainer Dockerfile's ``--build-arg CUDA`` and the lock it installs (docs/install.md)."""
RUNTIME = re.compile(r"^nvidia-cuda-runtime(?:-cu(\d+))?==(\d+)\.", re.MULTILINE)
"""The CUDA runtime torch's wheel requires, as the lock pins it: its major is the image's CUDA."""
SUFFIX = re.compile(r"^nvidia-[a-z0-9-]+?-cu(\d+)==", re.MULTILINE)
"""An NVIDIA package named for its CUDA major (``nvidia-nccl-cu12``)."""


def _closure(lock: pathlib.Path) -> list[str]:
    """scripts/image-requirements.py's pins of torch and what it needs (the torch layer's)."""
    return test_packaging._image_requirements("closure", str(lock), "torch")


def _pins(lock: str) -> dict[str, str]:
    lines = [
        line for line in (ROOT / lock).read_text().splitlines() if "==" in line and line[0] != " "
    ]
    names = [line.partition("==")[0].lower() for line in lines]
    assert len(names) == len(set(names)), f"{lock}: a dependency pinned twice"
    return dict(line.split("==", 1) for line in lines)


def _build_stage_run(cuda: str, src: pathlib.Path) -> subprocess.CompletedProcess[str]:
    """The trainer build stage's RUN that chooses the lock, in ``src`` (WORKDIR /src) with CUDA set.

    The files its COPY instructions put in /src are copied there; ``/deps`` becomes ``src/deps``.
    """
    instructions = _instructions(ROOT / "trainer" / "Dockerfile")
    stage = instructions[: [i for i, (w, _) in enumerate(instructions) if w == "FROM"][1]]
    assert ("ARG", "CUDA") in stage, "the build stage does not see the CUDA argument"
    for word, rest in stage:
        if word == "COPY" and "--from" not in rest:
            *sources, _ = rest.split()
            for source in (s for s in sources if (ROOT / s).is_file()):
                name = pathlib.Path(source).name
                (src / name).write_bytes((ROOT / source).read_bytes())
    (run,) = [rest for word, rest in stage if word == "RUN" and "$CUDA" in rest]
    script = run.replace("/deps", str(src / "deps")).replace("python ", f"{sys.executable} ")
    return subprocess.run(
        ["sh", "-c", script],
        cwd=src,
        env={"CUDA": cuda, "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )


@pytest.mark.parametrize("cuda", sorted(LOCKS))
def test_the_cuda_argument_picks_its_lock_for_every_layer(
    cuda: str, tmp_path: pathlib.Path
) -> None:
    """Run the build stage's own RUN: the lock it copies is CUDA's, the torch layer's pins are that
    lock's, and the final stage installs every layer under that copy, not the repository's lock."""
    result = _build_stage_run(cuda, tmp_path)
    assert result.returncode == 0, result.stderr
    chosen = (tmp_path / "deps" / "requirements.lock").read_text()
    assert chosen == (ROOT / LOCKS[cuda]).read_text()
    torch_layer = (tmp_path / "deps" / "torch.txt").read_text().split()
    assert torch_layer == _closure(ROOT / LOCKS[cuda])
    runtime = RUNTIME.search("\n".join(torch_layer))
    assert runtime and runtime.group(2) == cuda, runtime
    instructions = _instructions(ROOT / "trainer" / "Dockerfile")
    args = _args(instructions)
    assert args["CUDA"] == "13", "the default image stays CUDA 13 (requirements.lock, CI's lock)"
    final = instructions[[i for i, (w, _) in enumerate(instructions) if w == "FROM"][-1] :]
    copies = [rest for word, rest in final if word == "COPY"]
    assert "--from=build /deps/requirements.lock /opt/requirements.lock" in copies
    assert not [c for c in copies if c.startswith("requirements")], copies
    ignore = (ROOT / "trainer" / "Dockerfile.dockerignore").read_text().splitlines()
    assert f"!{LOCKS[cuda]}" in ignore


def test_an_unknown_cuda_argument_fails_the_build_naming_it(tmp_path: pathlib.Path) -> None:
    result = _build_stage_run("11", tmp_path)
    assert result.returncode != 0
    assert "CUDA=11" in result.stderr and "13 or 12" in result.stderr
    assert not (tmp_path / "deps" / "requirements.lock").exists()


@pytest.mark.parametrize("cuda", sorted(LOCKS))
def test_each_locks_torch_pulls_the_cuda_libraries_of_its_major(cuda: str) -> None:
    """The lock's torch requires (as PyPI's wheel metadata says, through the resolver) the CUDA
    runtime of the image's major, and no NVIDIA package of another major."""
    closure = "\n".join(_closure(ROOT / LOCKS[cuda]))
    runtimes = RUNTIME.findall(closure)
    assert [major for _, major in runtimes] == [cuda], runtimes
    assert set(SUFFIX.findall(closure)) <= {cuda}
    assert set(SUFFIX.findall((ROOT / LOCKS[cuda]).read_text())) <= {cuda}


def test_the_cuda13_lock_is_what_the_installed_torch_requires() -> None:
    """.venv's torch comes from requirements.lock: its wheel's own requirements name CUDA 13."""
    requires = " ".join(importlib.metadata.requires("torch") or [])
    # torch 2.11 and later require CUDA through cuda-toolkit[cudart,...]==13.x
    assert re.search(r"cuda-toolkit\[[^\]]*cudart[^\]]*\]==13\.", requires), requires
    assert _pins("requirements.lock")["cuda-toolkit"].startswith("13.")
    assert _pins("requirements.lock")["torch"] == importlib.metadata.version("torch").split("+")[0]


def test_the_locks_differ_only_in_torch_and_what_it_needs() -> None:
    """Both images ship the same pins but torch's CUDA stack (make lock seeds the CUDA 12 lock
    with the CUDA 13 one); torch 2.10 is the CUDA 12 lock's, within pyproject's range."""
    cu13, cu12 = _pins(LOCKS["13"]), _pins(LOCKS["12"])
    torch_stack = {
        line.partition("==")[0] for lock in LOCKS.values() for line in _closure(ROOT / lock)
    }
    differ = {n for n in cu13.keys() | cu12.keys() if cu13.get(n) != cu12.get(n)}
    assert "torch" in differ and differ <= torch_stack, sorted(differ - torch_stack)
    assert cu12["torch"].startswith("2.10.")
    trainer = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    (torch_range,) = [
        r for r in trainer["optional-dependencies"]["trainer"] if re.match(r"torch[<>=]", r)
    ]
    spec = SpecifierSet(torch_range.removeprefix("torch"))
    assert cu12["torch"] in spec and cu13["torch"] in spec, torch_range
    assert not spec.contains("2.9.1"), "2.10 is the oldest torch make test-torch-oldest runs"


@pytest.mark.parametrize("cuda", sorted(LOCKS))
def test_make_lock_compiles_each_lock_as_its_header_says(cuda: str) -> None:
    makefile = re.sub(r"\\\n\s*", "", (ROOT / "Makefile").read_text())
    header = (ROOT / LOCKS[cuda]).read_text().splitlines()[1].strip("# ")
    assert header.startswith("uv pip compile pyproject.toml --all-extras")
    assert f"$(BIN)/{header} -q" in makefile, header
