"""The sandbox end to end: a dp2·pp2·tp1 TrainingJob over two pods on two nodes, in real containers.

1. ``up``: real etcd, kube-apiserver, scheduler and controller-manager;
   two kubelet nodes (each with its containerd and kube-proxy) and CoreDNS;
   the images built from the Dockerfiles; the operator installed by helm as
   the chart's Deployment; Prometheus.
2. The example job, in a namespace enforcing the restricted Pod Security
   Standard: its pods are bound by the real scheduler to the nodes the
   operator planned (two nodes of two GPUs: the gang's traffic crosses
   between their namespaces), run from the trainer image, train to Succeeded, and
   Prometheus scraped their metrics at the pod IPs; kubectl logs, exec and
   describe work.
3. The same job again without in-place recovery (``runPolicy.recovery.inPlace: false``), and one
   rank's container killed mid-run: the gang restarts, resumes from its checkpoint and succeeds
   with status.restarts == 1.
4. The same job again, re-laid-out mid-run with ``kubectl patch`` (dp2·pp2 ->
   dp4·pp1) between two periodic checkpoints: the deleted gang saves the step
   it stopped at, and the rebuilt gang resumes there, resharded.
5. A user's own DDP program (spec.trainer type custom) in the same image.
5b. The gang's own NetworkPolicy and the chart's trainer policy, enforced by kube-router's
   firewall on each node: while a gang trains, a pod with the gang's label can connect to its
   rank 0's rendezvous port, while a trainer of another job, a pod of another namespace and a
   pod of the namespace that is no trainer cannot; the gang and Prometheus are undisturbed.
6. ``down`` leaves no process, container, mount or network namespace behind.
"""

from __future__ import annotations

import ipaddress
import json
import os
import pathlib
import re
import signal
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator

import pytest
import yaml

from meshtrain.operator.policy import naming
from meshtrain.sandbox import example, node, supervisor
from meshtrain.sandbox.controlplane import binaries
from tests.builders import JobBuilder

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1800)]

EXAMPLE = example.DEFAULT_EXAMPLE


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[supervisor.Paths, dict]]:
    paths = supervisor.Paths(tmp_path_factory.mktemp("sandbox"))
    paths.root.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    state = supervisor.up(paths)
    print(f"\nsandbox up in {time.monotonic() - started:.1f}s; timings {state.get('timings')}")
    try:
        yield paths, state
    finally:
        recorded = supervisor.read_state(paths) or {}
        groups = list(recorded.get("groups", {}).values())
        leftovers = supervisor.down(paths)
        assert leftovers == [], f"processes left behind after down: {leftovers}"
        assert not [g for g in groups if supervisor.group_members(g)]
        nodes = supervisor.node_states(recorded)
        assert len(nodes) == len(supervisor.NODES)
        for recorded_node in nodes:
            assert node.leftovers(recorded_node) == [], "containers or shims left behind"
            assert not pathlib.Path(f"/run/netns/{recorded_node['netns']}").exists()
        mounts = pathlib.Path("/proc/self/mountinfo").read_text()
        assert str(paths.root) not in mounts, "mounts left behind"


def _events(paths: supervisor.Paths, namespace: str, reason: str) -> list[dict]:
    out = example.kubectl(
        paths,
        "get",
        "events",
        "-n",
        namespace,
        "--field-selector",
        f"reason={reason}",
        "-o",
        "json",
    )
    return json.loads(out)["items"]


def _pods(paths: supervisor.Paths, name: str) -> list[dict]:
    out = example.kubectl(
        paths, "get", "pods", "-n", "default", "-l", f"meshtrain.io/job={name}", "-o", "json"
    )
    return json.loads(out)["items"]


def _prometheus(state: dict, query: str) -> list[dict]:
    url = f"{state['prometheus_url']}/api/v1/query?" + urllib.parse.urlencode({"query": query})
    with urllib.request.urlopen(url, timeout=10) as answer:
        return json.loads(answer.read())["data"]["result"]


def _example(name: str, claim: str) -> JobBuilder:
    """The sandbox's example job renamed, its checkpoints on ``claim``: to change section by section."""
    document = yaml.safe_load(EXAMPLE.read_text())
    return JobBuilder.from_manifest(document, name=name).checkpoint(claimName=claim)


def _written(paths: supervisor.Paths, job: JobBuilder) -> pathlib.Path:
    """``job``'s manifest in a file under the sandbox's root, for :func:`example.apply`."""
    manifest = job.manifest()
    path = paths.root / f"{manifest['metadata']['name']}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def test_example_trains_on_planned_nodes_and_exports_metrics(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, state = sandbox
    started = time.monotonic()
    namespace, name = example.apply(paths, EXAMPLE)
    seen_pods: dict[str, str] = {}
    pod_ips: dict[str, str] = {}
    exec_answers: list[str] = []

    def record(line: str) -> None:
        print(line)
        for pod in _pods(paths, name):
            if pod["spec"].get("nodeName"):
                seen_pods[pod["metadata"]["name"]] = pod["spec"]["nodeName"]
            if pod["status"].get("podIP") and pod["spec"].get("nodeName"):
                pod_ips[pod["status"]["podIP"]] = pod["spec"]["nodeName"]
            if pod["status"].get("phase") == "Running" and not exec_answers:
                # kubectl exec through the apiserver and kubelet; the pod resolves its gang's Service name.
                exec_answers.append(
                    example.kubectl(
                        paths,
                        "exec",
                        "-n",
                        namespace,
                        pod["metadata"]["name"],
                        "--",
                        "python",
                        "-c",
                        "import os, socket; print(os.getuid(), socket.gethostbyname('kubernetes.default'))",
                        check=False,
                    )
                )

    final = example.follow(paths, namespace, name, timeout=900, on_change=record)
    print(f"example finished in {time.monotonic() - started:.1f}s")
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert status["layout"] == "dp2·pp2·tp1"
    steps = yaml.safe_load(EXAMPLE.read_text())["spec"]["training"]["steps"]
    assert status["progress"]["step"] == steps, (
        f"final progress from rank 0's termination message: {status['progress']}"
    )
    assert exec_answers and exec_answers[0].split() == ["65532", "10.0.0.1"], exec_answers
    logs = _gang_logs(paths, namespace, name, 0)
    assert logs.strip(), "kubectl logs returns the trainer containers' output (through the kubelet)"
    described = example.kubectl(paths, "describe", "pod", "-n", namespace, next(iter(seen_pods)))
    # The trainer image as the nodes pull it from the sandbox's registry.
    assert "Successfully assigned" in described and node.image_names()[1] in described
    planned = {p["node"] for p in status["placement"]}
    assert len(status["placement"]) == 2
    assert set(seen_pods.values()) <= planned and seen_pods, (seen_pods, status["placement"])
    assert len(planned) == 2, (
        "two pods of two GPUs on nodes of two GPUs each: the gang spans two nodes"
    )
    cidrs = {n["name"]: ipaddress.ip_network(n["pod_cidr"]) for n in supervisor.node_states(state)}
    assert all(ipaddress.ip_address(ip) in cidrs[node_name] for ip, node_name in pod_ips.items()), (
        "each pod's address is on its own node's pod network",
        pod_ips,
        cidrs,
    )
    events = _events(paths, namespace, "Scheduled")
    scheduled = [e for e in events if e["involvedObject"]["name"] in seen_pods]
    assert scheduled and all(
        e.get("reportingComponent") == "default-scheduler"
        or e["source"].get("component") == "default-scheduler"
        for e in scheduled
    ), "pods are bound by the real scheduler"
    deadline = time.monotonic() + 30
    series: list[dict] = []
    while time.monotonic() < deadline and not series:
        series = _prometheus(
            state,
            f'max by (rank) (max_over_time(meshtrain_tokens_total{{trainingjob="{name}"}}[30m]))',
        )
        time.sleep(2)
    assert {s["metric"]["rank"] for s in series} == {"0", "1", "2", "3"}, series
    assert all(float(s["value"][1]) > 0 for s in series)
    scraped = _prometheus(
        state,
        f'max by (instance) (max_over_time(meshtrain_tokens_total{{trainingjob="{name}"}}[30m]))',
    )
    assert {s["metric"]["instance"].rsplit(":", 1)[0] for s in scraped} == set(pod_ips), (
        "Prometheus scraped the pods at their pod IPs",
        scraped,
        pod_ips,
    )
    # MESHTRAIN_LOG_DIR=<checkpoint.path>/<ns>/<name>/logs: the step log and every rank's trace outlive the pods on the claim
    claim = yaml.safe_load(EXAMPLE.read_text())["spec"]["checkpoint"]["claimName"]
    logs = paths.root / "volumes" / namespace / claim / namespace / name / "logs"
    assert (logs / "steps.jsonl").is_file(), sorted(p.name for p in logs.parent.iterdir())
    assert sorted(p.name for p in (logs / "trace").glob("rank-*.jsonl")) == [
        f"rank-{r}.jsonl" for r in range(4)
    ]
    assert example.timeline(paths, namespace, name) is not None, (
        "meshtrain timeline draws from the claim's logs"
    )


def _saved_steps(checkpoints: pathlib.Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in checkpoints.glob("step-*"))


def _run_until_checkpoint(
    paths: supervisor.Paths,
    name: str,
    claim: str,
    steps: int,
    at_least: int = 10,
    timeout: float = 600,
    run_policy: dict | None = None,
) -> tuple[str, pathlib.Path, int]:
    """Apply a variant of the example (``run_policy`` merged in); once a checkpoint of ``at_least``
    steps or more is complete, the job still running, return its namespace, checkpoint directory
    and newest checkpoint step."""
    job = _example(name, claim).training(steps=steps).run_policy(**(run_policy or {}))
    namespace, _ = example.apply(paths, _written(paths, job))
    checkpoints = paths.root / "volumes" / namespace / claim / namespace / name
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = (example.job(paths, namespace, name) or {}).get("status") or {}
        assert status.get("phase") not in ("Succeeded", "Failed"), (
            "the job ended before it could be interrupted"
        )
        saved = _saved_steps(checkpoints)
        if saved and saved[-1] >= at_least:
            return namespace, checkpoints, saved[-1]
        time.sleep(0.3)
    raise AssertionError(f"no checkpoint of step {at_least} or later within {timeout}s")


def _wait_for_logged_step(step_log: pathlib.Path, at_least: int, timeout: float = 300) -> int:
    """The last step in ``step_log`` once it is ``at_least`` or more."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = step_log.read_text().splitlines() if step_log.exists() else []
        last = json.loads(lines[-1])["step"] if lines else 0
        if last >= at_least:
            return last
        time.sleep(0.1)
    raise AssertionError(f"{step_log} never reached step {at_least}")


def _gang_logs(paths: supervisor.Paths, namespace: str, name: str, attempt: int) -> str:
    """``kubectl logs`` of every pod of one gang attempt."""
    return example.kubectl(
        paths,
        "logs",
        "-n",
        namespace,
        "--tail=-1",
        "-l",
        f"meshtrain.io/job={name},meshtrain.io/attempt={attempt}",
    )


RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)(?:, written by job uid ([0-9a-f-]+))?\)")
"""Global rank 0's line when a gang loads a storage checkpoint (``Checkpointer.restore`` in
trainer/meshtrain/trainer/checkpointing/checkpointer.py): ``resumed from <dir> (step N, written
by job uid U)``; the writer's UID is there when the checkpoint's marker records it (every
checkpoint a pod writes, docs/checkpoints.md)."""


def _resumes(logs: str) -> list[tuple[str, int, str | None]]:
    """Every storage resume in ``logs``: (checkpoint directory, step, writer's job UID or None)."""
    return [(m[1], int(m[2]), m[3]) for m in RESUMED.finditer(logs)]


def _kill_container(paths: supervisor.Paths, pod: dict, signum: int = signal.SIGKILL) -> int:
    """Signal a pod's container's main process from the host (SIGKILL: as a crashed node process
    would die); returns its pid."""
    container = pod["status"]["containerStatuses"][0]["containerID"].removeprefix("containerd://")
    state = supervisor.read_state(paths) or {}
    its_node = next(
        n for n in supervisor.node_states(state) if n["name"] == pod["spec"]["nodeName"]
    )
    ctr = [
        str(binaries.locate_node().ctr),
        "--address",
        its_node["socket"],
        "--namespace",
        "k8s.io",
    ]
    listed = subprocess.run(
        [*ctr, "tasks", "ls"], capture_output=True, text=True, check=True
    ).stdout
    pid = next(int(line.split()[1]) for line in listed.splitlines() if line.startswith(container))
    os.kill(pid, signum)
    return pid


def test_killed_rank_restarts_the_gang_and_resumes_from_checkpoint(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, _state = sandbox
    name, steps = "sandbox-restart", 300
    namespace, checkpoints, saved = _run_until_checkpoint(
        paths, name, "restart-checkpoints", steps, run_policy={"recovery": {"inPlace": False}}
    )  # the full gang rebuild; tests/e2e/test_sandbox_in_place.py restarts the container in place
    pod = next(
        p
        for p in _pods(paths, name)
        if p["metadata"]["labels"].get("meshtrain.io/node-rank") == "1"
    )
    killed = _kill_container(paths, pod)
    print(
        f"killed the container (pid {killed}) of pod {pod['metadata']['name']} after checkpoint step {saved}"
    )
    final = example.follow(paths, namespace, name, timeout=900)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert status["restarts"] == 1
    final_saved = _saved_steps(checkpoints)
    assert final_saved[-1] == steps, f"trained to the last step: checkpoints {final_saved}"
    assert "resumed from" in _gang_logs(paths, namespace, name, 1), (
        "the restarted gang resumes from the checkpoint"
    )


def test_layout_change_rebuilds_the_gang_and_resumes_resharded(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    """kubectl patch dp2·pp2 -> dp4·pp1 mid-run: new pods, the checkpoint loaded at the new layout, no restart counted.

    No periodic checkpoints: the only one before the end is the one the
    deleted gang saves when SIGTERM stops it (``trainer/meshtrain/trainer/guards/stopping.py``).
    """
    paths, _state = sandbox
    name, claim, steps = "sandbox-reshape", "reshape-checkpoints", 60
    job = _example(name, claim).training(steps=steps).checkpoint(intervalSteps=1000)
    namespace, _ = example.apply(paths, _written(paths, job))
    checkpoints = paths.root / "volumes" / namespace / claim / namespace / name
    step_log = checkpoints / "logs" / "steps.jsonl"
    trained = _wait_for_logged_step(step_log, at_least=10)
    assert _saved_steps(checkpoints) == [], "no periodic checkpoint in this variant"
    old_pods = {p["metadata"]["uid"] for p in _pods(paths, name)}
    print(f"patching {name} to dp4·pp1·tp1 after step {trained}")
    # raw on purpose: a merge patch as a user types it to kubectl patch
    example.kubectl(
        paths,
        "patch",
        "tj",
        name,
        "-n",
        namespace,
        "--type",
        "merge",
        "-p",
        json.dumps({"spec": {"parallelism": {"data": 4, "pipeline": 1, "microBatches": 2}}}),
    )
    final = example.follow(paths, namespace, name, timeout=900)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert status["layout"] == "dp4·pp1·tp1" and status["restarts"] == 0
    assert not old_pods & {p["metadata"]["uid"] for p in _pods(paths, name)}
    assert _saved_steps(checkpoints)[-1] == steps
    logs = _gang_logs(paths, namespace, name, 0)
    resumes = _resumes(logs)
    assert len(resumes) == 1, f"the rebuilt gang resumes from the checkpoint once: {logs[-3000:]}"
    [(directory, resumed, writer)] = resumes
    assert trained <= resumed < steps and resumed in _saved_steps(checkpoints), (
        "the deleted gang saved the step it stopped at (graceful stop on SIGTERM)",
        resumed,
        _saved_steps(checkpoints),
    )
    # the job's own directory (checkpoint.path/<namespace>/<name>), written by this very job: a
    # layout change keeps the job (its UID), status says so too
    assert directory == f"/checkpoints/{namespace}/{name}/step-{resumed:08d}", directory
    assert writer == final["metadata"]["uid"] == status["progress"]["resumedFromUid"], writer
    logged = [json.loads(line)["step"] for line in step_log.read_text().splitlines()]
    assert logged == list(range(1, steps + 1)), (
        f"no step lost and trained twice across the rebuild: {logged}"
    )
    events = _events(paths, namespace, "SpecChanged")
    assert any(
        e["involvedObject"]["name"] == name and "dp4·pp1·tp1" in e["message"] for e in events
    ), events


def test_a_users_own_ddp_program_runs_under_the_same_placement_and_gang(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, _state = sandbox
    manifest = EXAMPLE.parent / "custom-ddp.yaml"
    document = yaml.safe_load(manifest.read_text())
    namespace, name = example.apply(paths, manifest)
    final = example.follow(paths, namespace, name, timeout=600, on_change=print)
    status = final["status"]
    assert status["phase"] == "Succeeded", json.dumps(status, indent=2)
    assert status["layout"] == "dp4·pp1·tp1" and len(status["placement"]) == 2
    # The program's own checkpoint, written by its rank 0 after the last step of a 4-rank gang.
    claim = document["spec"]["checkpoint"]["claimName"]
    root = paths.root / "volumes" / namespace / claim
    saved = root / namespace / name / "ddp-example.pt"
    assert saved.is_file(), (
        "the program checkpoints to $MESHTRAIN_JOB_CHECKPOINT_DIR, its own directory on the claim"
    )
    import torch  # noqa: PLC0415 - only this test reads a torch file

    assert torch.load(saved)["step"] == int(document["spec"]["trainer"]["args"][1])
    logs = _gang_logs(paths, namespace, name, 0)
    assert "ddp example: world 4" in logs, "torchrun formed one 4-rank group across both pods"


PROBE = (
    "import socket, sys, time\n"
    "deadline = time.monotonic() + float(sys.argv[3])\n"
    "while True:\n"
    "    try:\n"
    "        socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3).close()\n"
    "    except OSError as err:\n"
    "        if time.monotonic() > deadline:\n"
    "            print('refused', err); sys.exit(3)\n"
    "        time.sleep(1)\n"
    "    else:\n"
    "        print('connected'); break\n"
)
"""Try to connect to argv[1]:argv[2] for argv[3] seconds (the enforcer learns a new pod's address
within seconds: a peer is let in once it has)."""
RESTRICTED_CONTAINER = {
    "runAsNonRoot": True,
    "runAsUser": 65532,
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
    "seccompProfile": {"type": "RuntimeDefault"},
}


def _probe(
    paths: supervisor.Paths, namespace: str, name: str, labels: dict, target: str, seconds: int
) -> str:
    """A pod that tries to connect to ``target`` (ip:port) for ``seconds``; its answer, once it ended."""
    _operator, trainer_image, _pause = node.image_names()
    ip, port = target.rsplit(":", 1)
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "containers": [
                {
                    "name": "probe",
                    "image": trainer_image,
                    "imagePullPolicy": "Never",
                    "command": ["python", "-c", PROBE, ip, port, str(seconds)],
                    "securityContext": RESTRICTED_CONTAINER,
                }
            ],
        },
    }
    example.kubectl(paths, "apply", "-f", "-", stdin=json.dumps(pod))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        phase = example.kubectl(
            paths, "get", "pod", name, "-n", namespace, "-o", "jsonpath={.status.phase}"
        )
        if phase in ("Succeeded", "Failed"):
            return example.kubectl(paths, "logs", "-n", namespace, name).strip()
        time.sleep(1)
    raise AssertionError(f"probe {namespace}/{name} did not finish")


def _trainer_namespaces(paths: supervisor.Paths, *namespaces: str) -> None:
    """`helm upgrade` the sandbox's release with ``networkPolicy.trainerNamespaces`` = ``namespaces``,
    as an administrator does: the chart's trainer policy goes into (or out of) those namespaces,
    and the operator, rolled with its new flags, gives (or stops giving) each gang there its
    own policy.  The install's other values stay (Prometheus on the host is let in by ipBlock)."""
    found = binaries.locate()
    upgraded = subprocess.run(
        [str(found.helm), "upgrade", supervisor.RELEASE, str(supervisor.REPO / "charts" / "meshtrain"),
         "--namespace", supervisor.NAMESPACE, "--reuse-values",
         "--set-json", f"networkPolicy.trainerNamespaces={json.dumps(list(namespaces))}",
         "--kubeconfig", str(paths.kubeconfig), "--wait", "--timeout", "5m"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert upgraded.returncode == 0, upgraded.stderr


def test_a_pod_outside_the_gang_cannot_connect_while_the_gang_trains(
    sandbox: tuple[supervisor.Paths, dict],
) -> None:
    paths, state = sandbox
    job = _example("fenced", "fenced-checkpoints").training(steps=100000)
    namespace = job.manifest()["metadata"].get("namespace", "default")
    example.kubectl(paths, "create", "namespace", namespace, check=False)
    _trainer_namespaces(paths, namespace)  # before the gang: its policy comes with it
    namespace, name = example.apply(paths, _written(paths, job))
    example.kubectl(paths, "create", "namespace", "outside", check=False)
    try:
        deadline = time.monotonic() + 600
        rank0: dict = {}
        status: dict = {}
        while time.monotonic() < deadline:
            status = (example.job(paths, namespace, name) or {}).get("status") or {}
            pods = {p["metadata"]["name"]: p for p in _pods(paths, name)}
            rank0 = next((p for n, p in pods.items() if n.endswith("-0")), {})
            if (status.get("progress") or {}).get("step", 0) >= 1 and rank0:
                break
            time.sleep(2)
        assert rank0, f"the gang never trained: {status}"
        target = (
            f"{rank0['status']['podIP']}:{naming.MASTER_PORT}"  # torchrun's store, open all run
        )
        # The gang's own pods connect (it trained: rendezvous and collectives), and so does a
        # pod with the gang's label: the port is open to the gang ...
        own = _probe(paths, namespace, "gang-probe", {naming.LABEL_JOB: name}, target, 60)
        assert own == "connected", own
        # ... while a trainer pod of another job of this namespace cannot connect, nor one
        # outside the namespace, nor one of the namespace that is no trainer.
        other = _probe(paths, namespace, "other-job-probe", {naming.LABEL_JOB: "other"}, target, 20)  # fmt: skip
        assert other.startswith("refused"), other
        outsider = _probe(paths, "outside", "outsider-probe", {"app": "curious"}, target, 20)
        assert outsider.startswith("refused"), outsider
        neighbour = _probe(paths, namespace, "neighbour-probe", {"app": "curious"}, target, 20)
        assert neighbour.startswith("refused"), neighbour
        # The gang trains on, and Prometheus (on the host, let in by ipBlock) still scrapes it.
        before = (example.job(paths, namespace, name) or {})["status"]["progress"]["step"]
        time.sleep(10)
        after = (example.job(paths, namespace, name) or {})["status"]
        assert after["phase"] == "Running" and after["progress"]["step"] > before, after
        assert _prometheus(state, f'meshtrain_tokens_total{{trainingjob="{name}"}}'), "not scraped"
    finally:
        example.kubectl(paths, "delete", "trainingjob", name, "-n", namespace, "--wait=false", check=False)  # fmt: skip
        # Its gang stops (a checkpoint, then exit) before the sandbox goes: no container left running.
        example.kubectl(paths, "wait", "--for=delete", "pod", "-l", f"{naming.LABEL_JOB}={name}",
                        "-n", namespace, "--timeout=180s", check=False)  # fmt: skip
        _trainer_namespaces(paths)  # the chart's trainer policy goes, and the operator's flag
        example.kubectl(paths, "delete", "namespace", "outside", "--wait=false", check=False)
        for probe in ("gang-probe", "other-job-probe", "neighbour-probe"):
            example.kubectl(paths, "delete", "pod", probe, "-n", namespace, "--wait=false", check=False)  # fmt: skip
