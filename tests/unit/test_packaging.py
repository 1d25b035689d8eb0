"""Packaging: the namespace portions, the wheel, and the console script.

The import name is the path: each portion root listed in pyproject's
``packages.find.where`` holds a ``meshtrain/`` tree, ``meshtrain`` itself is a
PEP 420 namespace package, and nothing at the repository root is a package.
"""

import importlib.metadata
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


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
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli.main", "version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("meshtrain ")


def test_built_wheel_holds_every_portion_and_imports_from_itself(tmp_path):
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
    wheel = next(tmp_path.glob("meshtrain-*.whl"))
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
    names = {
        re.split(r"[<>=!~ \[;]", requirement, maxsplit=1)[0].lower().replace("_", "-")
        for requirement in _config()["project"]["dependencies"]
    }
    imported_as = {
        module
        for module, dists in importlib.metadata.packages_distributions().items()
        if any(d.lower().replace("_", "-") in names - {"torch"} for d in dists)
        and module.isidentifier()
        and not module.startswith("_")
    }
    contract = next(
        c
        for c in _config()["tool"]["importlinter"]["contracts"]
        if c.get("source_modules") == ["meshtrain.trainer.models"]
    )
    missing = imported_as - set(contract["forbidden_modules"])
    assert not missing, f"add {sorted(missing)} to the models contract's forbidden_modules"
