"""Benchmark of the operator against a real kube-apiserver + etcd.

What it measures:

1. gang latency: ``apply`` of a 128-pod TrainingJob -> all 128 pods created and
   every scheduling gate lifted (target < 2 s), repeated ``--repeat`` times;
2. memory: resident set size of the ``meshtrain operator`` process once it has
   reconciled 1,000 TrainingJobs (target < 300 MB): ``--placed`` of them run a
   1-pod gang, the rest are suspended.

The gang latency is also compared, run by run, with the same API calls made
without the operator (create the gated pods, lift the gates): on a shared,
noisy machine the ratio is the number to trust.

It starts its own control plane (:class:`meshtrain.sandbox.controlplane.ControlPlane`),
installs the CRDs, creates Node objects with GPU capacity (no kubelet) and runs
the operator as a subprocess, as a user would.  It prints a table and writes
``benchmarks/results/operator-<host>.json``.

Not a scheduler or kubelet benchmark — no pod is bound or started.

    python benchmarks/bench_operator.py [--repeat 3] [--jobs 1000] [--placed 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from typing import Any, TypeVar

import kubernetes

from meshtrain.api import crd, loading
from meshtrain.operator.cluster import kube
from meshtrain.operator.policy import builders, identity
from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane.ports import pick_free_port

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import machine

REPO = pathlib.Path(__file__).resolve().parent.parent
GROUP, VERSION, PLURAL = "meshtrain.io", "v1alpha1", "trainingjobs"


_T = TypeVar("_T")


def _wait(check: Callable[[], _T], timeout: float, interval: float = 0.01) -> _T:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(interval)
    raise TimeoutError("benchmark condition not reached")


def _install(api: kubernetes.client.ApiClient, kubeconfig: str, kubectl: str) -> None:
    kubernetes.client.ApiextensionsV1Api(api).create_custom_resource_definition(crd.build())
    _wait(
        lambda: (
            subprocess.run(
                [kubectl, "--kubeconfig", kubeconfig, "get", "trainingjobs", "-A"],
                capture_output=True,
            ).returncode
            == 0
        ),
        60,
        0.2,
    )


def _add_nodes(core: kubernetes.client.CoreV1Api, count: int, gpus: int) -> None:
    for index in range(count):
        name = f"gpu-{index:04d}"
        core.create_node({"metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}}})
        core.patch_node(name, {"spec": {"taints": []}})  # as the node lifecycle controller would
        amounts = {"nvidia.com/gpu": str(gpus), "cpu": "96", "memory": "1Ti", "pods": "110"}
        ready = [{"type": "Ready", "status": "True", "reason": "KubeletReady", "message": ""}]
        core.patch_node_status(
            name, {"status": {"capacity": amounts, "allocatable": amounts, "conditions": ready}}
        )


def _job(name: str, namespace: str, pods: int, suspend: bool = False) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "TrainingJob",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {
            "parallelism": {"data": pods},
            "resources": {"gpusPerNode": 1},
            "model": {"preset": "tiny"},
            "runPolicy": {"suspend": suspend},
        },
    }


def _start_operator(
    kubeconfig: str,
    log: pathlib.Path,
    *extra: str,
    metrics_port: int | None = None,
    scope: tuple[str, ...] = ("--all-namespaces",),
) -> tuple[subprocess.Popen[bytes], int]:
    """``meshtrain operator`` with ``extra`` flags; returns it once its liveness endpoint answers."""
    health = pick_free_port()
    command = [
        sys.executable,
        "-m",
        "meshtrain.cli.main",
        "operator",
        *scope,
        "--kubeconfig",
        kubeconfig,
        "--liveness",
        f"http://127.0.0.1:{health}/healthz",
        "--metrics-port",
        str(metrics_port or pick_free_port()),
        "--resync-seconds",
        "30",
        *extra,
    ]
    process = subprocess.Popen(command, stdout=log.open("ab"), stderr=subprocess.STDOUT, cwd=REPO)

    def alive() -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{health}/healthz", timeout=1
            ) as response:
                return response.status == 200
        except OSError:
            return False

    _wait(alive, 60, 0.2)
    return process, health


def _rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (load-independent cost, unlike wall time)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_for_ungated_gang(
    core: kubernetes.client.CoreV1Api, namespace: str, job: str, pods: int, started: float
) -> dict[str, float]:
    """Follow a pod watch (not polling, which would load the API server under test) until the gang is released.

    Returns when (seconds after ``started``, as the watch saw it) the first and the
    last pod appeared and the first and the last gate was lifted.
    """
    gated: dict[str, bool] = {}
    seen: dict[str, float] = {}
    stream = kubernetes.watch.Watch()
    for event in stream.stream(
        core.list_namespaced_pod,
        namespace,
        label_selector=f"meshtrain.io/job={job}",
        timeout_seconds=60,
    ):
        now = time.perf_counter() - started
        pod = event["object"]
        if event["type"] == "DELETED":
            gated.pop(pod.metadata.name, None)
        else:
            gated[pod.metadata.name] = bool(pod.spec.scheduling_gates)
        seen.setdefault("first_created", now)
        if len(gated) == pods:
            seen.setdefault("all_created", now)
        if not all(gated.values()):
            seen.setdefault("first_ungated", now)
        if len(gated) == pods and not any(gated.values()):
            stream.stop()
            seen["all_ungated"] = now
            return seen
    raise TimeoutError(f"gang {job} not released within 60 s")


def api_floor(kubeconfig: str, namespace: str, pods: int, attempt: int) -> dict[str, float]:
    """The same API calls without the operator: create ``pods`` gated pods, then lift their gates.

    Measured side by side with the operator runs (same API server, same moment), it is
    the floor the operator's latency is compared to on a shared, noisy machine.  Returns
    the seconds until every pod was created and until every gate was lifted.
    """
    spec = loading.parse_spec(
        {
            "parallelism": {"data": pods},
            "resources": {"gpusPerNode": 1},
            "model": {"preset": "tiny"},
        }
    )
    job = identity.JobRef(f"floor{attempt}", namespace, "00000000-0000-0000-0000-000000000000")
    manifests = builders.build_pods(job, spec, 0, [f"gpu-{i // 8:04d}" for i in range(pods)])
    for manifest in manifests:
        manifest["metadata"].pop("ownerReferences")

    async def run() -> dict[str, float]:
        client = await kube.Client.connect(kubeconfig=kubeconfig)
        try:
            started = time.perf_counter()
            created = await asyncio.gather(*(client.create(manifest=m) for m in manifests))
            all_created = time.perf_counter() - started
            await client.lift_gates(
                namespace=namespace,
                uids={p["metadata"]["name"]: p["metadata"]["uid"] for p in created if p},
            )
            elapsed = time.perf_counter() - started
            await client.delete_pods(
                namespace=namespace, names=[m["metadata"]["name"] for m in manifests]
            )
            return {"all_created": all_created, "all_ungated": elapsed}
        finally:
            await client.close()

    return asyncio.run(run())


def gang_latency(
    core: kubernetes.client.CoreV1Api,
    custom: kubernetes.client.CustomObjectsApi,
    kubeconfig: str,
    namespace: str,
    repeat: int,
    pods: int,
    pids: dict[str, int],
    floor: str = "floor",
) -> tuple[list[float], list[dict[str, float]], list[float], list[dict[str, Any]]]:
    """Per repetition: seconds from create to every pod existing with no gate, CPU seconds spent,
    the API floor, and both runs' milestones (seconds after the start)."""
    timings, cpu, floors, phases = [], [], [], []
    for attempt in range(repeat):
        name = f"gang{attempt}"
        cpu_before = {k: _cpu_seconds(pid) for k, pid in pids.items()}
        started = time.perf_counter()
        custom.create_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, _job(name, namespace, pods)
        )
        seen = _wait_for_ungated_gang(core, namespace, name, pods, started)
        timings.append(time.perf_counter() - started)
        cpu.append({k: _cpu_seconds(pid) - cpu_before[k] for k, pid in pids.items()})
        custom.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)
        _wait(
            lambda name=name: (
                not core.list_namespaced_pod(
                    namespace, label_selector=f"meshtrain.io/job={name}"
                ).items
            ),
            60,
            0.1,
        )
        bare = api_floor(kubeconfig, floor, pods, attempt)
        floors.append(bare["all_ungated"])
        phases.append({"operator": seen, "floor": bare})
    return timings, cpu, floors, phases


def memory_with_jobs(
    custom: kubernetes.client.CustomObjectsApi, namespace: str, jobs: int, placed: int, pid: int
) -> dict[str, float]:
    before = _rss_mb(pid)
    started = time.perf_counter()
    for index in range(jobs):
        body = _job(f"m{index:04d}", namespace, 1, suspend=index >= placed)
        custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, body)

    def reconciled() -> bool:
        items = custom.list_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL)["items"]
        return (
            sum(
                1 for i in items if (i.get("status") or {}).get("phase") in ("Placing", "Suspended")
            )
            == jobs
        )

    _wait(reconciled, 600, 1.0)
    settle = time.perf_counter() - started
    time.sleep(5)
    return {
        "jobs": jobs,
        "placed": placed,
        "rss_before_mb": before,
        "rss_after_mb": _rss_mb(pid),
        "reconciled_seconds": settle,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--pods", type=int, default=128)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--placed", type=int, default=100)
    args = parser.parse_args(argv)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-operator-"))
    with controlplane.ControlPlane() as plane:
        kubeconfig = str(plane.kubeconfig_path)
        api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        _install(api, kubeconfig, str(plane.binaries.kubectl))
        _add_nodes(core, max(args.pods, args.placed) // 8 + 2, 8)
        for namespace in ("bench", "memory", "floor"):
            core.create_namespace({"metadata": {"name": namespace}})
        process, _ = _start_operator(kubeconfig, workdir / "operator.log")
        try:
            pids = {
                "operator": process.pid,
                "kube-apiserver": plane.pids()["kube-apiserver"],
                "etcd": plane.pids()["etcd"],
            }
            timings, cpu, floors, phases = gang_latency(
                core, custom, kubeconfig, "bench", args.repeat, args.pods, pids
            )
            load = os.getloadavg()
            memory = memory_with_jobs(custom, "memory", args.jobs, args.placed, process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=30)
    results = {
        "gang_latency_seconds": timings,
        "gang_pods": args.pods,
        "gang_target_seconds": 2.0,
        "gang_cpu_seconds": cpu,
        "load_average_during_gangs": load,
        "api_floor_seconds": floors,
        "gang_phases_seconds": phases,
        "gang_over_floor_ratio_median": statistics.median(t / f for t, f in zip(timings, floors)),
        "memory": memory,
        "memory_target_mb": 300,
        "operator_log": str(workdir / "operator.log"),
    }
    path = machine.write_results("operator", results)
    print(f"{'measure':<44} {'value':>10} {'target':>8}")
    print(f"{f'apply -> {args.pods} pods ungated, best (s)':<44} {min(timings):>10.2f} {'< 2':>8}")
    print(
        f"{f'apply -> {args.pods} pods ungated, median (s)':<44} {statistics.median(timings):>10.2f} {'< 2':>8}"
    )
    print(f"{'same calls without operator, median (s)':<44} {statistics.median(floors):>10.2f}")
    print(
        f"{'operator / no-operator ratio, median':<44} {results['gang_over_floor_ratio_median']:>10.2f}"
    )
    best = min(range(len(timings)), key=lambda i: timings[i])
    for component in cpu[best]:
        print(f"{f'  CPU seconds of {component} (that run)':<44} {cpu[best][component]:>10.2f}")
    print(f"{'load average (1, 5, 15 min) meanwhile':<44} {' '.join(f'{x:.1f}' for x in load):>10}")
    print(
        f"{f'operator RSS, {args.jobs} jobs (MB)':<44} {memory['rss_after_mb']:>10.1f} {'< 300':>8}"
    )
    print(f"{'operator RSS before the jobs (MB)':<44} {memory['rss_before_mb']:>10.1f}")
    print(f"{f'{args.jobs} jobs reconciled after (s)':<44} {memory['reconciled_seconds']:>10.1f}")
    print(f"results: {path}")
    print(json.dumps(results["memory"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
