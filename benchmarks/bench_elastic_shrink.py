"""Time from a lost node to the gang running again, with and without ``runPolicy.elastic``.

A real control plane (kube-apiserver, etcd, kube-scheduler; :class:`tests.integration.operator.
cluster.Cluster`) with four 2-GPU nodes and the operator as a subprocess, as the integration tests
run it.  A dp4·tp2 job (one pod per node) runs; a node is deleted and its pods fail (the test
kubelet plays the pod garbage collector and marks bound pods Running at once, so container start
and the trainer's own restart are not in these numbers).  Measured:

- **shrink**: node deleted -> the dp3 gang's pods all bound and Running (elastic minData 2);
- **grow**: node back and a newer checkpoint reported -> the dp4 gang Running again;
- **without elastic**: the same job without ``runPolicy.elastic`` after the same loss: whether it
  runs again within ``--wait`` seconds (it cannot: its four pods need four nodes).

This is the operator's and scheduler's share of the time, not the trainer's checkpoint load; the
whole path with real kubelets and the trainer is ``tests/e2e/test_sandbox_resilience.py``.

Run: ``python benchmarks/bench_elastic_shrink.py [--repeat 3] [--wait 20]``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.append(str(Path(__file__).resolve().parents[1]))

from benchmarks import machine
from meshtrain.sandbox.controlplane import binaries
from tests.builders import JobBuilder
from tests.integration.operator.cluster import Cluster, OperatorProcess
from tests.integration.operator.test_operator_chaos import Kubelet
from tests.integration.operator.test_operator_stragglers import _checkpoint_volume

NAMESPACE, POOL = "bench-elastic", "bench-elastic"


def _running(cluster: Cluster, name: str, pods: int, timeout: float) -> float | None:
    """Seconds until ``pods`` pods of ``name`` run bound and the job is Running (None: timeout)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        status = cluster.status(NAMESPACE, name)
        live = [p for p in cluster.pods(NAMESPACE, name) if not p.metadata.deletion_timestamp]
        running = [p for p in live if p.status.phase == "Running" and p.spec.node_name]
        if status.get("phase") == "Running" and len(live) == len(running) == pods:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _job(name: str, elastic: bool) -> JobBuilder:
    job = (
        JobBuilder(name, NAMESPACE, POOL)
        .layout(data=4, tensor=2, gpus_per_node=2)
        .parallelism(microBatches=3)
        .training(microBatch=2)
    )
    if not elastic:
        return job
    # No waiting periods: the grow time measured is the operator's own, not growStableSeconds.
    bounds = {"minData": 2, "maxData": 4, "growStableSeconds": 0, "minResizeIntervalSeconds": 0}
    return job.checkpoint(claimName="ckpt").run_policy(elastic=bounds)


def _lose(cluster: Cluster, kubelet: Kubelet, node: str) -> None:
    cluster.core.delete_node(node)
    kubelet.lose(node)


def _restore(cluster: Cluster, kubelet: Kubelet, node: str) -> None:
    kubelet.gone.discard(node)
    cluster.add_node(POOL, gpus=2, name=node)


def one_round(cluster: Cluster, kubelet: Kubelet, index: int, wait: float) -> dict[str, Any]:
    nodes = [f"{POOL}-{index}-{i}" for i in range(4)]
    for node in nodes:
        cluster.add_node(POOL, gpus=2, name=node)
    name = f"shrink-{index}"
    cluster.apply(_job(name, elastic=True))
    assert _running(cluster, name, 4, 90) is not None, "the dp4 gang never ran"
    _lose(cluster, kubelet, nodes[3])
    shrink = _running(cluster, name, 3, 90)  # timed from the deletion
    assert shrink is not None, "the gang never ran again at dp3"
    status = cluster.status(NAMESPACE, name)
    assert status["elastic"]["data"] == 3 and status["elastic"]["globalBatch"] == 24
    _restore(cluster, kubelet, nodes[3])
    cluster.custom.patch_namespaced_custom_object_status(
        "meshtrain.io",
        "v1alpha1",
        NAMESPACE,
        "trainingjobs",
        name,
        {"status": {"lastCheckpointStep": 100}},
    )
    grow = _running(cluster, name, 4, 90)  # timed from the checkpoint report
    assert grow is not None, "the gang never grew back to dp4"
    cluster.delete_job(NAMESPACE, name)

    plain = f"plain-{index}"
    cluster.apply(_job(plain, elastic=False))
    assert _running(cluster, plain, 4, 90) is not None, "the plain dp4 gang never ran"
    _lose(cluster, kubelet, nodes[2])
    without = _running(cluster, plain, 4, wait)
    cluster.delete_job(NAMESPACE, plain)
    for node in nodes:
        kubelet.gone.add(node)
        try:
            cluster.core.delete_node(node)
        except Exception:  # noqa: BLE001 - nodes[2] is already gone
            pass
    return {
        "shrink_seconds": shrink,
        "grow_seconds": grow,
        "without_elastic_ran_again_within_wait": without is not None,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--wait", type=float, default=20.0, help="how long the plain job is watched"
    )
    args = parser.parse_args()
    rows = []
    with (
        tempfile.TemporaryDirectory(prefix="mt-bench-elastic-") as tmp,
        Cluster.private(binaries.locate()) as cluster,
        Kubelet(cluster) as kubelet,
    ):
        cluster.core.create_namespace({"metadata": {"name": NAMESPACE}})
        _checkpoint_volume(cluster, NAMESPACE)  # runPolicy.elastic needs checkpoint.claimName
        operator = OperatorProcess(cluster.kubeconfig, str(Path(tmp) / "operator.log"))
        operator.start()
        try:
            for index in range(args.repeat):
                rows.append(one_round(cluster, kubelet, index, args.wait))
        finally:
            operator.stop()
    print(
        f"{'round':>5} {'shrink s':>9} {'grow s':>7}  without elastic ran again in {args.wait:.0f} s"
    )
    for index, row in enumerate(rows):
        print(
            f"{index:>5} {row['shrink_seconds']:>9.2f} {row['grow_seconds']:>7.2f}  "
            f"{row['without_elastic_ran_again_within_wait']}"
        )
    summary = {
        "shrink_seconds_median": statistics.median(r["shrink_seconds"] for r in rows),
        "grow_seconds_median": statistics.median(r["grow_seconds"] for r in rows),
    }
    print(
        f"median shrink {summary['shrink_seconds_median']:.2f} s, grow {summary['grow_seconds_median']:.2f} s"
    )
    path = machine.write_results(
        "elastic_shrink", {"rounds": rows, **summary, "wait_seconds": args.wait}
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
