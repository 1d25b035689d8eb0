"""A KWOK fleet of 8-GPU nodes in blocks, racks (leaves) and NVLink domains, and its pods' lifecycles.

:class:`Shape` says how many nodes and how they nest; :func:`node` is one Node as a GPU cloud labels
it (the labels Kueue TAS reads); :func:`stages` are the KWOK Stages that run the pods the real
kube-scheduler binds to those nodes, and finish or fail them when their annotations say
(:func:`lifecycle_annotations`); :class:`Kwok` runs the ``kwok`` controller (built by the full
``scripts/bootstrap.sh`` from the ``sigs.k8s.io/kwok`` module) against a control plane, and
:func:`create_nodes` registers the fleet.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pathlib
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import yaml
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from meshtrain.sandbox.controlplane import binaries

DEFAULT_KWOK_VERSION = "v0.8.0"
"""The KWOK release the project pins; must equal the default in scripts/bootstrap.sh."""
KWOK_VERSION = os.environ.get("MESHTRAIN_KWOK_VERSION", DEFAULT_KWOK_VERSION)
GPU = "nvidia.com/gpu"
GPUS_PER_NODE = 8
BLOCK_LABEL = "cloud.provider.com/topology-block"
RACK_LABEL = "cloud.provider.com/topology-rack"
HOSTNAME_LABEL = "kubernetes.io/hostname"
CLIQUE_LABEL = "nvidia.com/gpu.clique"
MANAGED = ("kwok.x-k8s.io/node", "fake")
"""The annotation KWOK's controller is told to manage nodes by."""
OUTCOME = "fleet.meshtrain.io/outcome"
"""Pod annotation: ``Succeeded`` or ``Failed``: how the trace ends the job's first attempt."""
RUN_FOR = "fleet.meshtrain.io/run-for"
"""Pod annotation: how long a pod runs before it succeeds (a Go duration, e.g. ``90s``)."""
FAIL_AFTER = "fleet.meshtrain.io/fail-after"
"""Pod annotation: how long a first-attempt pod of a failing job runs before it fails."""
ATTEMPT_LABEL = "meshtrain.io/attempt"
"""The operator's label on each pod: its gang's attempt (0 the first; a restart counts up)."""
CLUSTER_UUID = "c0ffee00-0000-4000-8000-000000000000"
"""The fleet's NVLink cluster UUID, as GPU Feature Discovery writes it before the clique id."""


@dataclasses.dataclass(frozen=True)
class Shape:
    """How many nodes and how they nest (each level fills before the next begins)."""

    nodes: int
    """Nodes in the fleet, each of :data:`GPUS_PER_NODE` GPUs."""
    nodes_per_rack: int = 32
    """Nodes under one leaf switch (256 GPUs)."""
    racks_per_block: int = 16
    """Leaves under one block (spine group): 512 nodes, 4,096 GPUs, the trace's largest job."""
    nodes_per_clique: int = 4
    """Nodes of one NVLink domain (32 GPUs; 1: NVLink never leaves a node, no clique label)."""

    def __post_init__(self) -> None:
        for field in ("nodes", "nodes_per_rack", "racks_per_block", "nodes_per_clique"):
            if getattr(self, field) < 1:
                raise ValueError(f"Shape.{field} must be at least 1, got {getattr(self, field)}")
        if self.nodes_per_rack % self.nodes_per_clique:
            raise ValueError(
                f"Shape.nodes_per_clique ({self.nodes_per_clique}) must divide nodes_per_rack "
                f"({self.nodes_per_rack}): an NVLink domain never spans two leaves"
            )

    @property
    def gpus(self) -> int:
        """GPUs in the fleet."""
        return self.nodes * GPUS_PER_NODE

    def labels(self, index: int) -> dict[str, str]:
        """The topology labels of node ``index``."""
        rack = index // self.nodes_per_rack
        name = node_name(index)
        found = {
            HOSTNAME_LABEL: name,
            RACK_LABEL: f"rack-{rack:04d}",
            BLOCK_LABEL: f"block-{rack // self.racks_per_block:03d}",
        }
        if self.nodes_per_clique > 1:
            found[CLIQUE_LABEL] = f"{CLUSTER_UUID}.{index // self.nodes_per_clique}"
        return found


def node_name(index: int) -> str:
    return f"kwok-{index:05d}"


def node(shape: Shape, index: int) -> dict[str, Any]:
    """Node ``index`` as it is created (its status is written after, as a kubelet registers)."""
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": node_name(index),
            "labels": {**shape.labels(index), "type": "kwok"},
            "annotations": {MANAGED[0]: MANAGED[1]},
        },
    }


def node_status() -> dict[str, Any]:
    """A Ready node's status with 8 GPUs (KWOK's node stages keep capacity they find)."""
    amounts = {GPU: str(GPUS_PER_NODE), "cpu": "96", "memory": "1Ti", "pods": "110"}
    ready = {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kwok"}
    return {"status": {"capacity": amounts, "allocatable": amounts, "conditions": [ready]}}


def lifecycle_annotations(run_seconds: float, fail_after: float | None) -> dict[str, str]:
    """Pod annotations that make KWOK finish a pod ``run_seconds`` after it runs, or fail a
    first-attempt pod ``fail_after`` seconds after it runs (its restart then runs ``run_seconds``)."""
    found = {RUN_FOR: f"{run_seconds:.3f}s", OUTCOME: "Succeeded"}
    if fail_after is not None:
        found[OUTCOME] = "Failed"
        found[FAIL_AFTER] = f"{fail_after:.3f}s"
    return found


def _stage(
    name: str, match: list[dict[str, Any]], nxt: dict[str, Any], delay: str | None
) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "resourceRef": {"apiGroup": "v1", "kind": "Pod"},
        "selector": {"matchExpressions": match},
        "next": nxt,
    }
    if delay is not None:  # the annotation's duration counts from the moment the stage matches
        spec["delay"] = {
            "durationMilliseconds": 0,
            "durationFrom": {"expressionFrom": f'.metadata.annotations["{delay}"]'},
        }
    return {
        "apiVersion": "kwok.x-k8s.io/v1alpha1",
        "kind": "Stage",
        "metadata": {"name": name},
        "spec": spec,
    }


def _terminated(phase: str, code: int, reason: str) -> str:
    return f"""{{{{ $now := Now }}}}
containerStatuses:
{{{{ range .spec.containers }}}}
- image: {{{{ .image | Quote }}}}
  name: {{{{ .name | Quote }}}}
  ready: false
  restartCount: 0
  started: false
  state:
    terminated:
      exitCode: {code}
      reason: {reason}
      finishedAt: {{{{ $now | Quote }}}}
{{{{ end }}}}
phase: {phase}
"""


_RUNNING = """{{ $now := Now }}
conditions:
- {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Initialized}
- {lastTransitionTime: {{ $now | Quote }}, status: "True", type: Ready}
- {lastTransitionTime: {{ $now | Quote }}, status: "True", type: ContainersReady}
containerStatuses:
{{ range .spec.containers }}
- image: {{ .image | Quote }}
  name: {{ .name | Quote }}
  ready: true
  restartCount: 0
  started: true
  state:
    running: {startedAt: {{ $now | Quote }}}
{{ end }}
phase: Running
startTime: {{ $now | Quote }}
"""


def stages() -> list[dict[str, Any]]:
    """Pod Stages: a bound pod runs; it succeeds after :data:`RUN_FOR`, or a failing job's
    first attempt fails after :data:`FAIL_AFTER` (exit 1, a retryable error); deleted pods go.

    One node Stage too: KWOK follows the pods only of nodes its node controller tracks, which runs
    only with a node Stage; it matches no node (:func:`create_nodes` registers them Ready), so no
    node status is ever written again (no heartbeat: the operator ignores those anyway).
    """
    alive = {"key": ".metadata.deletionTimestamp", "operator": "DoesNotExist"}
    running = {"key": ".status.phase", "operator": "In", "values": ["Running"]}
    first = {"key": f'.metadata.labels["{ATTEMPT_LABEL}"]', "operator": "In", "values": ["0"]}
    later = {**first, "operator": "NotIn"}
    fails = {"key": f'.metadata.annotations["{OUTCOME}"]', "operator": "In", "values": ["Failed"]}
    succeeds = {**fails, "values": ["Succeeded"]}
    succeeded = {"statusTemplate": _terminated("Succeeded", 0, "Completed")}
    never = {"key": ".metadata.name", "operator": "In", "values": [""]}
    node_stage = _stage("node-none", [never], {"statusTemplate": "{}"}, None)
    node_stage["spec"]["resourceRef"] = {"apiGroup": "v1", "kind": "Node"}
    return [
        node_stage,
        _stage(
            "pod-run",
            [alive, {"key": ".status.phase", "operator": "In", "values": ["Pending"]}],
            {"statusTemplate": _RUNNING},
            None,
        ),
        _stage("pod-succeed", [alive, running, succeeds], succeeded, RUN_FOR),
        _stage("pod-succeed-after-restart", [alive, running, fails, later], succeeded, RUN_FOR),
        _stage(
            "pod-fail",
            [alive, running, fails, first],
            {"statusTemplate": _terminated("Failed", 1, "Error")},
            FAIL_AFTER,
        ),
        _stage(
            "pod-delete",
            [{"key": ".metadata.deletionTimestamp", "operator": "Exists"}],
            {"delete": True},
            None,
        ),
    ]


def binary() -> pathlib.Path:
    """The pinned ``kwok`` binary; :class:`binaries.BinariesMissingError` names the command that builds it."""
    return binaries.module_binary("kwok", KWOK_VERSION, "sigs.k8s.io/kwok")


class Kwok:
    """The ``kwok`` controller managing the fleet's nodes and their pods, as a child process."""

    def __init__(self, kubeconfig: pathlib.Path, workdir: pathlib.Path | None = None) -> None:
        self._kubeconfig = kubeconfig
        self._workdir = workdir or pathlib.Path(tempfile.mkdtemp(prefix="kwok-"))
        self._process: subprocess.Popen[bytes] | None = None
        self.log_path = self._workdir / "kwok.log"

    def __enter__(self) -> Kwok:
        config = self._workdir / "stages.yaml"
        config.write_text(yaml.safe_dump_all(stages()))
        command = [
            str(binary()),
            f"--kubeconfig={self._kubeconfig}",
            f"--config={config}",
            "--manage-all-nodes=false",
            f"--manage-nodes-with-annotation-selector={MANAGED[0]}={MANAGED[1]}",
            "--node-lease-duration-seconds=0",  # no lease heartbeats: no node controller runs
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        time.sleep(1.0)
        if self._process.poll() is not None:
            raise RuntimeError(f"kwok exited {self._process.returncode}: {self.tail()}")
        return self

    def tail(self, lines: int = 20) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    @property
    def pid(self) -> int:
        assert self._process is not None
        return self._process.pid

    def __exit__(self, *exc: object) -> None:
        if self._process is None:
            return
        os.killpg(self._process.pid, signal.SIGTERM)
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait()


async def create_nodes(kubeconfig: pathlib.Path, shape: Shape, in_flight: int = 32) -> float:
    """Register the fleet's nodes (created, untainted, Ready with 8 GPUs); returns the seconds taken."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration
    )
    configuration.connection_pool_maxsize = in_flight
    started = time.perf_counter()
    async with k8s.ApiClient(configuration) as api:
        core = k8s.CoreV1Api(api)
        limit = asyncio.Semaphore(in_flight)

        async def one(index: int) -> None:
            async with limit:
                name = node_name(index)
                await _retrying(core.create_node, node(shape, index))
                await _retrying(core.patch_node, name, {"spec": {"taints": []}})
                await _retrying(core.patch_node_status, name, node_status())

        await asyncio.gather(*(one(i) for i in range(shape.nodes)))
    return time.perf_counter() - started


async def _retrying(call: Any, *args: Any) -> None:
    """One create/patch, again while the API server sheds load (429/5xx), at most 20 times."""
    for _ in range(20):
        response = await call(*args, _preload_content=False)
        text = await response.text()
        if response.status < 300:
            return
        if response.status not in (429, 500, 503, 504):
            raise RuntimeError(f"{call.__name__} -> {response.status}: {text[:300]}")
        await asyncio.sleep(1.0)
    raise RuntimeError(f"{call.__name__} kept failing: {text[:300]}")


async def fill(
    kubeconfig: pathlib.Path, shape: Shape, namespace: str, in_flight: int = 32
) -> float:
    """One never-ending pod of 8 GPUs bound to each node (``namespace`` exists): a full fleet.
    Returns the seconds taken."""
    configuration = k8s.Configuration()
    await k8s_config.load_kube_config(
        config_file=str(kubeconfig), client_configuration=configuration
    )
    configuration.connection_pool_maxsize = in_flight
    gpus = {GPU: str(GPUS_PER_NODE)}
    started = time.perf_counter()
    async with k8s.ApiClient(configuration) as api:
        core = k8s.CoreV1Api(api)
        limit = asyncio.Semaphore(in_flight)

        async def one(index: int) -> None:
            pod = {
                "metadata": {
                    "name": f"hold-{index:05d}",
                    "annotations": lifecycle_annotations(30 * 24 * 3600.0, None),
                },
                "spec": {
                    "nodeName": node_name(index),
                    "containers": [{"name": "c", "image": "hold", "resources": {"limits": gpus}}],
                },
            }
            async with limit:
                await _retrying(core.create_namespaced_pod, namespace, pod)

        await asyncio.gather(*(one(i) for i in range(shape.nodes)))
    return time.perf_counter() - started


def domains(shape: Shape) -> Iterator[tuple[str, int]]:
    """(level label, domain count) of the fleet, top down."""
    racks = -(-shape.nodes // shape.nodes_per_rack)
    yield BLOCK_LABEL, -(-racks // shape.racks_per_block)
    yield RACK_LABEL, racks
    if shape.nodes_per_clique > 1:
        yield CLIQUE_LABEL, -(-shape.nodes // shape.nodes_per_clique)
