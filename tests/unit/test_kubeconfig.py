"""The kubeconfig lookup both Kubernetes clients use: kubectl's order, with $KUBECONFIG as a path list."""

from __future__ import annotations

import os

import kubernetes
import pytest

from meshtrain.operator.cluster import kubeconfig


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("KUBECONFIG", raising=False)
    return tmp_path


def _file(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("apiVersion: v1\nkind: Config\n")
    return str(path)


def test_an_explicit_kubeconfig_wins(home, monkeypatch):
    monkeypatch.setenv("KUBECONFIG", _file(home / "env"))
    assert kubeconfig.kubeconfig_paths("/given/config") == "/given/config"


def test_kubeconfig_is_a_path_list_of_the_files_that_exist(home, monkeypatch):
    a, b = _file(home / "a"), _file(home / "b")
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([a, str(home / "missing"), b]))
    assert kubeconfig.kubeconfig_paths() == os.pathsep.join([a, b])


def test_a_kubeconfig_naming_no_file_means_in_cluster_not_the_home_file(home, monkeypatch):
    _file(home / ".kube" / "config")
    monkeypatch.setenv("KUBECONFIG", str(home / "missing"))
    assert kubeconfig.kubeconfig_paths() is None


def test_home_config_when_kubeconfig_is_unset(home):
    assert kubeconfig.kubeconfig_paths() is None
    _file(home / ".kube" / "config")
    assert kubeconfig.kubeconfig_paths() == "~/.kube/config"


def test_the_client_merges_the_path_list(home, monkeypatch):
    """kubernetes' own loader reads both files of the list (contexts from each)."""
    for name in ("a", "b"):
        (home / name).write_text(
            f"apiVersion: v1\nkind: Config\ncurrent-context: {name}\n"
            f"contexts: [{{name: {name}, context: {{cluster: {name}, user: {name}}}}}]\n"
            f"clusters: [{{name: {name}, cluster: {{server: 'https://{name}.invalid'}}}}]\n"
            f"users: [{{name: {name}, user: {{token: t}}}}]\n"
        )
    monkeypatch.setenv("KUBECONFIG", os.pathsep.join([str(home / "a"), str(home / "b")]))
    contexts, _ = kubernetes.config.list_kube_config_contexts(
        config_file=kubeconfig.kubeconfig_paths()
    )
    assert {c["name"] for c in contexts} == {"a", "b"}
