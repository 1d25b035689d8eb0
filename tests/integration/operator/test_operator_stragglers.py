"""runPolicy.stragglerPolicy replace on a real control plane (apiserver, etcd, kube-scheduler,
controller-manager binding the checkpoint volume): rank 0's /progress flags a straggler, the
operator names its node in status, stops the gang, excludes the node, places the gang on other
nodes and the new gang reports the step it resumed from.  The test plays the kubelet (bound
pods run with the progress server's IP, deleted pods go) and the trainer's /progress."""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from meshtrain.sandbox.controlplane.ports import pick_free_port
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for
from tests.integration.operator.test_operator_chaos import Kubelet

pytestmark = pytest.mark.integration

NAMESPACE = "stragglers"
POOL = "straggler"


class ProgressServer:
    """Rank 0's /progress on 127.0.0.1: a document the test changes as the trainer would."""

    def __init__(self) -> None:
        self.document: dict[str, Any] = {}
        self.port = pick_free_port()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # http.server API
                body = json.dumps(owner.document).encode()
                self.send_response(200 if self.path == "/progress" else 404)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)

    def __enter__(self) -> ProgressServer:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


@dataclasses.dataclass
class Simulated:
    """A private control plane whose kubelet and rank-0 /progress the test plays, and the operator."""

    cluster: Cluster
    progress: ProgressServer
    kubelet: Kubelet
    operator: OperatorProcess


@contextlib.contextmanager
def simulated(binaries: Any, namespace: str, log: Path) -> Iterator[Simulated]:
    """``namespace`` made; the test starts the operator once its nodes exist; it is always stopped."""
    with (
        Cluster.private(binaries) as cluster,
        ProgressServer() as progress,
        Kubelet(cluster, namespace, ip="127.0.0.1") as kubelet,
    ):
        cluster.core.create_namespace({"metadata": {"name": namespace}})
        operator = OperatorProcess(cluster.kubeconfig, str(log))
        try:
            yield Simulated(cluster, progress, kubelet, operator)
        finally:
            operator.stop()


def _checkpoint_volume(cluster, namespace: str) -> None:
    """A PersistentVolumeClaim bound to a PersistentVolume every node can mount (the test binds
    them, as the controller-manager's volume binder would)."""
    claim = cluster.core.create_namespaced_persistent_volume_claim(
        namespace,
        {
            # What the volume binder marks a claim with; kube-scheduler reads it as bound.
            "metadata": {"name": "ckpt", "annotations": {"pv.kubernetes.io/bind-completed": "yes"}},
            "spec": {
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "volumeName": f"{namespace}-ckpt",
                "resources": {"requests": {"storage": "1Gi"}},
            },
        },
    )
    cluster.core.create_persistent_volume(
        {
            "metadata": {"name": f"{namespace}-ckpt"},
            "spec": {
                "capacity": {"storage": "1Gi"},
                "accessModes": ["ReadWriteMany"],
                "storageClassName": "",
                "hostPath": {"path": f"/tmp/{namespace}-ckpt"},
                "claimRef": {"namespace": namespace, "name": "ckpt", "uid": claim.metadata.uid},
            },
        }
    )
    cluster.core.patch_persistent_volume_status(f"{namespace}-ckpt", {"status": {"phase": "Bound"}})
    cluster.core.patch_namespaced_persistent_volume_claim_status(
        "ckpt",
        namespace,
        {
            "status": {
                "phase": "Bound",
                "accessModes": ["ReadWriteMany"],
                "capacity": {"storage": "1Gi"},
            }
        },
    )


def _running_on(cluster, namespace: str, name: str, pods: int) -> dict[str, Any]:
    def ready() -> dict[str, Any] | None:
        status = cluster.status(namespace, name)
        live = [p for p in cluster.pods(namespace, name) if not p.metadata.deletion_timestamp]
        running = [p for p in live if p.status.phase == "Running" and p.spec.node_name]
        if status.get("phase") == "Running" and len(live) == len(running) == pods:
            return status
        return None

    try:
        return wait_for(f"{pods} pod(s) of {name} Running", ready, timeout=60)
    except AssertionError as err:
        seen = [
            (p.metadata.name, p.spec.node_name, p.status.phase, p.status.conditions)
            for p in cluster.pods(namespace, name)
        ]
        raise AssertionError(
            f"{err}; status {cluster.status(namespace, name)}; pods {seen}"
        ) from None


def test_a_straggler_node_is_named_replaced_and_never_chosen_again(
    control_plane_binaries, tmp_path
):
    with simulated(control_plane_binaries, NAMESPACE, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        operator.start()
        _replaced(cluster, operator, progress)


def _replaced(cluster: Cluster, operator: OperatorProcess, progress: ProgressServer) -> None:
    namespace, pool = NAMESPACE, POOL
    _checkpoint_volume(cluster, namespace)
    nodes = [cluster.add_node(pool, gpus=1, name=f"{pool}-n{i}") for i in range(3)]
    progress.document = {
        "step": 10,
        "loss": 4.0,
        "last_checkpoint_step": None,
        "updated_at": "2026-01-01T00:00:10Z",
        "straggler": None,
    }
    cluster.apply(
        JobBuilder("slow", namespace, pool)
        .layout(data=2, gpus_per_node=1)
        .checkpoint(claimName="ckpt", intervalSteps=20)
        .metrics(port=progress.port)
        .run_policy(stragglerPolicy={"action": "replace", "threshold": 1.3, "maxReplacements": 1})
    )
    status = _running_on(cluster, namespace, "slow", 2)
    first = {p["podIndex"]: p["node"] for p in status["placement"]}
    slow_node = first[1]

    # Rank 1 (pod 1) is flagged; the ranks stop and checkpoint step 60 as the pods go.
    progress.document = {
        "step": 60,
        "loss": 3.0,
        "last_checkpoint_step": 40,
        "updated_at": "2026-01-01T00:01:00Z",
        "straggler": {"rank": 1, "slowdown": 1.52, "since_step": 52},
    }
    status = wait_for(
        "the straggler replaced",
        lambda: (s := cluster.status(namespace, "slow")).get("stragglerReplacements") and s,
    )
    [excluded] = status["excludedNodes"]
    assert excluded["node"] == slow_node and excluded["reason"] == "Straggler"
    assert "rank 1 (pod 1 on node " + slow_node in excluded["message"]
    assert "1.52x" in excluded["message"]
    # The test plays the new gang's rank 0 (no trainer runs here): what follows checks that the
    # operator polls the new gang and keeps its report, not that anything resumed (the sandbox
    # e2e test checks the resumed step against the real trainer's step log).
    progress.document = {
        "step": 60,
        "loss": 3.0,
        "last_checkpoint_step": 60,
        "updated_at": "2026-01-01T00:02:00Z",
        "straggler": None,
    }

    status = _running_on(cluster, namespace, "slow", 2)
    placed = {p["node"] for p in status["placement"]}
    assert slow_node not in placed and placed <= set(nodes)
    on_nodes = {p.spec.node_name for p in cluster.pods(namespace, "slow")}
    assert on_nodes == placed  # the scheduler bound the pods where the operator planned
    status = wait_for(
        "the new gang's reported checkpoint step in status",
        lambda: (s := cluster.status(namespace, "slow")).get("lastCheckpointStep") == 60 and s,
    )
    assert status["restarts"] == 0 and status["stragglerReplacements"] == 1
    assert "straggler" not in status
    replaced = cluster.condition(namespace, "slow", "Straggler")
    assert replaced["reason"] == "StragglerReplaced"
    assert f"without node {slow_node}" in replaced["message"]
    events = cluster.core.list_namespaced_event(namespace).items
    notes = [e.message for e in events if e.reason == "StragglerReplaced"]
    assert len(notes) == 1 and slow_node in notes[0]
    counted = [
        sample.value
        for family in text_string_to_metric_families(operator.metrics())
        for sample in family.samples
        if sample.name == "meshtrain_operator_straggler_replacements_total"
        and sample.labels == {"namespace": namespace, "trainingjob": "slow"}
    ]
    assert counted == [1.0]


def test_a_restarted_gang_does_not_inherit_the_old_gangs_straggler(
    control_plane_binaries, tmp_path
):
    """The straggler was measured on the failed gang: the new gang starts without it (under
    ``replace`` a stale entry would stop the new gang before its rank 0 was ever asked)."""
    namespace = "stale-straggler"
    with simulated(control_plane_binaries, namespace, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        operator.start()
        _checkpoint_volume(cluster, namespace)
        for i in range(3):
            cluster.add_node(POOL, gpus=1, name=f"stale-n{i}")
        progress.document = {
            "step": 60,
            "loss": 3.0,
            "updated_at": "2026-01-01T00:01:00Z",
            "straggler": {"rank": 1, "slowdown": 1.52, "since_step": 52},
        }
        cluster.apply(
            JobBuilder("stale", namespace, POOL)
            .layout(data=2, gpus_per_node=1)
            .checkpoint(claimName="ckpt", intervalSteps=20)
            .metrics(port=progress.port)
            .run_policy(stragglerPolicy={"action": "report", "threshold": 1.3})
        )
        _running_on(cluster, namespace, "stale", 2)
        wait_for(
            "the straggler in status",
            lambda: cluster.status(namespace, "stale").get("straggler"),
        )
        # the condition follows status.straggler a pass later: the gang fails only once it is True
        # (failed sooner, the condition is never set, and there is nothing to clear)
        cluster.wait_reason(namespace, "stale", "Straggler", "StragglerDetected")
        # Rank 0 of the next gang has judged nothing yet: its /progress says nothing about stragglers.
        progress.document = {"step": 60, "loss": 3.0, "updated_at": "2026-01-01T00:02:00Z"}
        pod = next(p for p in cluster.pods(namespace, "stale") if p.metadata.name.endswith("-1"))
        cluster.set_pod_phase(namespace, pod.metadata.name, "Failed", exit_code=1)
        wait_for(
            "the gang restarted",
            lambda: cluster.status(namespace, "stale").get("restarts") == 1,
        )
        status = _running_on(cluster, namespace, "stale", 2)
        assert "straggler" not in status, status["straggler"]
        # the pass that sees the new gang Running clears the condition (under load, a pass later)
        flag = wait_for(
            "the Straggler condition cleared",
            lambda: (
                (c := cluster.condition(namespace, "stale", "Straggler"))
                and c["status"] == "False"
                and c
            ),
        )
        assert flag["reason"] == "NoStraggler", flag


def _flag_rank_1(
    cluster: Cluster, progress: ProgressServer, namespace: str, name: str, slowdown: float
) -> dict[str, Any]:
    """Rank 0's report names rank 1 a straggler; the job's Straggler condition once it is True."""
    progress.document = {
        "step": 60,
        "loss": 3.0,
        "straggler": {"rank": 1, "slowdown": slowdown, "since_step": 52},
    }
    return wait_for(
        "the straggler reported",
        lambda: (
            (c := cluster.condition(namespace, name, "Straggler")).get("status") == "True" and c
        ),
    )


def test_replace_with_nowhere_to_go_only_reports_until_a_node_frees_up(
    control_plane_binaries, tmp_path
):
    """Stopping the gang when no placement without the slow node fits would trade a slow job for a
    stopped one: the straggler is reported (NoReplacement) and the gang keeps running; once a node
    joins, the same report replaces it."""
    namespace = "no-replacement"
    with simulated(control_plane_binaries, namespace, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        operator.start()
        _checkpoint_volume(cluster, namespace)
        for i in range(2):
            cluster.add_node(POOL, gpus=1, name=f"full-n{i}")
        progress.document = {"step": 10, "loss": 4.0, "straggler": None}
        cluster.apply(
            JobBuilder("stuck", namespace, POOL)
            .layout(data=2, gpus_per_node=1)
            .checkpoint(claimName="ckpt", intervalSteps=20)
            .metrics(port=progress.port)
            .run_policy(stragglerPolicy={"action": "replace", "threshold": 1.3})
        )
        status = _running_on(cluster, namespace, "stuck", 2)
        slow_node = {p["podIndex"]: p["node"] for p in status["placement"]}[1]
        pods = {p.metadata.uid for p in cluster.pods(namespace, "stuck")}
        flag = _flag_rank_1(cluster, progress, namespace, "stuck", slowdown=1.52)
        assert flag["reason"] == "NoReplacement", flag
        assert f"no placement without node {slow_node}" in flag["message"]
        status = cluster.status(namespace, "stuck")
        assert status["phase"] == "Running" and not status.get("excludedNodes"), status
        assert {p.metadata.uid for p in cluster.pods(namespace, "stuck")} == pods

        cluster.add_node(POOL, gpus=1, name="full-n2")
        status = wait_for(
            "the straggler replaced once a node is free",
            lambda: (s := cluster.status(namespace, "stuck")).get("stragglerReplacements") and s,
        )
        assert [e["node"] for e in status["excludedNodes"]] == [slow_node]

        def on_node() -> list[Any]:
            return [
                e
                for e in cluster.core.list_namespaced_event("default").items
                if e.involved_object.kind == "Node" and e.involved_object.name == slow_node
            ]

        # Recorded after the status and the pod deletions: waited for, not raced.
        wait_for("the Event on the node", on_node)
        assert [e.reason for e in on_node()] == ["StragglerReplaced"]
        assert f"TrainingJob {namespace}/stuck" in on_node()[0].message


def test_replace_never_shrinks_an_elastic_gang(control_plane_binaries, tmp_path):
    """An elastic dp3 gang (minData 2) with no spare node: dp2 would fit without the slow node,
    but a shrink loses more than the straggler costs, so the straggler is only reported."""
    namespace = "no-shrink"
    with simulated(control_plane_binaries, namespace, tmp_path / "operator.log") as sim:
        cluster, progress, operator = sim.cluster, sim.progress, sim.operator
        operator.start()
        _checkpoint_volume(cluster, namespace)
        for i in range(3):
            cluster.add_node(POOL, gpus=1, name=f"shrink-n{i}")
        progress.document = {"step": 10, "loss": 4.0, "straggler": None}
        cluster.apply(
            JobBuilder("elastic", namespace, POOL)
            .layout(data=3, gpus_per_node=1)
            .parallelism(microBatches=2)
            .checkpoint(claimName="ckpt", intervalSteps=20)
            .metrics(port=progress.port)
            .run_policy(
                stragglerPolicy={"action": "replace", "threshold": 1.3},
                elastic={"minData": 2, "maxData": 3},
            )
        )
        status = _running_on(cluster, namespace, "elastic", 3)
        slow_node = {p["podIndex"]: p["node"] for p in status["placement"]}[1]
        pods = {p.metadata.uid for p in cluster.pods(namespace, "elastic")}
        flag = _flag_rank_1(cluster, progress, namespace, "elastic", slowdown=1.4)
        status = cluster.status(namespace, "elastic")
        assert not status.get("stragglerReplacements"), status
        assert status["phase"] == "Running" and not status.get("excludedNodes"), status
        assert status["elastic"]["data"] == 3, status["elastic"]
        assert {p.metadata.uid for p in cluster.pods(namespace, "elastic")} == pods
        assert flag["reason"] == "NoReplacement", flag
        assert (
            f"no placement without node {slow_node} fits now at the running size"
            in (flag["message"])
        )
