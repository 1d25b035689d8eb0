"""Packaging: the folder-to-namespace mapping, the wheel, and the console script."""

import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = {
    "meshtrain": "meshtrain",
    "meshtrain.operator": "operator",
    "meshtrain.trainer": "trainer",
}


def _declared_packages() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return set(config["tool"]["setuptools"]["packages"])


def _packages_on_disk() -> set[str]:
    found = set()
    for namespace, folder in PACKAGE_DIRS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder)
            found.add(".".join([namespace, *relative.parts]) if relative.parts else namespace)
    return {
        p
        for p in found
        if not any(part.startswith(".") or part == "__pycache__" for part in p.split("."))
    }


def test_every_package_folder_is_declared_in_pyproject():
    missing = _packages_on_disk() - _declared_packages()
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


def test_console_script_help_and_version():
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "usage: meshtrain" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "meshtrain.cli", "version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("meshtrain ")


def test_built_wheel_imports_operator_and_trainer_namespaces(tmp_path):
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
            str(ROOT),
        ],
        check=True,
    )
    wheel = next(tmp_path.glob("meshtrain-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert "meshtrain/operator/__init__.py" in names and "meshtrain/trainer/__init__.py" in names
    assert not any(n.startswith(("operator/", "trainer/")) for n in names), (
        "folders must not leak as top-level packages"
    )
    unpacked = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(unpacked)
    probe = (
        "import meshtrain, meshtrain.operator, meshtrain.trainer, meshtrain.cli; "
        f"assert meshtrain.__file__.startswith({str(unpacked)!r}), meshtrain.__file__; "
        "meshtrain.cli.main(['version'])"
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
