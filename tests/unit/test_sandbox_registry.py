"""The sandbox registry's configuration: what the registry serves and what containerd reads."""

from __future__ import annotations

import pathlib
import socket
import tomllib

import pytest

from meshtrain.api import release
from meshtrain.sandbox import publish, registry
from meshtrain.sandbox.controlplane import binaries


def test_config_serves_plain_http_on_the_given_address_and_storage(tmp_path: pathlib.Path) -> None:
    config = registry.config(storage=tmp_path / "registry", host="10.201.7.1", port=5000)
    assert config["http"]["addr"] == "10.201.7.1:5000"
    assert "tls" not in config["http"]
    assert config["storage"]["filesystem"]["rootdirectory"] == str(tmp_path / "registry")


def test_hosts_toml_names_the_registry_over_plain_http(tmp_path: pathlib.Path) -> None:
    registry.write_hosts(tmp_path / "certs.d", "10.201.7.1:5000")
    hosts = tomllib.loads((tmp_path / "certs.d" / "10.201.7.1:5000" / "hosts.toml").read_text())
    assert hosts["server"] == "http://10.201.7.1:5000"
    assert hosts["host"]["http://10.201.7.1:5000"]["capabilities"] == ["pull", "resolve"]
    alias = (tmp_path / "certs.d" / registry.ALIAS / "hosts.toml").read_text()
    assert tomllib.loads(alias)["server"] == "http://10.201.7.1:5000"


def test_images_carry_the_one_version() -> None:
    names = registry.images("10.201.7.1:5000")
    assert names.operator == f"10.201.7.1:5000/meshtrain/operator:{release.VERSION}"
    assert names.trainer == f"10.201.7.1:5000/meshtrain/trainer:{release.VERSION}"


def test_free_port_moves_off_a_taken_port() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert registry.free_port("127.0.0.1", port) != port


def test_missing_binary_says_how_to_build_it(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MESHTRAIN_CACHE", str(tmp_path))
    with pytest.raises(binaries.BinariesMissingError, match="make bootstrap"):
        registry.locate()


def test_script_pins_the_same_version() -> None:
    script = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "bootstrap.sh"
    pin = f'REGISTRY_VERSION="${{MESHTRAIN_REGISTRY_VERSION:-{registry.DEFAULT_VERSION}}}"'
    assert pin in script.read_text()


def test_a_node_forgets_rebuilt_images_and_those_under_its_address() -> None:
    listing = (
        "REF TYPE DIGEST SIZE PLATFORMS LABELS\n"
        "registry.meshtrain.internal/meshtrain/trainer:0.2.0 app sha256:old 3.3GiB linux/amd64 -\n"
        "registry.meshtrain.internal/meshtrain/operator:0.2.0 app sha256:same 400MiB linux/amd64 -\n"
        "10.201.7.1:5000/meshtrain/trainer:0.2.0 app sha256:new 3.3GiB linux/amd64 -\n"
        "sha256:new app sha256:new 3.3GiB linux/amd64 -\n"
    )
    wanted = {
        "registry.meshtrain.internal/meshtrain/trainer:0.2.0": "sha256:new",
        "registry.meshtrain.internal/meshtrain/operator:0.2.0": "sha256:same",
    }
    assert publish.stale_names(listing, wanted, "10.201.7.1:5000") == [
        "registry.meshtrain.internal/meshtrain/trainer:0.2.0",
        "10.201.7.1:5000/meshtrain/trainer:0.2.0",
    ]


def test_install_names_both_repositories_and_the_one_version(tmp_path: pathlib.Path) -> None:
    argv = publish.install_command(
        tmp_path / "helm",
        "oci://10.201.7.1:5000/meshtrain/charts/meshtrain",
        host=registry.ALIAS,
        release_name="meshtrain",
        kubeconfig=tmp_path / "kubeconfig",
        namespace="meshtrain-system",
        overrides=[],
    )
    assert argv[1:4] == ["install", "meshtrain", "oci://10.201.7.1:5000/meshtrain/charts/meshtrain"]
    assert argv[argv.index("--version") + 1] == release.VERSION
    assert f"image.repository={registry.ALIAS}/meshtrain/operator" in argv
    assert f"trainer.image.repository={registry.ALIAS}/meshtrain/trainer" in argv
