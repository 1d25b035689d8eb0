"""The local control plane behaves like a real cluster's API, because it is one.

Uses a small test CRD (``Gadget``, group ``testing.meshtrain.io``), not the
TrainingJob CRD, so these tests only say something about the control plane.
"""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import kubernetes
import pytest
import yaml
from kubernetes.client.rest import ApiException

from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import binaries, ports

pytestmark = pytest.mark.integration

GROUP, VERSION, PLURAL = "testing.meshtrain.io", "v1", "gadgets"


def gadget_crd() -> dict[str, Any]:
    """A CRD with a schema (minimum, enum, a CEL rule) and the status subresource."""
    spec_schema = {
        "type": "object",
        "required": ["size"],
        "properties": {
            "size": {"type": "integer", "minimum": 1, "maximum": 10},
            "color": {"type": "string", "enum": ["red", "blue"], "default": "blue"},
        },
        "x-kubernetes-validations": [
            {
                "rule": "self.size <= 5 || self.color == 'red'",
                "message": "gadgets larger than 5 must be red",
            }
        ],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "plural": PLURAL,
                "singular": "gadget",
                "kind": "Gadget",
                "listKind": "GadgetList",
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "properties": {
                                "spec": spec_schema,
                                "status": {
                                    "type": "object",
                                    "properties": {"phase": {"type": "string"}},
                                },
                            },
                        }
                    },
                }
            ],
        },
    }


def gadget(name: str, *, size: int, color: str | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"size": size}
    if color:
        spec["color"] = color
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "Gadget",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture(scope="module")
def gadget_crd_installed(kube_api: kubernetes.client.ApiClient) -> None:
    kubernetes.utils.create_from_dict(kube_api, gadget_crd())
    ext = kubernetes.client.ApiextensionsV1Api(kube_api)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        conditions = (
            ext.read_custom_resource_definition(f"{PLURAL}.{GROUP}").status.conditions or []
        )
        if any(c.type == "Established" and c.status == "True" for c in conditions):
            return
        time.sleep(0.1)
    pytest.fail("the Gadget CRD never became Established")


@pytest.fixture
def objects(kube_api: kubernetes.client.ApiClient) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(kube_api)


def status_message(error: ApiException) -> str:
    """The ``message`` of the Status object the server answered with."""
    return str(json.loads(error.body)["message"])


def kubectl(
    plane: controlplane.ControlPlane,
    *args: str,
    stdin: str | None = None,
    kubeconfig: pathlib.Path | None = None,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(plane.binaries.kubectl), f"--kubeconfig={kubeconfig or plane.kubeconfig_path}", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


# --- the API ----------------------------------------------------------------------


def test_namespace_is_created_and_readable(
    kube_api: kubernetes.client.ApiClient, namespace: str
) -> None:
    core = kubernetes.client.CoreV1Api(kube_api)
    assert core.read_namespace(namespace).status.phase == "Active"


def test_server_reports_the_pinned_version(
    kube_api: kubernetes.client.ApiClient, control_plane: controlplane.ControlPlane
) -> None:
    info = kubernetes.client.VersionApi(kube_api).get_code()
    assert info.git_version == control_plane.binaries.versions.kubernetes


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (gadget("zero", size=0), "should be greater than or equal to 1"),
        (gadget("green", size=1, color="green"), 'supported values: "red", "blue"'),
        (gadget("big-blue", size=7, color="blue"), "gadgets larger than 5 must be red"),
    ],
    ids=["minimum", "enum", "cel-rule"],
)
@pytest.mark.usefixtures("gadget_crd_installed")
def test_schema_rejects_invalid_objects_with_its_message(
    objects: kubernetes.client.CustomObjectsApi, namespace: str, body: dict[str, Any], message: str
) -> None:
    with pytest.raises(ApiException) as raised:
        objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)
    assert raised.value.status == 422
    assert message in status_message(raised.value)


@pytest.mark.usefixtures("gadget_crd_installed")
def test_schema_defaults_are_applied(
    objects: kubernetes.client.CustomObjectsApi, namespace: str
) -> None:
    created = objects.create_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, gadget("g", size=2)
    )
    assert created["spec"]["color"] == "blue"


@pytest.mark.usefixtures("gadget_crd_installed")
def test_watch_sees_added_modified_deleted(
    objects: kubernetes.client.CustomObjectsApi, namespace: str
) -> None:
    start = objects.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["metadata"][
        "resourceVersion"
    ]
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, gadget("w", size=3))
    objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "w", {"spec": {"size": 4}}
    )
    objects.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, "w")

    seen: list[tuple[str, int]] = []
    stream = kubernetes.watch.Watch().stream(
        objects.list_namespaced_custom_object,
        GROUP,
        VERSION,
        namespace,
        PLURAL,
        resource_version=start,
        timeout_seconds=10,
    )
    for event in stream:
        seen.append((event["type"], event["object"]["spec"]["size"]))
        if event["type"] == "DELETED":
            break
    assert seen == [("ADDED", 3), ("MODIFIED", 4), ("DELETED", 4)]


@pytest.mark.usefixtures("gadget_crd_installed")
def test_status_subresource_is_separate_from_spec(
    objects: kubernetes.client.CustomObjectsApi, namespace: str
) -> None:
    objects.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, gadget("s", size=1))
    # Writing status through the main resource is ignored ...
    objects.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "s", {"status": {"phase": "Ignored"}}
    )
    assert "status" not in objects.get_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "s"
    )
    # ... and through /status it sticks, without touching the spec.
    patched = objects.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, "s", {"status": {"phase": "Ready"}, "spec": {"size": 9}}
    )
    assert patched["status"] == {"phase": "Ready"}
    assert patched["spec"]["size"] == 1


def test_restricted_service_account_gets_403_on_a_verb_it_lacks(
    control_plane: controlplane.ControlPlane, namespace: str
) -> None:
    config_path = control_plane.restricted_kubeconfig(
        namespace=namespace,
        name="reader",
        rules=[{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list"]}],
    )
    client = kubernetes.config.new_client_from_config(config_file=str(config_path))
    core = kubernetes.client.CoreV1Api(client)
    try:
        core.list_namespaced_config_map(namespace)  # allowed
        with pytest.raises(ApiException) as raised:
            core.create_namespaced_config_map(
                namespace,
                kubernetes.client.V1ConfigMap(metadata=kubernetes.client.V1ObjectMeta(name="x")),
            )
        assert raised.value.status == 403
        assert f"system:serviceaccount:{namespace}:reader" in status_message(raised.value)
    finally:
        client.close()
    denied = kubectl(
        control_plane, "-n", namespace, "delete", "configmap", "anything", kubeconfig=config_path
    )
    assert denied.returncode != 0 and "forbidden" in denied.stderr.lower()


# --- the built CLIs ------------------------------------------------------------------


def test_kubectl_get_and_server_side_dry_run(
    control_plane: controlplane.ControlPlane, namespace: str, gadget_crd_installed: None
) -> None:
    listed = kubectl(control_plane, "get", "namespaces", "-o", "name")
    assert listed.returncode == 0, listed.stderr
    assert f"namespace/{namespace}" in listed.stdout.split()

    valid = yaml.safe_dump(gadget("dry", size=2))
    applied = kubectl(
        control_plane, "-n", namespace, "apply", "--dry-run=server", "-f", "-", stdin=valid
    )
    assert applied.returncode == 0, applied.stderr
    assert "gadget.testing.meshtrain.io/dry created (server dry run)" in applied.stdout
    missing = kubectl(control_plane, "-n", namespace, "get", "gadget", "dry")
    assert missing.returncode != 0 and "NotFound" in missing.stderr

    invalid = yaml.safe_dump(gadget("dry", size=8))
    refused = kubectl(
        control_plane, "-n", namespace, "apply", "--dry-run=server", "-f", "-", stdin=invalid
    )
    assert refused.returncode != 0
    assert "gadgets larger than 5 must be red" in refused.stderr


def write_tiny_chart(root: pathlib.Path) -> pathlib.Path:
    chart = root / "tiny"
    (chart / "templates").mkdir(parents=True)
    (chart / "Chart.yaml").write_text("apiVersion: v2\nname: tiny\nversion: 0.1.0\n")
    (chart / "values.yaml").write_text("# Value written into the ConfigMap.\ngreeting: hello\n")
    (chart / "templates" / "configmap.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: {{ .Release.Name }}-tiny\n"
        "data:\n  greeting: {{ .Values.greeting | quote }}\n"
    )
    return chart


def test_helm_template_renders_and_the_server_accepts_it(
    control_plane: controlplane.ControlPlane, namespace: str, tmp_path: pathlib.Path
) -> None:
    chart = write_tiny_chart(tmp_path)
    env = {
        **os.environ,
        "HELM_CACHE_HOME": str(tmp_path / "h-cache"),
        "HELM_CONFIG_HOME": str(tmp_path / "h-config"),
        "HELM_DATA_HOME": str(tmp_path / "h-data"),
    }
    helm = [
        str(control_plane.binaries.helm),
        f"--kubeconfig={control_plane.kubeconfig_path}",
        "-n",
        namespace,
    ]
    rendered = subprocess.run(
        [*helm, "template", "demo", str(chart), "--set", "greeting=hi", "--validate"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert rendered.returncode == 0, rendered.stderr
    assert yaml.safe_load(rendered.stdout)["data"] == {"greeting": "hi"}

    applied = kubectl(
        control_plane,
        "-n",
        namespace,
        "apply",
        "--dry-run=server",
        "-f",
        "-",
        stdin=rendered.stdout,
    )
    assert applied.returncode == 0, applied.stderr

    installed = subprocess.run(
        [*helm, "install", "demo", str(chart), "--wait", "--timeout", "30s"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert installed.returncode == 0, installed.stderr
    got = kubectl(
        control_plane,
        "-n",
        namespace,
        "get",
        "configmap",
        "demo-tiny",
        "-o",
        "jsonpath={.data.greeting}",
    )
    assert got.stdout == "hello"


# --- scheduler and controller-manager ----------------------------------------------------


def test_full_control_plane_runs_controllers_and_scheduler(
    kube_api_full: kubernetes.client.ApiClient,
) -> None:
    apps = kubernetes.client.AppsV1Api(kube_api_full)
    core = kubernetes.client.CoreV1Api(kube_api_full)
    labels = {"app": "probe"}
    apps.create_namespaced_deployment(
        "default",
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": {"name": "probe"},
            "spec": {
                "replicas": 1,
                "selector": {"matchLabels": labels},
                "template": {
                    "metadata": {"labels": labels},
                    "spec": {"containers": [{"name": "c", "image": "example.invalid/probe:1"}]},
                },
            },
        },
    )
    deadline = time.monotonic() + 60
    reason = None
    while time.monotonic() < deadline and reason != "Unschedulable":
        pods = core.list_namespaced_pod(
            "default", label_selector="app=probe"
        ).items  # made by the controllers
        conditions = [
            c for p in pods for c in (p.status.conditions or []) if c.type == "PodScheduled"
        ]
        reason = (
            conditions[0].reason if conditions else None
        )  # set by the scheduler: there are no nodes
        time.sleep(0.2)
    assert reason == "Unschedulable"


# --- lifecycle ---------------------------------------------------------------------


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A loopback port held by a listening socket for the whole test."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_already_in_use_does_not_break_startup(
    control_plane_binaries: binaries.Binaries, busy_port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Hand out the busy port as etcd's client port (pick 1; pick 2 is its peer
    # port) and, after etcd's retry with picks 3 and 4, as the apiserver's port (pick 5).
    real_pick = ports.pick_free_port
    picks = iter(range(1, 1000))
    monkeypatch.setattr(
        ports, "pick_free_port", lambda: busy_port if next(picks) in (1, 5) else real_pick()
    )
    with controlplane.ControlPlane(binaries=control_plane_binaries) as plane:
        logs = plane.data_dir / "logs"
        assert (logs / "etcd.attempt1.log").exists()
        assert (logs / "kube-apiserver.attempt1.log").exists()
        assert f":{busy_port}" not in plane.server
        assert plane.admin_client().request("GET", "/readyz").status == 200


def _processes_in_group(pgid: int) -> list[int]:
    found = []
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    found.append(int(entry.name))
            except ProcessLookupError:
                continue
    return found


def test_stop_leaves_no_process_and_no_data_behind(
    control_plane_binaries: binaries.Binaries,
) -> None:
    plane = controlplane.ControlPlane(
        binaries=control_plane_binaries, with_scheduler=True, with_controller_manager=True
    ).start()
    pids = plane.pids()
    data_dir = plane.data_dir
    assert set(pids) == {"etcd", "kube-apiserver", "kube-scheduler", "kube-controller-manager"}
    plane.stop()
    plane.stop()  # idempotent
    for name, pid in pids.items():
        assert _processes_in_group(pid) == [], f"{name} left processes behind"
    assert not data_dir.exists()


def test_startup_failure_raises_with_the_component_log_tail(
    control_plane_binaries: binaries.Binaries,
) -> None:
    plane = controlplane.ControlPlane(
        binaries=control_plane_binaries, extra_apiserver_args=["--no-such-flag=1"]
    )
    with pytest.raises(controlplane.StartupError, match="unknown flag: --no-such-flag"):
        plane.start()
    assert plane.pids() == {}
