"""The Helm chart against a real kube-apiserver: lint, server dry-run, install, schema, RBAC.

- ``helm lint --strict`` is clean;
- ``helm template`` output passes ``kubectl apply --dry-run=server`` (both watch modes), and so
  do the monitoring objects against the Prometheus Operator's own CRDs;
- ``helm install`` creates the objects and ``helm uninstall`` removes them;
- bad values fail at install time with the schema's message;
- the ServiceAccount may do exactly what docs/operator.md lists and no more
  (``kubectl auth can-i --as=system:serviceaccount:NS:SA``; Secrets denied);
- manifests/rbac and manifests/operator equal fresh ``helm template`` output;
- the NetworkPolicies pass a server-side dry-run, and their selectors, evaluated by the API
  server on real pods, pick the operator's and the trainers' pods and no foreign one.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
import uuid

import pytest
import yaml

from meshtrain.api import limits, loading
from meshtrain.cli import main
from meshtrain.operator import command
from meshtrain.operator.policy import builders, identity
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane import binaries
from tests.builders import JobBuilder

pytestmark = pytest.mark.integration

ROOT = pathlib.Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "meshtrain"

# (verb, resource) the operator needs in a watched namespace (docs/operator.md, RBAC table).
NAMESPACED_ALLOWED = [
    ("get", "trainingjobs.meshtrain.io"),
    ("list", "trainingjobs.meshtrain.io"),
    ("watch", "trainingjobs.meshtrain.io"),
    ("patch", "trainingjobs.meshtrain.io"),
    ("delete", "trainingjobs.meshtrain.io"),
    ("patch", "trainingjobs.meshtrain.io/status"),
    ("update", "trainingjobs.meshtrain.io/finalizers"),
    ("get", "pods"),
    ("get", "persistentvolumeclaims"),
    ("list", "pods"),
    ("watch", "pods"),
    ("create", "pods"),
    ("patch", "pods"),
    ("delete", "pods"),
    ("get", "services"),
    ("get", "podgroups.scheduling.k8s.io"),
    ("create", "podgroups.scheduling.k8s.io"),
    ("create", "services"),
    ("patch", "services"),
    ("delete", "services"),
    ("get", "configmaps"),
    ("create", "configmaps"),
    ("patch", "configmaps"),
    ("delete", "configmaps"),
    ("create", "events"),
    ("get", "workloads.kueue.x-k8s.io"),
    ("list", "workloads.kueue.x-k8s.io"),
    ("watch", "workloads.kueue.x-k8s.io"),
    ("create", "workloads.kueue.x-k8s.io"),
    ("delete", "workloads.kueue.x-k8s.io"),
    ("patch", "workloads.kueue.x-k8s.io"),
    ("patch", "workloads.kueue.x-k8s.io/status"),
    ("get", "localqueues.kueue.x-k8s.io"),
    *((verb, "resourceclaimtemplates.resource.k8s.io") for verb in ("get", "create", "delete")),
    *((verb, "computedomains.resource.nvidia.com") for verb in ("get", "create", "delete")),
]
# Each gang's own NetworkPolicy: only in the namespaces whose gangs get one (a Role there).
GANG_POLICY_ALLOWED = [
    (verb, "networkpolicies.networking.k8s.io") for verb in ("get", "create", "patch", "delete")
]
CLUSTER_ALLOWED = [
    ("get", "workloadpriorityclasses.kueue.x-k8s.io"),
    ("get", "resourceflavors.kueue.x-k8s.io"),
    ("get", "clusterqueues.kueue.x-k8s.io"),
    ("get", "topologies.kueue.x-k8s.io"),
    ("get", "priorityclasses.scheduling.k8s.io"),
    ("list", "priorityclasses.scheduling.k8s.io"),
    ("get", "nodes"),
    ("list", "nodes"),
    ("watch", "nodes"),
    ("get", "persistentvolumes"),
    ("list", "persistentvolumes"),
    ("get", "storageclasses.storage.k8s.io"),
    ("list", "pods"),
    ("watch", "pods"),
    ("list", "namespaces"),
    ("watch", "namespaces"),
    ("list", "customresourcedefinitions.apiextensions.k8s.io"),
    ("watch", "customresourcedefinitions.apiextensions.k8s.io"),
    *(
        (verb, f"{kind}.resource.k8s.io")
        for kind in ("resourceslices", "deviceclasses", "resourceclaims")
        for verb in ("get", "list", "watch")
    ),
]
DENIED = [
    ("get", "secrets"),
    ("list", "secrets"),
    ("watch", "secrets"),
    ("update", "trainingjobs.meshtrain.io"),
    ("create", "trainingjobs.meshtrain.io"),
    ("update", "pods"),
    ("deletecollection", "pods"),
    ("create", "pods/exec"),
    ("update", "configmaps"),
    ("delete", "podgroups.scheduling.k8s.io"),
    ("create", "podgroups.scheduling.x-k8s.io"),  # only with gang.backend=coscheduling
    ("update", "networkpolicies.networking.k8s.io"),
    ("update", "resourceclaimtemplates.resource.k8s.io"),
    ("list", "resourceclaimtemplates.resource.k8s.io"),  # the operator reads its own by name
    ("watch", "resourceclaimtemplates.resource.k8s.io"),
    ("create", "resourceclaims.resource.k8s.io"),
    ("delete", "resourceclaims.resource.k8s.io"),
    ("patch", "computedomains.resource.nvidia.com"),
    ("create", "roles.rbac.authorization.k8s.io"),
    ("create", "rolebindings.rbac.authorization.k8s.io"),
    ("create", "serviceaccounts/token"),
    ("impersonate", "serviceaccounts"),
]
CLUSTER_DENIED = [
    ("patch", "nodes"),
    ("delete", "nodes"),
    ("patch", "persistentvolumes"),
    ("patch", "persistentvolumeclaims"),
    ("create", "namespaces"),
    ("create", "customresourcedefinitions.apiextensions.k8s.io"),
    ("create", "resourceslices.resource.k8s.io"),
    ("update", "resourceslices.resource.k8s.io"),
    ("create", "deviceclasses.resource.k8s.io"),
    ("update", "resourceclaims.resource.k8s.io/status"),
]


def _wait_established(kubectl: str, env: dict[str, str], name: str, timeout: float = 180) -> None:
    """Poll the CRD's Established condition; on timeout fail with what the server last said.

    ``kubectl wait`` hides its reason behind exit status 1, and a loaded CI machine has taken
    longer than its 60 s to answer a 135 KB CRD's apply."""
    deadline = time.monotonic() + timeout
    last = ""
    while time.monotonic() < deadline:
        result = subprocess.run(
            [kubectl, "get", f"crd/{name}", "-o", "jsonpath={.status.conditions}"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        last = (result.stdout + result.stderr).strip()
        if result.returncode == 0 and any(
            c.get("type") == "Established" and c.get("status") == "True"
            for c in json.loads(result.stdout or "null") or []  # null before any condition
        ):
            return
        time.sleep(1)
    pytest.fail(f"CRD {name} not Established after {timeout:.0f}s; last answer: {last}")


@pytest.fixture(scope="module")
def tools(
    control_plane: controlplane.ControlPlane, control_plane_binaries: binaries.Binaries
) -> dict[str, str]:
    """helm and kubectl pointed at the session's control plane, with the chart's CRDs applied."""
    env = {
        "KUBECONFIG": str(control_plane.kubeconfig_path),
        "HOME": os.environ.get("HOME", "/tmp"),
        "PATH": os.environ.get("PATH", ""),
    }
    result = subprocess.run(
        [str(control_plane_binaries.kubectl), "apply", "--server-side", "-f", str(CHART / "crds")],
        env=env,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    _wait_established(str(control_plane_binaries.kubectl), env, "trainingjobs.meshtrain.io")
    return {
        "helm": str(control_plane_binaries.helm),
        "kubectl": str(control_plane_binaries.kubectl),
        **{"env": env},
    }  # type: ignore[dict-item]


def run(
    tools: dict, tool: str, *args: str, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tools[tool], *args], input=stdin, capture_output=True, text=True, env=tools["env"]
    )


def namespace(tools: dict, prefix: str) -> str:
    name = f"{prefix}-{uuid.uuid4().hex[:6]}"
    assert run(tools, "kubectl", "create", "namespace", name).returncode == 0
    return name


def test_helm_lint_strict_is_clean(tools: dict) -> None:
    for extra in (
        [],
        ["--set", "watch.mode=namespaces", "--set", "watch.namespaces={a,b}"],
        [
            "--set",
            "monitoring.trainerPodMonitor.enabled=true,monitoring.operatorServiceMonitor.enabled=true",
            "--set",
            "monitoring.prometheusRule.enabled=true,grafana.dashboards.enabled=true",
        ],
    ):
        result = run(tools, "helm", "lint", "--strict", str(CHART), *extra)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[WARNING]" not in result.stdout and "[ERROR]" not in result.stdout, result.stdout


@pytest.mark.parametrize("mode", ["all", "namespaces"])
def test_template_passes_server_side_dry_run(tools: dict, mode: str) -> None:
    release_ns = namespace(tools, "chart-dry")
    watched = namespace(tools, "chart-watched")
    values = ["--set", f"watch.mode={mode}"] + (
        ["--set", f"watch.namespaces={{{watched}}}"] if mode == "namespaces" else []
    )
    rendered = run(tools, "helm", "template", "dry", str(CHART), "--namespace", release_ns, *values)
    assert rendered.returncode == 0, rendered.stderr
    applied = run(tools, "kubectl", "apply", "--dry-run=server", "-f", "-", stdin=rendered.stdout)
    assert applied.returncode == 0, applied.stderr
    assert "deployment.apps/dry-meshtrain created (server dry run)" in applied.stdout


def test_monitoring_objects_pass_server_side_dry_run_against_the_prometheus_operator_crds(
    tools: dict,
) -> None:
    crds = binaries.monitoring_crds()  # fetched by scripts/bootstrap.sh from the Go module proxy
    installed = run(
        tools,
        "kubectl",
        "apply",
        "--server-side",
        *(arg for path in crds for arg in ("-f", str(path))),
    )
    assert installed.returncode == 0, installed.stderr
    for name in binaries.MONITORING_CRDS:
        established = run(
            tools,
            "kubectl",
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            f"crd/{name}.monitoring.coreos.com",
        )
        assert established.returncode == 0, established.stderr
    release_ns = namespace(tools, "chart-mon")
    rendered = run(
        tools,
        "helm",
        "template",
        "mon",
        str(CHART),
        "--namespace",
        release_ns,
        "--set",
        "monitoring.trainerPodMonitor.enabled=true",
        "--set",
        "monitoring.operatorServiceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
    )
    assert rendered.returncode == 0, rendered.stderr
    applied = run(
        tools,
        "kubectl",
        "apply",
        "--dry-run=server",
        "--validate=strict",
        "-f",
        "-",
        stdin=rendered.stdout,
    )
    assert applied.returncode == 0, applied.stderr
    for kind in ("podmonitor", "servicemonitor", "prometheusrule"):
        assert f"{kind}.monitoring.coreos.com/mon-meshtrain" in applied.stdout, applied.stdout


def test_monitoring_objects_render_with_the_selector_label_and_embedded_files(tools: dict) -> None:
    rendered = run(
        tools,
        "helm",
        "template",
        "mon",
        str(CHART),
        "--set",
        "monitoring.trainerPodMonitor.enabled=true",
        "--set",
        "monitoring.operatorServiceMonitor.enabled=true",
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "grafana.dashboards.enabled=true",
        "--set",
        "monitoring.selectorLabels.release=prom",
    )
    assert rendered.returncode == 0, rendered.stderr
    text = rendered.stdout
    for kind in ("ServiceMonitor", "PodMonitor", "PrometheusRule"):
        assert f"kind: {kind}" in text
    assert text.count("release: prom") >= 3
    assert 'grafana_dashboard: "1"' in text and 'grafana_folder: "meshtrain"' in text
    assert "meshtrain-training.json" in text and "meshtrain-operator.json" in text
    assert "groups:" in text
    monitor = next(d for d in yaml.safe_load_all(text) if d and d["kind"] == "PodMonitor")
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert "honorLabels" not in endpoint and "port" not in endpoint
    keep = [r for r in endpoint["relabelings"] if r.get("action") == "keep"]
    assert keep == [
        {
            "sourceLabels": ["__meta_kubernetes_pod_container_port_name"],
            "regex": "metrics-[0-9]+",
            "action": "keep",
        }
    ]


def test_no_monitor_honours_the_exporters_labels(tools: dict) -> None:
    """Prometheus' own job, namespace and pod win: no endpoint of any monitor sets honorLabels."""
    monitors = ("trainerPodMonitor", "operatorServiceMonitor")
    sets = [arg for m in monitors for arg in ("--set", f"monitoring.{m}.enabled=true")]
    rendered = run(tools, "helm", "template", "labels", str(CHART), *sets)
    assert rendered.returncode == 0, rendered.stderr
    documents = [d for d in yaml.safe_load_all(rendered.stdout) if d]
    found = [d for d in documents if d["kind"] in ("ServiceMonitor", "PodMonitor")]
    assert sorted(m["kind"] for m in found) == ["PodMonitor", "ServiceMonitor"]
    for monitor in found:
        spec = monitor["spec"]
        for endpoint in spec.get("endpoints", []) + spec.get("podMetricsEndpoints", []):
            assert not endpoint.get("honorLabels"), monitor["metadata"]["name"]
            drops = {
                r["regex"] for r in endpoint["metricRelabelings"] if r.get("action") == "labeldrop"
            }
            assert drops & {"exported_namespace", "exported_(namespace|pod|node)"}, drops


def test_install_and_uninstall(tools: dict) -> None:
    release_ns = namespace(tools, "chart-install")
    release = f"it-{uuid.uuid4().hex[:5]}"
    installed = run(tools, "helm", "install", release, str(CHART), "--namespace", release_ns)
    assert installed.returncode == 0, installed.stderr
    assert "kubectl get trainingjobs -w" in installed.stdout, "NOTES.txt tells what to do next"
    assert (
        f"kubectl -n {release_ns} rollout status deployment/{release}-meshtrain" in installed.stdout
    )
    assert "helm pull CHART --version" in installed.stdout and "manifests/" not in installed.stdout
    assert "kubectl apply -f meshtrain/files/examples/gpt-1.3b-dp8-tp2.yaml" in installed.stdout
    objects = run(
        tools, "kubectl", "get", "deployment,serviceaccount", "-n", release_ns, "-o", "name"
    )
    assert f"deployment.apps/{release}-meshtrain" in objects.stdout
    assert run(tools, "kubectl", "get", "clusterrole", f"{release}-meshtrain-jobs").returncode == 0
    uninstalled = run(tools, "helm", "uninstall", release, "--namespace", release_ns, "--wait")
    assert uninstalled.returncode == 0, uninstalled.stderr
    assert run(tools, "kubectl", "get", "clusterrole", f"{release}-meshtrain-jobs").returncode != 0
    assert (
        f"{release}-meshtrain"
        not in run(tools, "kubectl", "get", "deployment", "-n", release_ns, "-o", "name").stdout
    )


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "replicaCount=-1"], "at '/replicaCount': minimum: got -1, want 0"),
        (
            ["--set", "watch.mode=some"],
            "at '/watch/mode': value must be one of 'all', 'namespaces'",
        ),
        # watch.mode=namespaces without namespaces, and replicaCount=2 without leader election:
        # refused with a sentence naming the fix by templates/validate.yaml (test_chart_messages.py).
        (["--set", "typo=1"], "additional properties 'typo' not allowed"),
        (
            ["--set", "operator.profiles.h100-sxm.name=h100-sxm"],
            "at '/operator/profiles/h100-sxm': missing properties 'source', 'peak_flops'",
        ),
        (
            ["--set", "operator.profiles.h100-sxm.colour=green"],
            "at '/operator/profiles/h100-sxm': additional properties 'colour' not allowed",
        ),
    ],
)
def test_bad_values_fail_at_install_with_the_schema_message(
    tools: dict, values: list[str], message: str
) -> None:
    result = run(
        tools,
        "helm",
        "install",
        f"bad-{uuid.uuid4().hex[:5]}",
        str(CHART),
        "--namespace",
        "default",
        *values,
    )
    assert result.returncode != 0
    assert "values don't meet the specifications of the schema" in result.stderr
    assert message in result.stderr, result.stderr


def can_i(
    tools: dict, sa: str, verb: str, resource: str, ns: str | None, name: str | None = None
) -> bool:
    """The API server's authorizer, asked as the ServiceAccount through a SubjectAccessReview.

    ``pods/exec`` means the exec subresource; ``workloads.kueue.x-k8s.io`` names its group
    explicitly, so resources of APIs this control plane does not serve (Kueue's) are judged
    by the RBAC rules alone, without discovery.
    """
    resource, _, subresource = resource.partition("/")
    plural, _, group = resource.partition(".")
    namespace_of_sa = sa.split(":")[2]
    attributes = {"verb": verb, "resource": plural, "group": group, "subresource": subresource}
    if ns:
        attributes["namespace"] = ns
    if name:
        attributes["name"] = name
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": sa,
            "groups": [
                "system:serviceaccounts",
                f"system:serviceaccounts:{namespace_of_sa}",
                "system:authenticated",
            ],
            "resourceAttributes": attributes,
        },
    }
    result = run(tools, "kubectl", "create", "-o", "json", "-f", "-", stdin=json.dumps(review))
    assert result.returncode == 0, result.stderr
    return bool(json.loads(result.stdout)["status"].get("allowed"))


def test_rbac_all_namespaces_is_sufficient_and_no_more(tools: dict) -> None:
    release_ns = namespace(tools, "chart-rbac")
    other, policed = namespace(tools, "chart-other"), namespace(tools, "chart-policed")
    installed = run(tools, "helm", "install", "rbac", str(CHART), "--namespace", release_ns,
                    "--set", f"networkPolicy.trainerNamespaces={{{policed}}}")  # fmt: skip
    assert installed.returncode == 0, installed.stderr
    sa = f"system:serviceaccount:{release_ns}:rbac-meshtrain"
    lease = "leases.coordination.k8s.io"
    try:
        missing = [(v, r) for v, r in NAMESPACED_ALLOWED if not can_i(tools, sa, v, r, other)]
        missing += [(v, r) for v, r in GANG_POLICY_ALLOWED if not can_i(tools, sa, v, r, policed)]
        missing += [(v, r) for v, r in CLUSTER_ALLOWED if not can_i(tools, sa, v, r, None)]
        missing += [
            (v, lease)
            for v in ("get", "update")
            if not can_i(tools, sa, v, lease, release_ns, name="rbac-meshtrain")
        ]
        if not can_i(tools, sa, "create", lease, release_ns):
            missing.append(("create", lease))
        assert not missing, f"the operator needs {missing}"
        extra = [(v, r) for v, r in DENIED if can_i(tools, sa, v, r, other)]
        extra += [(v, r) for v, r in GANG_POLICY_ALLOWED if can_i(tools, sa, v, r, other)]
        extra += [(v, r) for v, r in CLUSTER_DENIED if can_i(tools, sa, v, r, None)]
        if can_i(tools, sa, "update", lease, release_ns, name="another-lease"):
            extra.append(("update", "another Lease"))  # only the operator's own Lease
        if can_i(tools, sa, "update", lease, other):
            extra.append(("update", f"leases in {other}"))  # the Lease lives in the release ns
        assert not extra, f"the chart grants more than the operator uses: {extra}"
    finally:
        run(tools, "helm", "uninstall", "rbac", "--namespace", release_ns, "--wait")


def test_rbac_namespaces_mode_grants_only_the_listed_namespaces(tools: dict) -> None:
    release_ns = namespace(tools, "chart-rbacns")
    watched, other = namespace(tools, "chart-w"), namespace(tools, "chart-o")
    result = run(
        tools,
        "helm",
        "install",
        "rbacns",
        str(CHART),
        "--namespace",
        release_ns,
        "--set",
        "watch.mode=namespaces",
        "--set",
        f"watch.namespaces={{{watched}}}",
    )
    assert result.returncode == 0, result.stderr
    sa = f"system:serviceaccount:{release_ns}:rbacns-meshtrain"
    try:
        allowed = NAMESPACED_ALLOWED + GANG_POLICY_ALLOWED  # a watched namespace's gangs get one
        assert all(can_i(tools, sa, v, r, watched) for v, r in allowed)
        assert can_i(
            tools, sa, "update", "leases.coordination.k8s.io", release_ns, "rbacns-meshtrain"
        )
        assert not can_i(tools, sa, "update", "leases.coordination.k8s.io", watched)
        assert not can_i(tools, sa, "create", "pods", other)
        assert not can_i(tools, sa, "patch", "trainingjobs.meshtrain.io/status", other)
        assert not can_i(tools, sa, "update", "trainingjobs.meshtrain.io/status", watched)
        assert can_i(tools, sa, "list", "pods", None), (
            "cluster-wide pod list: GPU reservations of every namespace"
        )
        assert not can_i(tools, sa, "get", "secrets", watched)
        # Events on Nodes go where the kubelet records them; nothing else is granted there
        assert can_i(tools, sa, "create", "events", "default"), "a bad GPU's Event on its Node"
        assert not can_i(tools, sa, "create", "pods", "default")
        assert not can_i(tools, sa, "list", "events", "default")
    finally:
        run(tools, "helm", "uninstall", "rbacns", "--namespace", release_ns, "--wait")


def test_the_coscheduling_backend_gets_its_flags_and_podgroups_and_volcano_is_refused(
    tools: dict,
) -> None:
    def rendered(*values: str) -> subprocess.CompletedProcess[str]:
        return run(tools, "helm", "template", "gb", str(CHART), "--namespace", "ops", *values)

    plain = rendered()
    assert plain.returncode == 0, plain.stderr
    assert "--gang-backend=auto" in plain.stdout and "scheduling.x-k8s.io" not in plain.stdout
    chosen = rendered(
        "--set", "gang.backend=coscheduling", "--set", "gang.schedulerName=gangs",
        "--set", "gang.scheduleTimeoutSeconds=90",
    )  # fmt: skip
    assert chosen.returncode == 0, chosen.stderr
    documents = [d for d in yaml.safe_load_all(chosen.stdout) if d]
    args = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"][
        "containers"
    ][0]["args"]
    flags = ("--gang-backend=coscheduling", "--gang-scheduler-name=gangs")
    assert {*flags, "--gang-schedule-timeout-seconds=90"} <= set(args)
    gang_flags = [a for a in args if a.startswith("--gang-")]
    parsed = command.gang(main.build_parser().parse_args(["operator", *gang_flags]))
    assert (parsed.kind, parsed.scheduler_name, parsed.schedule_timeout_seconds) == (
        "coscheduling", "gangs", 90,
    )  # fmt: skip
    rules = [
        rule
        for d in documents
        if d["kind"] == "ClusterRole"
        for rule in d.get("rules") or []
        if rule.get("apiGroups") == ["scheduling.x-k8s.io"]
    ]
    assert rules == [
        {
            "apiGroups": ["scheduling.x-k8s.io"],
            "resources": ["podgroups"],
            "verbs": ["get", "create"],
        }
    ]
    volcano = rendered("--set", "gang.backend=volcano")
    assert volcano.returncode != 0
    assert "Volcano's scheduler has not been built or tested" in volcano.stderr, volcano.stderr
    unknown = rendered("--set", "gang.backend=kai")
    assert unknown.returncode != 0 and "/gang/backend" in unknown.stderr, unknown.stderr


def test_plain_manifests_equal_fresh_helm_template(tools: dict) -> None:
    result = subprocess.run(
        [str(ROOT / "scripts" / "render-manifests.sh"), "--check"],
        capture_output=True,
        text=True,
        env={**tools["env"], "HELM": tools["helm"]},
    )
    assert result.returncode == 0, (
        f"run scripts/render-manifests.sh: {result.stdout}{result.stderr}"
    )


def test_alerts_link_the_runbooks_the_release_names(tools: dict) -> None:
    rendered = run(
        tools,
        "helm",
        "template",
        "mon",
        str(CHART),
        "--set",
        "monitoring.prometheusRule.enabled=true",
        "--set",
        "monitoring.prometheusRule.runbookBaseUrl=https://wiki.example/meshtrain/runbooks",
    )
    assert rendered.returncode == 0, rendered.stderr
    rule = next(
        d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "PrometheusRule"
    )
    alerts = [r for g in rule["spec"]["groups"] for r in g["rules"] if "alert" in r]
    assert alerts and all(
        r["annotations"]["runbook_url"]
        == f"https://wiki.example/meshtrain/runbooks#{r['alert'].lower()}"
        for r in alerts
    ), [r["annotations"]["runbook_url"] for r in alerts]


def _selector(selector: dict) -> str:
    """A LabelSelector as kubectl's ``-l`` (matchLabels and Exists expressions, as the chart writes)."""
    terms = [f"{key}={value}" for key, value in (selector.get("matchLabels") or {}).items()]
    for expression in selector.get("matchExpressions") or []:
        assert expression["operator"] == "Exists", expression
        terms.append(expression["key"])
    return ",".join(terms)


def _selected(tools: dict, kind: str, selector: dict, *scope: str) -> set[str]:
    """What the API server itself lists for ``selector`` (an empty one selects everything)."""
    listed = run(tools, "kubectl", "get", kind, *scope, "-o", "name", "-l", _selector(selector))
    assert listed.returncode == 0, listed.stderr
    return {line.split("/", 1)[1] for line in listed.stdout.split()}


def _create_pod(tools: dict, namespace: str, name: str, labels: dict[str, str]) -> None:
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "automountServiceAccountToken": False,
            "containers": [{"name": "c", "image": "registry.k8s.io/pause:3.10"}],
        },
    }
    created = run(tools, "kubectl", "create", "-f", "-", stdin=json.dumps(pod))
    assert created.returncode == 0, created.stderr


def test_network_policies_admit_only_the_gang_the_operator_and_prometheus(tools: dict) -> None:
    release_ns, team = namespace(tools, "chart-np"), namespace(tools, "chart-team")
    rendered = run(tools, "helm", "template", "np", str(CHART), "--namespace", release_ns,
                   "--set", "watch.mode=namespaces", "--set", f"watch.namespaces={{{team}}}")  # fmt: skip
    assert rendered.returncode == 0, rendered.stderr
    applied = run(tools, "kubectl", "apply", "--dry-run=server", "-o", "json", "-f", "-",
                  stdin=rendered.stdout)  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    items = json.loads(applied.stdout)["items"]
    policies = {o["metadata"]["name"]: o for o in items if o["kind"] == "NetworkPolicy"}
    assert set(policies) == {"np-meshtrain-operator", "np-meshtrain-trainers"}
    operator_policy, trainers = policies["np-meshtrain-operator"], policies["np-meshtrain-trainers"]
    assert operator_policy["metadata"]["namespace"] == release_ns
    assert trainers["metadata"]["namespace"] == team
    prometheus = {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
    }
    # The operator takes connections only on its metrics port, only from Prometheus.
    assert operator_policy["spec"]["policyTypes"] == ["Ingress"]
    [rule] = operator_policy["spec"]["ingress"]
    assert rule == {"from": [prometheus], "ports": [{"port": 9090, "protocol": "TCP"}]}

    # Real pods: the operator's (its Deployment's template), trainers of two jobs as the operator
    # builds them, and a foreign pod in the trainers' namespace; the API server evaluates the
    # selectors.
    deployment = next(o for o in items if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert f"--gang-network-policy-namespace={team}" in args, args
    _create_pod(tools, release_ns, "operator", deployment["spec"]["template"]["metadata"]["labels"])
    spec = loading.parse_spec(JobBuilder().raw())
    llm, other = identity.JobRef("llm", team, "uid-1"), identity.JobRef("other", team, "uid-2")
    trainer = builders.build_pod(llm, spec, 0, 0, "node-a")
    for manifest in (trainer, builders.build_pod(other, spec, 0, 0, "node-a")):
        created = run(tools, "kubectl", "create", "-f", "-", stdin=json.dumps(manifest))
        assert created.returncode == 0, created.stderr
    _create_pod(tools, team, "foreign", {"app": "curious"})
    _create_pod(tools, release_ns, "neighbour", {"app": "curious"})

    pod = trainer["metadata"]["name"]
    assert _selected(tools, "pods", operator_policy["spec"]["podSelector"], "-n", release_ns) == {"operator"}  # fmt: skip
    assert _selected(tools, "pods", trainers["spec"]["podSelector"], "-n", team) == {pod, "other-r0-0"}  # fmt: skip
    # Only gang peers reach the rendezvous port: the operator gets rank 0's exporter port (its
    # /progress), Prometheus the exporters' ports, by the names the trainer container gives them.
    [to_operator, to_scraper] = trainers["spec"]["ingress"]
    [operator] = to_operator["from"]  # no trainer pod: each gang's own policy admits its pods
    assert to_scraper["from"] == [prometheus]
    container_ports = {p["name"]: p for p in trainer["spec"]["containers"][0]["ports"]}
    assert to_operator["ports"] == [{"port": "metrics-0", "protocol": "TCP"}]
    assert container_ports["metrics-0"]["containerPort"] == spec.metrics.port
    named = [p["port"] for p in to_scraper["ports"]]
    assert {p["protocol"] for p in to_scraper["ports"]} == {"TCP"}
    assert set(container_ports) - set(named) == {"rendezvous"}, "every exporter, no rendezvous"
    assert len(named) == limits.MAX_GPUS_PER_NODE  # any gpusPerNode the CRD admits
    assert _selected(tools, "namespaces", operator["namespaceSelector"]) == {release_ns}
    assert _selected(tools, "pods", operator["podSelector"], "-n", release_ns) == {"operator"}

    # The operator's policy of job llm (with its gang), from the peers the chart hands it:
    # llm's pods on any port, the operator and Prometheus on their ports, and no one else.
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    peers = builders.GangPeers(
        operator=command.parse_peers("operator", env["MESHTRAIN_GANG_NETWORK_POLICY_OPERATOR_PEERS"]),
        metrics=command.parse_peers("metrics", env["MESHTRAIN_GANG_NETWORK_POLICY_METRICS_PEERS"]),
    )  # fmt: skip
    gang_policy = builders.build_network_policy(llm, spec, peers)
    applied = run(tools, "kubectl", "apply", "--dry-run=server", "-o", "json", "-f", "-",
                  stdin=json.dumps(gang_policy))  # fmt: skip
    assert applied.returncode == 0, applied.stderr
    gang_rule, operator_rule, scraper_rule = json.loads(applied.stdout)["spec"]["ingress"]
    assert "ports" not in gang_rule, "the gang's collectives use any port"
    [gang] = gang_rule["from"]
    assert set(gang) == {"podSelector"}  # this namespace only
    assert _selected(tools, "pods", gang_policy["spec"]["podSelector"], "-n", team) == {pod}
    assert _selected(tools, "pods", gang["podSelector"], "-n", team) == {pod}
    [gang_operator] = operator_rule["from"]
    assert _selected(tools, "namespaces", gang_operator["namespaceSelector"]) == {release_ns}
    assert _selected(tools, "pods", gang_operator["podSelector"], "-n", release_ns) == {"operator"}
    assert operator_rule["ports"] == [{"port": spec.metrics.port, "protocol": "TCP"}]
    assert scraper_rule["from"] == [prometheus]
    rendezvous = container_ports["rendezvous"]["containerPort"]
    for rule in (operator_rule, scraper_rule):
        assert all(
            not p["port"] <= rendezvous <= p.get("endPort", p["port"]) for p in rule["ports"]
        )


def test_network_policies_can_be_turned_off_and_follow_the_listed_namespaces(tools: dict) -> None:
    def kinds(*values: str) -> list[tuple[str, str]]:
        rendered = run(tools, "helm", "template", "np", str(CHART), "--namespace", "mt", *values)
        assert rendered.returncode == 0, rendered.stderr
        return [
            (d["metadata"].get("namespace", ""), d["metadata"]["name"])
            for d in yaml.safe_load_all(rendered.stdout)
            if d and d["kind"] == "NetworkPolicy"
        ]

    assert kinds() == [("mt", "np-meshtrain-operator")]  # watch.mode all: no namespace known
    assert kinds("--set", "networkPolicy.trainerNamespaces={a,b}") == [
        ("mt", "np-meshtrain-operator"), ("a", "np-meshtrain-trainers"), ("b", "np-meshtrain-trainers"),
    ]  # fmt: skip
    assert kinds("--set", "networkPolicy.enabled=false") == []
    off = run(tools, "helm", "template", "np", str(CHART), "--namespace", "mt",
              "--set", "networkPolicy.enabled=false", "--set", "networkPolicy.trainerNamespaces={a}")  # fmt: skip
    assert off.returncode == 0, off.stderr
    assert "--gang-network-policy-namespace" not in off.stdout  # no per-gang policy either
    assert "GANG_NETWORK_POLICY" not in off.stdout  # nor its peers
    assert "networkpolicies" not in off.stdout  # nor the RBAC to create one
    outside = {"ipBlock": {"cidr": "192.0.2.0/24"}}
    rendered = run(tools, "helm", "template", "np", str(CHART), "--namespace", "mt",
                   "--set", "networkPolicy.trainerNamespaces={a}",
                   "--set-json", f"networkPolicy.extraIngressFrom=[{json.dumps(outside)}]")  # fmt: skip
    policies = [
        d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "NetworkPolicy"
    ]
    assert [p["spec"]["ingress"][-1]["from"][-1] for p in policies] == [outside, outside]
    [deployment] = [
        d for d in yaml.safe_load_all(rendered.stdout) if d and d["kind"] == "Deployment"
    ]
    env = {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}  # fmt: skip
    assert (
        json.loads(env["MESHTRAIN_GANG_NETWORK_POLICY_METRICS_PEERS"])[-1] == outside
    )  # gangs too
    assert kinds("--set", "operator.deploy=false", "--set", "networkPolicy.trainerNamespaces={a}") == [
        ("a", "np-meshtrain-trainers")
    ]  # fmt: skip
