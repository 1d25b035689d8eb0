"""The chart as a platform team runs it, against a real kube-apiserver.

- users get TrainingJob access through Kubernetes' built-in edit/view roles
  (aggregated by the real kube-controller-manager);
- the admission guardrails (a ValidatingAdmissionPolicy) are enforced by the API
  server itself, with messages that name the field;
- ``kueue.requireQueue: refuse`` refuses a job that names no Kueue LocalQueue, and the removal
  of the label, while a job created before stays deletable;
- the CRD upgrade path of the chart README works from the previous chart release;
- `make chart-package` stamps one version on the chart and both images.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import time
import uuid
from collections.abc import Iterator

import pytest
import yaml

from meshtrain.api import crd, release
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import binaries
from tests.builders import JobBuilder
from tests.integration import test_chart_rendered

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"
# The last commit whose chart is release 0.1.0 (CRDs as they were before 0.2.0).
PREVIOUS_CHART_COMMIT = "2cf42ad"


class Tools:
    """kubectl and helm against one control plane."""

    def __init__(self, plane: controlplane.ControlPlane, found: binaries.Binaries) -> None:
        self.env = {
            "KUBECONFIG": str(plane.kubeconfig_path),
            "HOME": "/tmp",
            "PATH": "/usr/bin:/bin",
        }
        self.paths = {"kubectl": str(found.kubectl), "helm": str(found.helm)}

    def run(
        self, tool: str, *args: str, stdin: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [self.paths[tool], *args], input=stdin, capture_output=True, text=True, env=self.env
        )

    def ok(self, tool: str, *args: str, stdin: str | None = None) -> str:
        result = self.run(tool, *args, stdin=stdin)
        assert result.returncode == 0, f"{tool} {' '.join(args)}: {result.stdout}{result.stderr}"
        return result.stdout

    def namespace(self, prefix: str) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:6]}"
        self.ok("kubectl", "create", "namespace", name)
        return name

    def can_i(
        self, verb: str, resource: str, user: str, namespace: str, subresource: str = ""
    ) -> bool:
        args = ["auth", "can-i", verb, resource, "--as", user, "-n", namespace]
        if subresource:
            args.append(f"--subresource={subresource}")
        return self.run("kubectl", *args).stdout.strip() == "yes"


def _job(name: str, image: str | None = None, data: int = 1, queue: str | None = None) -> str:
    spec = JobBuilder().layout(data=data).raw()
    if image is not None:
        spec["image"] = image
    labels = {} if queue is None else {"kueue.x-k8s.io/queue-name": queue}
    return yaml.safe_dump(
        {
            "apiVersion": "meshtrain.io/v1alpha1",
            "kind": "TrainingJob",
            "metadata": {"name": name, "labels": labels},
            "spec": spec,
        }
    )


def _eventually(check, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.5)
    return check()


def _hold_with_finalizer(tools: Tools, namespace: str, job: str) -> None:
    """Give ``job`` the operator's finalizer, as a job the operator has seen carries."""
    tools.ok("kubectl", "patch", "trainingjob", job, "-n", namespace, "--type=merge",
             "-p", json.dumps({"metadata": {"finalizers": ["meshtrain.io/cleanup"]}}))  # fmt: skip


def _deleted_past_finalizer(tools: Tools, namespace: str, job: str) -> bool:
    """Delete ``job`` and take its finalizer away (the operator's part): whether it goes."""
    tools.ok("kubectl", "delete", "trainingjob", job, "-n", namespace, "--wait=false")
    tools.ok("kubectl", "patch", "trainingjob", job, "-n", namespace, "--type=json",
             "-p", json.dumps([{"op": "remove", "path": "/metadata/finalizers"}]))  # fmt: skip
    return _eventually(
        lambda: tools.run("kubectl", "get", "trainingjob", job, "-n", namespace).returncode != 0
    )


@pytest.fixture(scope="module")
def full(
    control_plane_full: controlplane.ControlPlane, control_plane_binaries: binaries.Binaries
) -> Tools:
    return Tools(control_plane_full, control_plane_binaries)


@pytest.fixture
def fresh_plane(control_plane_binaries: binaries.Binaries) -> Iterator[Tools]:
    """A control plane of its own: CRDs are cluster-wide, and this one starts without any."""
    with controlplane.ControlPlane(binaries=control_plane_binaries) as plane:
        yield Tools(plane, control_plane_binaries)


def test_edit_and_view_users_get_trainingjob_access_through_the_built_in_roles(full: Tools) -> None:
    team = full.namespace("team")
    full.ok(
        "kubectl",
        "create",
        "rolebinding",
        "alice-edit",
        "--clusterrole=edit",
        "--user=alice",
        "-n",
        team,
    )
    full.ok(
        "kubectl",
        "create",
        "rolebinding",
        "bob-view",
        "--clusterrole=view",
        "--user=bob",
        "-n",
        team,
    )
    assert not full.can_i("create", "trainingjobs.meshtrain.io", "alice", team)

    release_ns = full.namespace("mt-roles")
    full.ok(
        "helm", "install", "roles", str(CHART), "-n", release_ns, "--set", "operator.deploy=false"
    )
    try:
        assert _eventually(
            lambda: full.can_i("create", "trainingjobs.meshtrain.io", "alice", team)
        ), "the edit role never gained create on trainingjobs: aggregation labels wrong?"
        for verb in ("delete", "patch", "get", "list", "watch"):
            assert full.can_i(verb, "trainingjobs.meshtrain.io", "alice", team), verb
        assert _eventually(lambda: full.can_i("list", "trainingjobs.meshtrain.io", "bob", team))
        assert full.can_i("get", "trainingjobs.meshtrain.io", "bob", team, "status")
        for verb in ("create", "delete", "patch"):
            assert not full.can_i(verb, "trainingjobs.meshtrain.io", "bob", team), verb
        # Status belongs to the operator: not even `edit` may write it.
        assert not full.can_i("patch", "trainingjobs.meshtrain.io", "alice", team, "status")
        # Outside the namespace the users are bound in, nothing.
        assert not full.can_i("create", "trainingjobs.meshtrain.io", "alice", release_ns)
    finally:
        full.ok("helm", "uninstall", "roles", "-n", release_ns)


def test_admission_guardrails_refuse_foreign_images_and_oversized_jobs_at_apply(
    fresh_plane: Tools,
) -> None:
    tools = fresh_plane
    release_ns = tools.namespace("mt-guard")
    team = tools.namespace("team")
    # A job admitted before the guardrails were turned on, carrying the operator's finalizer.
    tools.ok("helm", "install", "guard", str(CHART), "-n", release_ns, "--set", "operator.deploy=false")  # fmt: skip
    tools.ok("kubectl", "create", "-n", team, "-f", "-", stdin=_job("legacy", image="docker.io/old/trainer:1"))  # fmt: skip
    _hold_with_finalizer(tools, team, "legacy")
    tools.ok(
        "helm", "upgrade", "guard", str(CHART), "-n", release_ns,
        "--set", "operator.deploy=false",
        "--set", "admission.allowedImageRegistries={registry.corp.example/ml,ghcr.io/meshtrain}",
        "--set", "admission.maxGPUsPerJob=4",
    )  # fmt: skip

    def refused(manifest: str) -> str:
        # `create`, not `apply`: an unchanged re-apply sends no request to admit.
        result = tools.run("kubectl", "create", "-n", team, "-f", "-", stdin=manifest)
        return "" if result.returncode == 0 else result.stderr

    # The policy takes effect once the API server has loaded it.
    probes = iter(range(1000))
    assert _eventually(
        lambda: bool(refused(_job(f"probe-{next(probes)}", image="docker.io/evil/trainer:1")))
    ), "a trainer image outside the allowed registries was admitted"
    message = refused(_job("foreign", image="docker.io/evil/trainer:1"))
    assert "spec.image docker.io/evil/trainer:1 is not from an allowed registry" in message
    assert "registry.corp.example/ml, ghcr.io/meshtrain" in message
    # A prefix that only looks like an allowed registry is still foreign.
    assert refused(_job("lookalike", image="registry.corp.example/ml-evil/trainer:1"))

    assert not refused(_job("allowed", image="registry.corp.example/ml/trainer:0.2.0"))
    assert not refused(_job("chart-default"))  # empty spec.image: the chart's trainer image

    message = refused(_job("too-big", data=8))
    assert "spec.parallelism asks for 8 GPUs" in message and "at most 4" in message
    assert not refused(_job("fits", data=4))

    # The job admitted before the policy: its spec may not change to anything foreign, but its
    # metadata may (the operator removes its finalizer on delete), so it can still be deleted.
    changed = tools.run("kubectl", "patch", "trainingjob", "legacy", "-n", team, "--type=merge",
                        "-p", json.dumps({"spec": {"image": "docker.io/evil/trainer:2"}}))  # fmt: skip
    assert changed.returncode != 0 and "is not from an allowed registry" in changed.stderr
    assert _deleted_past_finalizer(tools, team, "legacy"), (
        "the pre-existing job could not be deleted"
    )


def test_a_required_queue_refuses_jobs_that_name_no_local_queue_at_apply(
    fresh_plane: Tools,
) -> None:
    tools = fresh_plane
    release_ns, team = tools.namespace("mt-kueue"), tools.namespace("team")
    tools.ok("helm", "install", "kq", str(CHART), "-n", release_ns, "--set", "operator.deploy=false")  # fmt: skip
    tools.ok("kubectl", "create", "-n", team, "-f", "-", stdin=_job("legacy"))
    _hold_with_finalizer(tools, team, "legacy")
    tools.ok("kubectl", "create", "-n", team, "-f", "-", stdin=_job("queued", queue="team-queue"))
    tools.ok("helm", "upgrade", "kq", str(CHART), "-n", release_ns,
             "--set", "operator.deploy=false", "--set", "kueue.requireQueue=refuse")  # fmt: skip

    def refused(manifest: str) -> str:
        result = tools.run("kubectl", "create", "-n", team, "-f", "-", stdin=manifest)
        return "" if result.returncode == 0 else result.stderr

    probes = iter(range(1000))
    assert _eventually(lambda: bool(refused(_job(f"probe-{next(probes)}")))), (
        "a job naming no LocalQueue was admitted"
    )
    message = refused(_job("unqueued"))
    assert 'metadata.labels["kueue.x-k8s.io/queue-name"] is required' in message, message
    assert f"kubectl get localqueues -n {team}" in message, message
    assert refused(_job("empty", queue=""))
    assert not refused(_job("named", queue="team-queue"))
    # Taking the label away is refused too; a job created before stays updatable and deletable.
    removed = tools.run("kubectl", "label", "trainingjob", "queued", "-n", team, "kueue.x-k8s.io/queue-name-")  # fmt: skip
    assert removed.returncode != 0 and "is required" in removed.stderr, removed.stderr
    tools.ok("kubectl", "label", "trainingjob", "legacy", "-n", team, "owner=research")
    assert _deleted_past_finalizer(tools, team, "legacy"), (
        "the job created before the requirement could not be deleted"
    )


def _served_schema(tools: Tools) -> dict:
    served = json.loads(
        tools.ok("kubectl", "get", "crd", "trainingjobs.meshtrain.io", "-o", "json")
    )
    return served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def _readme_upgrade_commands() -> str:
    """The shell block under the chart README's "Upgrading" heading, as a user copies it."""
    readme = (CHART / "README.md").read_text()
    section = readme.split("## Upgrading", 1)[1]
    return section.split("```bash\n", 1)[1].split("```", 1)[0]


def test_crd_upgrade_path_of_the_chart_readme_works_from_the_previous_release(
    fresh_plane: Tools, tmp_path: pathlib.Path
) -> None:
    tools = fresh_plane
    previous_chart = test_chart_rendered.previous_chart(PREVIOUS_CHART_COMMIT, tmp_path)
    assert yaml.safe_load((previous_chart / "Chart.yaml").read_text())["version"] == "0.1.0"

    release_ns = tools.namespace("meshtrain-system")
    tools.ok(
        "helm",
        "install",
        "meshtrain",
        str(previous_chart),
        "-n",
        release_ns,
        "--set",
        "operator.deploy=false",
    )
    tools.ok("kubectl", "wait", "--for=condition=Established", "crd/trainingjobs.meshtrain.io")
    team = tools.namespace("team")
    tools.ok("kubectl", "apply", "-n", team, "-f", "-", stdin=_job("survivor"))
    wanted = crd.build()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    assert _served_schema(tools) != wanted, "the previous release must serve a different CRD"

    # Helm never upgrades a chart's crds/: a plain upgrade leaves the old schema served.
    tools.ok(
        "helm",
        "upgrade",
        "meshtrain",
        str(CHART),
        "-n",
        release_ns,
        "--set",
        "operator.deploy=false",
    )
    assert _served_schema(tools) != wanted
    # Back to 0.1.0's chart and values, which the README's command must upgrade from.
    tools.ok("helm", "rollback", "meshtrain", "1", "-n", release_ns)

    # The chart README's upgrade path, run as written (the chart directory for the archive).
    commands = _readme_upgrade_commands()
    assert "meshtrain-NEW.tgz" in commands and "-n meshtrain-system" in commands, commands
    script = commands.replace("meshtrain-NEW.tgz", str(CHART)).replace(
        "-n meshtrain-system", f"-n {release_ns}"
    )
    path = ":".join(str(pathlib.Path(tools.paths[t]).parent) for t in ("helm", "kubectl"))
    ran = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", script],
        capture_output=True,
        text=True,
        env={**tools.env, "PATH": f"{path}:/usr/bin:/bin"},
    )
    assert ran.returncode == 0, f"the chart README's upgrade failed:\n{script}\n{ran.stderr}"
    assert _served_schema(tools) == wanted
    status = json.loads(tools.ok("helm", "status", "meshtrain", "-n", release_ns, "-o", "json"))
    assert status["info"]["status"] == "deployed" and status["version"] == 4
    values = json.loads(
        tools.ok("helm", "get", "values", "meshtrain", "-n", release_ns, "-o", "json")
    )
    assert values["operator"]["deploy"] is False, "the release's own values are kept"
    history = json.loads(tools.ok("helm", "history", "meshtrain", "-n", release_ns, "-o", "json"))
    new = f"meshtrain-{release.VERSION}"
    assert [entry["chart"] for entry in history] == ["meshtrain-0.1.0", new, "meshtrain-0.1.0", new]
    # The job created under the old schema is still there and still readable.
    survivor = json.loads(tools.ok("kubectl", "get", "tj", "survivor", "-n", team, "-o", "json"))
    assert survivor["spec"]["parallelism"]["data"] == 1


def test_chart_package_stamps_one_version_on_chart_and_both_images(
    full: Tools, tmp_path: pathlib.Path
) -> None:
    packaged = subprocess.run(
        [str(ROOT / "scripts" / "chart-package.sh"), str(tmp_path)], capture_output=True, text=True
    )
    assert packaged.returncode == 0, packaged.stderr
    archive = tmp_path / f"meshtrain-{release.VERSION}.tgz"
    assert archive.is_file(), list(tmp_path.iterdir())
    rendered = list(yaml.safe_load_all(full.ok("helm", "template", "rel", str(archive))))
    deployment = next(d for d in rendered if d and d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/meshtrain/operator:{release.VERSION}"
    assert f"--trainer-image=ghcr.io/meshtrain/trainer:{release.VERSION}" in container["args"]


@pytest.mark.parametrize("replicas, expected", [(1, False), (2, True)])
def test_disruption_budget_exists_only_with_standby_replicas(
    full: Tools, replicas: int, expected: bool
) -> None:
    release_ns = full.namespace("mt-pdb")
    rendered = full.ok(
        "helm", "template", "pdb", str(CHART), "-n", release_ns, "--set", f"replicaCount={replicas}"
    )
    applied = full.ok("kubectl", "apply", "--dry-run=server", "-f", "-", stdin=rendered)
    assert ("poddisruptionbudget.policy/pdb-meshtrain created" in applied) is expected, applied
