"""A fabric level required per pipeline stage (``spec.topology.levels[].scope: stage``) on a real API
server and kube-scheduler: the gang's recorded placement and the nodes the scheduler bound its pods
to keep each stage in one rack (the racks read back from the Node objects), and a job whose stages
no set of racks can hold waits TopologyUnsatisfiable, naming the level and the stage size."""

from __future__ import annotations

import uuid

from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess, wait_for

RACK = "meshtrain.test/rack"
BLOCK = "meshtrain.test/block"


def _staged(name: str, namespace: str, pool: str, pipeline: int) -> JobBuilder:
    """dp2 x pp``pipeline`` x tp4 on pods of 4 GPUs: stages of two pods, each required in one rack."""
    job = JobBuilder(name, namespace, pool).layout(data=2, pipeline=pipeline, tensor=4).gpus(4)
    return job.topology(
        levels=[{"label": BLOCK}, {"label": RACK, "mode": "required", "scope": "stage"}]
    )


def _racks(cluster: Cluster, pool: str, sizes: tuple[int, ...]) -> None:
    """Racks of ``sizes`` nodes (4 GPUs each), all in one block."""
    for rack, count in enumerate(sizes):
        for _ in range(count):
            cluster.add_node(pool, gpus=4, labels={BLOCK: f"{pool}-b", RACK: f"{pool}-r{rack}"})


def test_each_stage_lands_in_one_rack_and_an_impossible_job_waits(control_plane_binaries, tmp_path):
    with Cluster.private(control_plane_binaries) as cluster:
        operator = OperatorProcess(cluster.kubeconfig, str(tmp_path / "operator.log"))
        operator.start()
        try:
            namespace = f"stage-{uuid.uuid4().hex[:6]}"
            cluster.core.create_namespace({"metadata": {"name": namespace}})
            # three racks of 3 free nodes: whole stages of 2 pods, one per rack, 3 in all; 2
            # stages (4 pods) filled by count alone would take a rack and one node of another
            fits, short = f"p{uuid.uuid4().hex[:6]}", f"p{uuid.uuid4().hex[:6]}"
            _racks(cluster, fits, (3, 3, 3))
            _racks(cluster, short, (3, 3, 3))
            cluster.apply(_staged("fits", namespace, fits, pipeline=2))
            cluster.apply(_staged("short", namespace, short, pipeline=4))  # 8 of 9 slots

            cluster.wait_gang(namespace, "fits", 4, timeout=120)
            bound = wait_for(
                "the gang bound by kube-scheduler",
                lambda: (
                    nodes
                    if all(nodes := [p.spec.node_name for p in cluster.pods(namespace, "fits")])
                    else None
                ),
            )
            rack_of = {
                node.metadata.name: node.metadata.labels[RACK]
                for node in cluster.core.list_node(label_selector=f"{RACK}").items
            }
            pods = cluster.pods(namespace, "fits")
            by_index = {int(p.metadata.labels["meshtrain.io/node-rank"]): p for p in pods}
            placement = {
                entry["podIndex"]: entry["node"]
                for entry in cluster.status(namespace, "fits")["placement"]
            }
            assert sorted(placement) == list(range(4))
            for stage in range(2):
                recorded = {rack_of[placement[i]] for i in (2 * stage, 2 * stage + 1)}
                assert len(recorded) == 1, (stage, placement)
                scheduled = {
                    rack_of[by_index[i].spec.node_name] for i in (2 * stage, 2 * stage + 1)
                }
                assert scheduled == recorded, (stage, bound)

            waiting = cluster.wait_reason(namespace, "short", "Placed", "TopologyUnsatisfiable")
            message = waiting["message"]
            assert RACK in message and "4 pipeline stages of 2 pods" in message, message
            assert "could hold 3 such stages" in message, message
            assert cluster.pods(namespace, "short") == []
        finally:
            operator.stop()
