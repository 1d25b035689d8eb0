"""The operator at scale on a real kube-apiserver + etcd: 10,000 nodes, 100,000 foreign pods, 1,000 jobs.

Nodes are simulated (Node objects with GPU capacity, Ready, no kubelet);
foreign pods are bound to them (``spec.nodeName``), one in ten holding a GPU.
With all of it present, it measures:

1. operator start-up: until its informer cache holds every pod and node;
2. RSS of the operator process (target < 500 MB) after start-up, after 1,000
   TrainingJobs (``--placed`` of them run a 1-pod gang, the rest suspended) and
   at the end;
3. API calls per reconcile while the 1,000 jobs are reconciled, by verb, from
   the operator's own ``meshtrain_operator_api_requests_total`` and
   ``meshtrain_operator_reconcile_duration_seconds_count`` (no LIST expected:
   reads come from the cache);
4. apply -> all pods ungated of a 128-pod gang (target < 2 s), ``--repeat``
   times, each beside the same API calls made without the operator.

    python benchmarks/bench_operator_scale.py [--nodes 10000] [--foreign-pods 100000]
        [--jobs 1000] [--placed 100] [--repeat 3]

The fill takes minutes; to measure more than once, fill a control plane that stays
(``--fill-only``, stopped with SIGTERM) and measure on it (``--kubeconfig``).

Writes ``benchmarks/results/operator_scale-<host>.json`` with the machine and
its load average (a shared machine: compare ratios, not absolute times).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import re
import signal
import statistics
import sys
import tempfile
import time
import urllib.request
from typing import Any

import kubernetes
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from meshtrain.sandbox import controlplane
from meshtrain.sandbox.controlplane.ports import pick_free_port

sys.path.append(str(pathlib.Path(__file__).resolve().parent.parent))
from benchmarks import bench_operator, machine

GPUS_PER_NODE = 8
IN_FLIGHT = 64
"""Concurrent create requests while filling the cluster."""


async def _fill(kubeconfig: str, nodes: int, pods: int) -> dict[str, float]:
    """Create the nodes (status included, as a kubelet registers) and the bound foreign pods."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=configuration)
    configuration.connection_pool_maxsize = IN_FLIGHT
    async with k8s.ApiClient(configuration) as api:
        core = k8s.CoreV1Api(api)
        limit = asyncio.Semaphore(IN_FLIGHT)

        async def create(call: Any, *args: Any) -> None:
            for _ in range(20):
                async with limit:
                    response = await call(*args, _preload_content=False)
                    text = await response.text()
                if response.status < 300:
                    return
                if response.status not in (429, 500, 503, 504):
                    raise RuntimeError(f"create -> {response.status}: {text[:300]}")
                await asyncio.sleep(1.0)  # the API server sheds load: try again
            raise RuntimeError(f"create kept failing: {text[:300]}")

        async def node(index: int) -> None:
            name = f"sim-{index:05d}"
            labels = {"kubernetes.io/hostname": name}
            await create(core.create_node, {"metadata": {"name": name, "labels": labels}})
            # As the node lifecycle controller does once a kubelet is Ready: no not-ready taint.
            await create(core.patch_node, name, {"spec": {"taints": []}})
            status = {
                "capacity": amounts,
                "allocatable": amounts,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            }
            await create(core.patch_node_status, name, {"status": status})

        amounts = {"nvidia.com/gpu": str(GPUS_PER_NODE), "cpu": "96", "memory": "1Ti"}
        amounts["pods"] = "110"
        started = time.perf_counter()
        await asyncio.gather(*(node(i) for i in range(nodes)))
        nodes_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for first in range(0, pods, 10_000):  # in batches: bounded memory of pending coroutines
            await asyncio.gather(
                *(
                    create(core.create_namespaced_pod, "foreign", _foreign_pod(i, nodes))
                    for i in range(first, min(first + 10_000, pods))
                )
            )
        return {"nodes_seconds": nodes_seconds, "pods_seconds": time.perf_counter() - started}


def _foreign_pod(index: int, nodes: int) -> dict[str, Any]:
    requests, limits = {"cpu": "100m", "memory": "64Mi"}, {}
    if index % 10 == 0:  # extended resources: the limit is the request
        requests["nvidia.com/gpu"] = limits["nvidia.com/gpu"] = "1"
    return {
        "metadata": {"name": f"foreign-{index:06d}", "labels": {"app": "foreign"}},
        "spec": {
            "nodeName": f"sim-{index % nodes:05d}",
            "containers": [
                {
                    "name": "c",
                    "image": "pause",
                    "resources": {"requests": requests, "limits": limits},
                }
            ],
        },
    }


def _count(lister: Any) -> int:
    """Objects of a list, from one page's remainingItemCount."""
    page = lister(limit=1)
    return len(page.items) + int(page.metadata.remaining_item_count or 0)


def _control_plane_pids(directory: pathlib.Path) -> dict[str, int]:
    """kube-apiserver and etcd whose command lines name ``directory`` (the control plane's)."""
    found = {}
    for proc in pathlib.Path("/proc").iterdir():
        try:
            command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(directory) in command:
            for name in ("kube-apiserver", "etcd"):
                if command.split(" ", 1)[0].endswith(name):
                    found[name] = int(proc.name)
    return found


def _metrics(port: int) -> dict[str, float]:
    """API requests by verb and reconcile passes, from the operator's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for verb, value in re.findall(
        r'^meshtrain_operator_api_requests_total\{[^}]*verb="(\w+)"[^}]*\} (\S+)$', text, re.M
    ):
        found[verb] = found.get(verb, 0.0) + float(value)
    passes = re.findall(  # one series per job namespace
        r"^meshtrain_operator_reconcile_duration_seconds_count(?:\{[^}]*\})? (\S+)$", text, re.M
    )
    found["reconciles"] = sum(float(value) for value in passes)
    return found


def _wait_log(log: pathlib.Path, text: str, timeout: float) -> float:
    started = time.perf_counter()
    while time.perf_counter() - started < timeout:
        if log.exists() and text in log.read_text(errors="replace"):
            return time.perf_counter() - started
        time.sleep(0.5)
    raise TimeoutError(f"operator log never said {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=10_000)
    parser.add_argument("--foreign-pods", type=int, default=100_000)
    parser.add_argument("--jobs", type=int, default=1000)
    parser.add_argument("--placed", type=int, default=100)
    parser.add_argument("--pods", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--kubeconfig",
        help="measure on an API server this script filled before (no fill; fresh namespaces)",
    )
    parser.add_argument(
        "--fill-only",
        action="store_true",
        help="fill a new control plane, print its kubeconfig and keep it until SIGTERM/SIGINT "
        "(then measure with --kubeconfig)",
    )
    args = parser.parse_args(argv)
    workdir = pathlib.Path(tempfile.mkdtemp(prefix="bench-operator-scale-"))
    log = workdir / "operator.log"
    results: dict[str, Any] = {
        "nodes": args.nodes,
        "foreign_pods": args.foreign_pods,
        "jobs": args.jobs,
        "placed": args.placed,
        "gang_pods": args.pods,
        "rss_target_mb": 500,
        "gang_target_seconds": 2.0,
    }
    with contextlib.ExitStack() as stack:
        if args.kubeconfig:  # an API server this script filled before: measure again, skip the fill
            kubeconfig, suffix = args.kubeconfig, f"-{int(time.time())}"
            pids = _control_plane_pids(pathlib.Path(kubeconfig).resolve().parent.parent)
            results["reused_cluster"] = kubeconfig
        else:
            plane = stack.enter_context(controlplane.ControlPlane())
            kubeconfig, suffix = str(plane.kubeconfig_path), ""
            pids = {"kube-apiserver": plane.pids()["kube-apiserver"], "etcd": plane.pids()["etcd"]}
        api = kubernetes.config.new_client_from_config(config_file=kubeconfig)
        core, custom = kubernetes.client.CoreV1Api(api), kubernetes.client.CustomObjectsApi(api)
        spaces = {k: f"{k}{suffix}" for k in ("bench", "memory", "floor")}
        for namespace in spaces.values():
            core.create_namespace({"metadata": {"name": namespace}})
        if not args.kubeconfig:
            bench_operator._install(api, kubeconfig, str(plane.binaries.kubectl))
            core.create_namespace({"metadata": {"name": "foreign"}})
            print(f"filling: {args.nodes} nodes, {args.foreign_pods} foreign pods", flush=True)
            results["fill"] = asyncio.run(_fill(kubeconfig, args.nodes, args.foreign_pods))
            print(f"filled: {results['fill']}", flush=True)
            if args.fill_only:
                signal.signal(signal.SIGTERM, signal.default_int_handler)
                print(f"kubeconfig: {kubeconfig} (kept until SIGTERM)", flush=True)
                with contextlib.suppress(KeyboardInterrupt):
                    signal.pause()
                return 0
        results["nodes_present"] = _count(core.list_node)
        results["pods_present"] = _count(core.list_pod_for_all_namespaces)
        metrics_port = pick_free_port()
        started = time.perf_counter()
        process, _ = bench_operator._start_operator(
            kubeconfig,
            log,
            "--standalone",
            "--log-format",
            "text",
            "--resync-seconds",
            "300",
            metrics_port=metrics_port,
            scope=tuple(f"--namespace={n}" for n in (spaces["bench"], spaces["memory"])),
        )
        try:
            _wait_log(log, "cache of pods filled", 900)
            results["startup_seconds"] = time.perf_counter() - started
            time.sleep(2)
            results["rss_after_startup_mb"] = bench_operator._rss_mb(process.pid)
            print(
                f"operator cache filled after {results['startup_seconds']:.1f} s, "
                f"RSS {results['rss_after_startup_mb']:.0f} MB",
                flush=True,
            )
            before = _metrics(metrics_port)
            results["memory"] = bench_operator.memory_with_jobs(
                custom, spaces["memory"], args.jobs, args.placed, process.pid
            )
            after = _metrics(metrics_port)
            delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
            passes = delta.pop("reconciles") or 1.0
            results["api_calls_during_jobs"] = delta
            results["reconciles_during_jobs"] = passes
            results["api_calls_per_reconcile"] = {k: v / passes for k, v in delta.items()}
            print(f"{args.jobs} jobs reconciled: {results['memory']}", flush=True)
            pids["operator"] = process.pid
            results["load_average_before_gangs"] = os.getloadavg()
            timings, cpu, floors, phases = bench_operator.gang_latency(
                core,
                custom,
                kubeconfig,
                spaces["bench"],
                args.repeat,
                args.pods,
                pids,
                floor=spaces["floor"],
            )
            results["load_average_after_gangs"] = os.getloadavg()
            results["gang_latency_seconds"] = timings
            results["gang_cpu_seconds"] = cpu
            results["api_floor_seconds"] = floors
            results["gang_phases_seconds"] = phases
            results["gang_over_floor_ratio_median"] = statistics.median(
                t / f for t, f in zip(timings, floors, strict=True)
            )
            results["rss_end_mb"] = bench_operator._rss_mb(process.pid)
        finally:
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
    path = machine.write_results("operator_scale", results)
    rss = max(results["rss_after_startup_mb"], results["memory"]["rss_after_mb"])
    rss = max(rss, results["rss_end_mb"])
    calls = results["api_calls_per_reconcile"]
    print(f"{'measure':<52} {'value':>10} {'target':>8}")
    print(
        f"{'operator start-up until the cache is filled (s)':<52} {results['startup_seconds']:>10.1f}"
    )
    print(f"{'operator RSS, largest seen (MB)':<52} {rss:>10.0f} {'< 500':>8}")
    print(f"{'API calls per reconcile (all verbs)':<52} {sum(calls.values()):>10.2f}")
    for verb, value in sorted(calls.items()):
        print(f"{f'  {verb}':<52} {value:>10.2f}")
    print(
        f"{f'apply -> {args.pods} pods ungated, median (s)':<52} {statistics.median(timings):>10.2f} {'< 2':>8}"
    )
    print(f"{f'apply -> {args.pods} pods ungated, best (s)':<52} {min(timings):>10.2f}")
    print(f"{'same calls without operator, median (s)':<52} {statistics.median(floors):>10.2f}")
    print(
        f"{'load average (1, 5, 15 min) after the gangs':<52} {' '.join(f'{x:.1f}' for x in results['load_average_after_gangs']):>10}"
    )
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
