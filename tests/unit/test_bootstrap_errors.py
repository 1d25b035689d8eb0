"""scripts/bootstrap.sh fails clearly, and agrees with meshtrain.sandbox.controlplane.binaries.

Fast: nothing is built. Each case points MESHTRAIN_CACHE at an empty tmp dir
and passes --no-prometheus, so the script stops before any build or apt step.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import pytest

from meshtrain.sandbox import network_policies
from meshtrain.sandbox.controlplane import binaries, kueue

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh"
# Tools the script runs before it looks for Go.
_TOOLS = (
    "bash",
    "env",
    "sed",
    "grep",
    "mkdir",
    "readlink",
    "cut",
    "tr",
    "sort",
    "head",
    "tail",
    "wc",
    "id",
    "du",
)


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


def _env(tmp_path: pathlib.Path, **extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("KUBEBUILDER_ASSETS", "MESHTRAIN_K8S_VERSION")
    }
    env["MESHTRAIN_CACHE"] = str(tmp_path / "cache")
    env.update(extra)
    return env


def test_unknown_kubernetes_version_names_it_and_lists_real_ones(tmp_path: pathlib.Path) -> None:
    if shutil.which("go") is None:
        pytest.fail("this test needs Go on PATH (the bootstrap asks the module proxy)")
    result = _run(_env(tmp_path, MESHTRAIN_K8S_VERSION="v9.9.9"), "--no-prometheus")
    assert result.returncode != 0
    assert "v9.9.9" in result.stderr
    assert "does not exist on the Go module proxy" in result.stderr
    latest = re.search(r"Latest available: (.*)", result.stderr)
    assert latest and re.search(r"v1\.\d+\.\d+", latest.group(1)), result.stderr


def test_missing_go_is_reported_with_how_to_install(tmp_path: pathlib.Path) -> None:
    # A PATH with only the basic tools: symlinks in a fresh dir, never Go.
    shim = tmp_path / "bin"
    shim.mkdir()
    for tool in _TOOLS:
        found = shutil.which(tool)
        assert found, f"{tool} not found"
        (shim / tool).symlink_to(found)
    result = _run(_env(tmp_path, PATH=str(shim)), "--no-prometheus")
    assert result.returncode != 0
    assert "Go is missing" in result.stderr
    assert "go.dev" in result.stderr
    assert "Go >= 1." in result.stderr


def test_too_old_go_is_reported_with_the_required_version(tmp_path: pathlib.Path) -> None:
    real_go = shutil.which("go")
    if real_go is None:
        pytest.fail("this test needs Go on PATH (the bootstrap asks the module proxy)")
    # A `go` that claims to be 1.20 and otherwise is the real one.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "go").write_text(
        "#!/bin/sh\n"
        'if [ "$1 $2" = "env GOVERSION" ]; then echo go1.20.0; exit 0; fi\n'
        f'exec {real_go} "$@"\n'
    )
    (shim / "go").chmod(0o755)
    result = _run(_env(tmp_path, PATH=f"{shim}:{os.environ['PATH']}"), "--no-prometheus")
    assert result.returncode != 0
    assert "Go 1.20.0 is too old" in result.stderr
    assert re.search(r"needs Go >= 1\.\d+", result.stderr), result.stderr
    assert "go.dev" in result.stderr


def test_print_bin_dir_builds_nothing_and_matches_the_python_lookup(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = _env(tmp_path)
    result = _run(env, "--print-bin-dir")
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("MESHTRAIN_CACHE", env["MESHTRAIN_CACHE"])
    monkeypatch.delenv("MESHTRAIN_K8S_VERSION", raising=False)
    assert result.stdout.strip() == str(binaries.cache_bin_dir())
    assert not (tmp_path / "cache").exists()


def test_script_and_python_pin_the_same_versions() -> None:
    text = SCRIPT.read_text()
    assert f'K8S_VERSION="${{MESHTRAIN_K8S_VERSION:-{binaries.DEFAULT_K8S_VERSION}}}"' in text
    assert f'HELM_VERSION="${{MESHTRAIN_HELM_VERSION:-{binaries.DEFAULT_HELM_VERSION}}}"' in text
    assert (
        f'PROMETHEUS_OPERATOR_VERSION="${{MESHTRAIN_PROMETHEUS_OPERATOR_VERSION:-'
        f'{binaries.DEFAULT_PROMETHEUS_OPERATOR_VERSION}}}"'
    ) in text
    assert f"MONITORING_CRDS=({' '.join(binaries.MONITORING_CRDS)})" in text
    assert (
        f'NVIDIA_DRA_DRIVER_VERSION="${{MESHTRAIN_NVIDIA_DRA_DRIVER_VERSION:-'
        f'{binaries.DEFAULT_NVIDIA_DRA_DRIVER_VERSION}}}"'
    ) in text
    assert f'KUEUE_VERSION="${{MESHTRAIN_KUEUE_VERSION:-{kueue.DEFAULT_KUEUE_VERSION}}}"' in text
    assert (
        f'KUBE_ROUTER_VERSION="${{MESHTRAIN_KUBE_ROUTER_VERSION:-'
        f'{network_policies.DEFAULT_VERSION}}}"'
    ) in text


def test_missing_binaries_error_says_how_to_get_them(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    monkeypatch.delenv("KUBEBUILDER_ASSETS", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(binaries.BinariesMissingError, match="make bootstrap"):
        binaries.locate()
