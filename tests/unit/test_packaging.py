"""Packaging: the namespace portions, the wheel, and the console script.

The import name is the path: each portion root listed in pyproject's
``packages.find.where`` holds a ``meshtrain/`` tree, ``meshtrain`` itself is a
PEP 420 namespace package, and nothing at the repository root is a package.
"""

import ast
import email
import importlib.metadata
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from meshtrain.api import release
from meshtrain.cli import extras

ROOT = Path(__file__).resolve().parents[2]
RUNTIME_EXTRAS = ("hf", "trainer", "operator", "tracking", "sandbox")
"""pyproject's extras a user installs (``test`` and ``dev`` are the project's tools)."""


def _portion_roots() -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [ROOT / where for where in config["tool"]["setuptools"]["packages"]["find"]["where"]]


def _modules(tree: Path) -> set[str]:
    """Repository-relative module paths under ``tree/meshtrain`` as ``meshtrain/...py``."""
    return {
        str(path.relative_to(tree))
        for path in (tree / "meshtrain").rglob("*.py")
        if "__pycache__" not in path.parts
    }


def test_no_folder_at_the_root_is_a_package():
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file())
    # tests/ and benchmarks/ are imported by the test suite from the checkout, never installed
    assert set(packages) <= {"tests", "benchmarks"}, packages


def test_the_checkout_root_on_the_path_shadows_nothing():
    """With the root first on sys.path, ``operator`` is still the standard library's."""
    probe = "import operator, tomllib; assert operator.eq(1, 1); print(operator.__file__)"
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(ROOT)},
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert not out.stdout.strip().startswith(str(ROOT)), out.stdout


def test_meshtrain_is_a_namespace_and_every_folder_below_it_a_package():
    for root in _portion_roots():
        namespace = root / "meshtrain"
        assert namespace.is_dir(), (
            f"{namespace.relative_to(ROOT)}: a portion root without meshtrain/"
        )
        assert not (namespace / "__init__.py").exists(), (
            "meshtrain is a namespace package (PEP 420)"
        )
        for folder in namespace.rglob("*"):
            if folder.is_dir() and folder.name != "__pycache__" and any(folder.glob("*.py")):
                assert (folder / "__init__.py").is_file(), (
                    f"{folder.relative_to(ROOT)} holds modules but no __init__.py"
                )


def test_no_module_is_in_two_portions():
    seen: dict[str, Path] = {}
    for root in _portion_roots():
        for module in _modules(root):
            if module.endswith("__init__.py") and module.count("/") == 1:
                continue
            assert module not in seen, f"{module} is in {seen[module]} and {root}"
            seen[module] = root


def test_console_script_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "usage: meshtrain" in out.stdout
    for version in ("version", "--version"):  # the subcommand and the flag
        out = subprocess.run(
            [sys.executable, "-m", "meshtrain.cli.main", version],
            capture_output=True,
            text=True,
            check=True,
        )
        assert out.stdout == f"meshtrain {release.VERSION}\n"


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> Path:
    """The wheel ``pip wheel`` builds from a clean copy of the sources."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    # from a clean copy of the sources: an in-tree build/ keeps modules that no longer exist
    source = tmp_path / "source"
    for name in ("pyproject.toml", "README.md"):
        source.mkdir(exist_ok=True)
        shutil.copy(ROOT / name, source / name)
    for root in _portion_roots():
        shutil.copytree(
            root / "meshtrain",
            source / root.relative_to(ROOT) / "meshtrain",
            ignore=shutil.ignore_patterns("__pycache__"),
        )
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--quiet",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(tmp_path),
            str(source),
        ],
        check=True,
    )
    return next(tmp_path.glob("meshtrain-*.whl"))


def test_built_wheel_holds_every_portion_and_imports_from_itself(built_wheel, tmp_path):
    wheel = built_wheel
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = set().union(*(_modules(root) for root in _portion_roots()))
    assert {n for n in names if n.endswith(".py")} == sources
    assert "meshtrain/planner/profiles/h200.yaml" in names, (
        "the planner's profiles are package data"
    )
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import meshtrain.api, meshtrain.operator, meshtrain.trainer, meshtrain.cli.main; "
        "paths = [m.__file__ for m in (meshtrain.api, meshtrain.operator, meshtrain.trainer)]; "
        f"assert all(p.startswith({str(unpacked)!r}) for p in paths), paths; "
        "meshtrain.cli.main.main(['version'])"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe],
        env={"PYTHONPATH": str(unpacked)},
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("meshtrain ")


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_of_the_namespace_is_under_the_import_contracts():
    """A new ``meshtrain.X`` must be a root package of import-linter, or no contract sees it."""
    on_disk = {
        f"meshtrain.{folder.name}"
        for root in _portion_roots()
        for folder in (root / "meshtrain").iterdir()
        if (folder / "__init__.py").is_file()
    }
    assert set(_config()["tool"]["importlinter"]["root_packages"]) == on_disk


def test_the_model_files_may_import_no_dependency_but_torch():
    """The models contract forbids every third-party dependency of pyproject but torch, by import name."""
    found = declared()
    names = set().union(found[""], *(found[extra] for extra in RUNTIME_EXTRAS))
    imported_as = import_names(names - {"torch"})
    contract = next(
        c
        for c in _config()["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["meshtrain.trainer.models"]
    )
    missing = imported_as - set(contract["forbidden_modules"])
    assert not missing, f"add {sorted(missing)} to the models contract's forbidden_modules"


def _expanded(lists: dict[str, list[str]], extra: str) -> set[str]:
    """Canonical distribution names ``extra`` brings, its ``meshtrain[...]`` self-references expanded."""
    names: set[str] = set()
    for line in lists[extra]:
        requirement = Requirement(line)
        if canonicalize_name(requirement.name) == "meshtrain":
            names |= set().union(*(_expanded(lists, inner) for inner in requirement.extras))
        else:
            names.add(canonicalize_name(requirement.name))
    return names


def declared() -> dict[str, set[str]]:
    """pyproject's distributions of the base ("") and of each extra (self-references expanded)."""
    project = _config()["project"]
    lists = {"": project["dependencies"], **project["optional-dependencies"]}
    return {extra: _expanded(lists, extra) for extra in lists}


def import_names(dists: set[str]) -> set[str]:
    """Top-level import names of the installed distributions ``dists`` (canonical names)."""
    return {
        module
        for module, owners in importlib.metadata.packages_distributions().items()
        if any(canonicalize_name(owner) in dists for owner in owners)
        and module.isidentifier()
        and not module.startswith("_")
    }


HEAVY = {"torch": "trainer", "kopf": "operator", "cryptography": "sandbox"}
"""What the base install must not bring, and the extra that brings each."""


def test_the_wheel_requires_no_torch_kopf_or_cryptography_but_its_extras_do(built_wheel):
    archive = zipfile.ZipFile(built_wheel)
    metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
    requirements = [
        Requirement(line)
        for line in email.message_from_bytes(archive.read(metadata)).get_all("Requires-Dist")
    ]
    wheel_extras = set(email.message_from_bytes(archive.read(metadata)).get_all("Provides-Extra"))
    assert wheel_extras >= {*RUNTIME_EXTRAS, "all", "test", "dev"}, wheel_extras

    def brought(extra: str) -> set[str]:
        names: set[str] = set()
        for requirement in requirements:
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": extra}):
                continue
            if canonicalize_name(requirement.name) == "meshtrain":
                names |= set().union(*(brought(inner) for inner in requirement.extras))
            else:
                names.add(canonicalize_name(requirement.name))
        return names

    base = brought("")
    assert not base & {*HEAVY, "kubernetes", "kubernetes-asyncio", "aiohttp"}, sorted(base)
    for name, extra in HEAVY.items():
        assert name in brought(extra), f"{name} is not in the {extra} extra"
        assert name in brought("all")
    assert {"kubernetes", "kubernetes-asyncio", "aiohttp"} <= brought("operator")
    assert {"tokenizers", "safetensors"} <= brought("hf") <= brought("trainer")
    assert brought("all") == set().union(*(brought(e) for e in RUNTIME_EXTRAS))
    assert not brought("trainer") & {"kopf", "cryptography"}
    assert not brought("operator") & {"torch", "cryptography"}


PORTION_EXTRAS = {
    ".": (),
    "trainer": ("trainer", "tracking"),
    "operator": ("operator",),
    "sandbox": ("sandbox",),
}
"""The extras whose packages each portion's modules may import besides the base's."""
MODULE_EXTRAS = {"meshtrain/cli/cluster_nodes.py": ("operator",)}
"""Modules of the base portion that need an extra (``plan --from-cluster`` checks for it first)."""


def _third_party_imports(path: Path) -> set[str]:
    """Top-level names of every non-stdlib, non-meshtrain import in ``path`` (lazy ones too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.partition(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.partition(".")[0])
    return names - set(sys.stdlib_module_names) - {"meshtrain", "__future__"}


def test_every_import_of_a_portion_is_declared_in_the_base_or_its_extras():
    found = declared()
    owners = importlib.metadata.packages_distributions()
    wrong = []
    for root in _portion_roots():
        allowed_extras = PORTION_EXTRAS[str(root.relative_to(ROOT))]
        for path in sorted((root / "meshtrain").rglob("*.py")):
            module = str(path.relative_to(root))
            allowed = set().union(
                found[""], *(found[e] for e in MODULE_EXTRAS.get(module, allowed_extras))
            )
            for name in sorted(_third_party_imports(path)):
                dists = {canonicalize_name(d) for d in owners.get(name, [])}
                if not dists & allowed:
                    wrong.append(f"{path.relative_to(ROOT)} imports {name} ({sorted(dists)})")
    assert not wrong, "declare these in pyproject (base or the portion's extra):\n" + "\n".join(
        wrong
    )


def test_the_cli_probes_each_extra_by_its_own_packages():
    """meshtrain.cli.extras.PROBES: the import names of exactly the packages each extra adds."""
    found = declared()
    for extra, probes in extras.PROBES.items():
        added = found[extra] - found[""]
        assert set(probes) <= import_names(added), f"{extra}: probes outside the extra"
        for dist in added:
            assert import_names({dist}) & set(probes), f"{extra}: nothing probes {dist}"


def _image_requirements(*args: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/image-requirements.py"), *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    ("dockerfile", "image_extras"),
    [("trainer/Dockerfile", "trainer,tracking,hf"), ("operator/Dockerfile", "operator")],
)
def test_each_image_installs_its_extras_from_pyproject_and_the_lock(dockerfile, image_extras):
    text = (ROOT / dockerfile).read_text()
    # the dependency layer's list and the final install name the same extras
    assert f"image-requirements.py extras pyproject.toml {image_extras} " in text
    assert f"'meshtrain[{image_extras}]'" in text and "-c /opt/requirements.lock" in text
    listed = {
        canonicalize_name(Requirement(r).name)
        for r in _image_requirements("extras", str(ROOT / "pyproject.toml"), image_extras)
    }
    found = declared()
    assert listed == set().union(found[""], *(found[e] for e in image_extras.split(",")))


def test_the_torch_layer_is_constrained_by_the_locks_pins_of_torch_and_its_needs():
    lock = (ROOT / "requirements.lock").read_text().splitlines()
    closure = _image_requirements("closure", str(ROOT / "requirements.lock"), "torch")
    assert set(closure) <= set(lock), "a pin the lock does not hold"
    names = {line.partition("==")[0] for line in closure}
    needed = {
        canonicalize_name(Requirement(r).name)
        for r in importlib.metadata.requires("torch")
        if Requirement(r).marker is None or Requirement(r).marker.evaluate({"extra": ""})
    }
    assert "torch" in names and needed <= names, sorted(needed - names)
    assert not names & {"kopf", "cryptography", "tokenizers", "matplotlib"}
