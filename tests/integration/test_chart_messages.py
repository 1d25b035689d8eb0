"""What a user of the chart reads, through the real helm binary (no API server needed).

- names: under any release name (``meshtrain``, ``mt``, ``my-meshtrain``, the longest Helm
  allows) no object's name says the chart's name twice, and every name is a DNS label;
- bad values: ``helm template`` refuses each mistake with a message that names the value and
  the fix, and ``helm lint`` prints the same message;
- the packaged chart carries the examples its NOTES point at.
"""

from __future__ import annotations

import pathlib
import subprocess
import tarfile

import pytest
import yaml

from meshtrain.sandbox.controlplane import binaries

pytestmark = pytest.mark.integration

CHART = pathlib.Path(__file__).resolve().parents[2] / "charts" / "meshtrain"

EVERYTHING_ON = [
    "--set",
    "monitoring.operatorServiceMonitor.enabled=true,monitoring.trainerPodMonitor.enabled=true",
    "--set",
    "monitoring.prometheusRule.enabled=true,grafana.dashboards.enabled=true",
    "--set",
    "replicaCount=2,admission.maxGPUsPerJob=8,kueue.requireQueue=refuse",
    "--set",
    "networkPolicy.trainerNamespaces={ml}",
    "--set-json",
    'operator.profiles={"mine": {"name": "mine", "source": "test", "peak_flops": 1, '
    '"achievable_fraction": 0.5, "memory_bytes": 1, "memory_bandwidth": 1, "nvlink_bandwidth": 1, '
    '"nvlink_latency": 1, "nic_bandwidth": 1, "nic_latency": 1}}',
]
"""Values that render every object the chart can create."""

LONGEST_RELEASE = "a-release-name-as-long-as-helm-allows-fifty-three-ch"
"""53 characters: Helm refuses longer release names."""


def helm(found: binaries.Binaries, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(found.helm), *args], capture_output=True, text=True, timeout=120, check=False
    )


def _names(document: dict) -> list[str]:
    """The object's name and the names it refers to other objects of the release by."""
    names = [document["metadata"]["name"]]
    spec = document.get("spec") or {}
    names += [spec["policyName"]] if "policyName" in spec else []
    names += [document["roleRef"]["name"]] if "roleRef" in document else []
    pod = (spec.get("template") or {}).get("spec") or {}
    names += [pod["serviceAccountName"]] if "serviceAccountName" in pod else []
    names += [v["configMap"]["name"] for v in pod.get("volumes", []) if "configMap" in v]
    return names


@pytest.mark.parametrize("release", ["meshtrain", "mt", "my-meshtrain", LONGEST_RELEASE])
def test_names_say_the_chart_name_once_and_fit_a_dns_label(
    control_plane_binaries: binaries.Binaries, release: str
) -> None:
    rendered = helm(control_plane_binaries, "template", release, str(CHART), *EVERYTHING_ON)
    assert rendered.returncode == 0, rendered.stderr
    documents = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    kinds = {d["kind"] for d in documents}
    assert {"ConfigMap", "ValidatingAdmissionPolicy", "PodMonitor", "Service"} <= kinds, kinds
    names = [name for document in documents for name in _names(document)]
    assert len(names) > len(documents)  # the references were read too
    stutters = [name for name in names if name.count("meshtrain") > 1]
    assert stutters == [], f"release {release}: the chart's name twice in {stutters}"
    too_long = [name for name in names if len(name) > 63]
    assert too_long == [], f"release {release}: longer than a DNS label: {too_long}"
    if "meshtrain" in release:  # Helm's convention: the release name is the full name
        deployment = next(d for d in documents if d["kind"] == "Deployment")
        assert deployment["metadata"]["name"] == release


def test_components_are_suffixed_once_and_overrides_still_apply(
    control_plane_binaries: binaries.Binaries,
) -> None:
    def names(*values: str) -> set[str]:
        rendered = helm(
            control_plane_binaries, "template", "mt", str(CHART), *EVERYTHING_ON, *values
        )
        assert rendered.returncode == 0, rendered.stderr
        return {d["metadata"]["name"] for d in yaml.safe_load_all(rendered.stdout) if d}

    default = names()
    assert {"mt-meshtrain", "mt-meshtrain-operator-dashboard", "mt-meshtrain-metrics"} <= default
    assert "mt-meshtrain-meshtrain-operator" not in default  # the stutter
    assert {"mt-trainer-ops", "mt-trainer-ops-metrics"} <= names(
        "--set", "nameOverride=trainer-ops"
    )
    overridden = names("--set", "fullnameOverride=platform")
    assert {"platform", "platform-metrics", "platform-training-dashboard"} <= overridden
    assert not any(name.startswith("mt") for name in overridden)


MISTAKES = [
    pytest.param(
        ["--set", "replicaCount=2", "--set", "operator.leaderElection.enabled=false"],
        ["replicaCount is 2", "operator.leaderElection.enabled=true", "replicaCount=1"],
        id="standbys-without-a-lease",
    ),
    pytest.param(
        ["--set", "watch.mode=namespaces"],
        ["watch.namespaces is empty", "--set 'watch.namespaces={team-a,team-b}'", "watch.mode=all"],
        id="namespaces-mode-without-namespaces",
    ),
    pytest.param(
        ["--set", "watch.mode=namespaces", "--set", "watch.namespaces={Team-A}"],
        ['watch.namespaces has "Team-A"', "kubectl get namespaces", "lower-case"],
        id="namespace-name",
    ),
    pytest.param(
        ["--set", "trainer.image.tag=2"],
        ["trainer.image.tag is the number 2", "--set-string trainer.image.tag="],
        id="tag-read-as-a-number",
    ),
    pytest.param(
        ["--set", "image.digest=abc"],
        ['image.digest is "abc"', "sha256: and the 64 hex digits", "leave it empty"],
        id="digest",
    ),
    pytest.param(
        ["--set", "resources.requests.memory=lots"],
        ['resources.requests.memory is "lots"', "256Mi"],
        id="quantity",
    ),
    pytest.param(
        ["--set", "monitoring.trainerPodMonitor.interval=15"],
        ['monitoring.trainerPodMonitor.interval is "15"', "15s or 1m"],
        id="scrape-interval",
    ),
    pytest.param(
        ["--set", "monitoring.trainerPodMonitor.interval=30s"],
        ['monitoring.trainerPodMonitor.interval is "30s"', "15s or less"],
        id="trainer-scrape-interval-above-the-rate-windows",
    ),
    pytest.param(
        ["--set", "nameOverride=Mesh_Train"],
        ['nameOverride is "Mesh_Train"', "lower-case letters, digits and '-'"],
        id="name-override",
    ),
    pytest.param(
        ["--set", "fullnameOverride=-platform"],
        ['fullnameOverride is "-platform"', "lower-case letters, digits and '-'"],
        id="fullname-override",
    ),
    pytest.param(
        ["--set", "operator.planningDeadlineSeconds=0"],
        ["operator.planningDeadlineSeconds is 0", "above 0 and at most 600"],
        id="planning-deadline",
    ),
    # Plain constraints stay in values.schema.json: Helm's message names the value and the limit.
    pytest.param(
        ["--set", "replicaCount=9"], ["at '/replicaCount': maximum: got 9, want 5"], id="too-many"
    ),
    pytest.param(
        ["--set", "image.pullPolicy=always"],
        ["at '/image/pullPolicy': value must be one of 'Always', 'IfNotPresent', 'Never'"],
        id="enum",
    ),
    pytest.param(
        ["--set", "imagePullSecrets[0].nam=regcred"],
        ["at '/imagePullSecrets/0': missing property 'name'", "'nam' not allowed"],
        id="pull-secret",
    ),
    pytest.param(
        ["--set", "replicaCont=2"], ["additional properties 'replicaCont' not allowed"], id="typo"
    ),
]


VALID = [
    pytest.param(["--set", "image.tag=null"], id="null-tag-is-the-app-version"),
    pytest.param(
        ["--set", "monitoring.operatorServiceMonitor.interval=1m30s"], id="compound-interval"
    ),
    pytest.param(
        ["--set", "monitoring.trainerPodMonitor.interval=500ms"], id="sub-second-interval"
    ),
    *(
        pytest.param(["--set", f"resources.requests.cpu={q}"], id=f"quantity-{q}")
        for q in ("100u", "250m", "1e3", "0.5", ".5")
    ),
    *(
        pytest.param(["--set", f"resources.limits.memory={q}"], id=f"quantity-{q}")
        for q in ("1Pi", "1E", "512M", "2Gi")
    ),
    pytest.param(["--set", "nameOverride=platform", "--set", "fullnameOverride=ml-2"], id="names"),
]


@pytest.mark.parametrize("values", VALID)
def test_valid_values_render(control_plane_binaries: binaries.Binaries, values: list[str]) -> None:
    """Values Kubernetes and the Prometheus Operator accept are not refused by validate.yaml."""
    rendered = helm(control_plane_binaries, "template", "mt", str(CHART), *values)
    assert rendered.returncode == 0, rendered.stderr


@pytest.mark.parametrize(("values", "says"), MISTAKES)
def test_bad_values_are_refused_naming_the_value_and_the_fix(
    control_plane_binaries: binaries.Binaries, values: list[str], says: list[str]
) -> None:
    rendered = helm(control_plane_binaries, "template", "mt", str(CHART), *values)
    assert rendered.returncode != 0
    message = rendered.stderr
    for part in says:
        assert part in message, message
    assert "'allOf' failed" not in message and "does not match pattern" not in message, message
    # helm lint prints the same message; it fails on schema errors, while a template's fail()
    # is reported (Helm's lint mode logs it) without failing the lint.
    linted = helm(control_plane_binaries, "lint", "--strict", str(CHART), *values)
    for part in says:
        assert part in linted.stdout + linted.stderr, linted.stdout + linted.stderr
    if says[0].startswith("at '"):
        assert linted.returncode != 0


def test_the_default_values_render_and_lint_clean(
    control_plane_binaries: binaries.Binaries,
) -> None:
    assert helm(control_plane_binaries, "template", "mt", str(CHART)).returncode == 0
    linted = helm(control_plane_binaries, "lint", "--strict", str(CHART), *EVERYTHING_ON)
    assert linted.returncode == 0 and "Fail:" not in linted.stdout + linted.stderr, linted.stdout


def test_the_packaged_chart_carries_the_examples_the_notes_name(
    control_plane_binaries: binaries.Binaries, tmp_path: pathlib.Path
) -> None:
    packaged = helm(control_plane_binaries, "package", str(CHART), "--destination", str(tmp_path))
    assert packaged.returncode == 0, packaged.stderr
    (archive,) = tmp_path.glob("meshtrain-*.tgz")
    with tarfile.open(archive) as tar:
        shipped = set(tar.getnames())
    examples = sorted((CHART.parents[1] / "manifests" / "examples").glob("*.yaml"))
    assert examples
    for example in examples:
        assert f"meshtrain/files/examples/{example.name}" in shipped
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "{{ .Chart.Name }}/files/examples/gpt-1.3b-dp8-tp2.yaml" in notes
    assert "meshtrain/files/examples/gpt-1.3b-dp8-tp2.yaml" in shipped
