"""A status write lands only on the job as its pass read it (real API server).

kopf's own writes between the read and the write (annotations, finalizers) and another tool's
labels leave the decision as it was, so the write is retried on the new version; a change of
Kueue's queue label does not (a job whose label went must not be written Queued): the pass ends
with the conflict and the next one decides from the fresh read.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any

import pytest

from meshtrain.operator.cluster import informer, kube, status_writes
from meshtrain.operator.policy import job_state
from tests.builders import JobBuilder
from tests.integration.operator.cluster import GROUP, PLURAL, VERSION, wait_for

pytestmark = pytest.mark.integration


def test_a_status_write_is_retried_over_kopfs_writes_and_refused_over_a_queue_label_change(
    cluster, operator, control_plane, namespace, pool
) -> None:
    cluster.apply(JobBuilder("quiet", namespace, pool).run_policy(suspend=True))
    wait_for(  # the operator's own write done: nothing else writes the job's status from here
        "the operator's Suspended status",
        lambda: cluster.status(namespace, "quiet").get("phase") == "Suspended",
    )

    def patch_metadata(metadata: dict[str, Any]) -> None:
        cluster.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "quiet", {"metadata": metadata}
        )

    async def scenario() -> tuple[Any, BaseException | None]:
        client = await kube.Client.connect(kubeconfig=str(control_plane.kubeconfig_path))
        writer = status_writes.JobWriter(client, informer.Cache())
        try:
            read = await client.get_job(namespace=namespace, name="quiet")
            assert read is not None
            patch_metadata(
                {"annotations": {"meshtrain.test/touched": "yes"}, "labels": {"team": "vision"}}
            )
            _, _, wrote = await writer.set_status(
                read, job_state.read(read), {"lastCheckpointStep": 3}
            )
            assert wrote, "a write over an annotation change was not retried"
            read = await client.get_job(namespace=namespace, name="quiet")
            assert read is not None
            patch_metadata({"labels": {"kueue.x-k8s.io/queue-name": "research"}})
            try:
                await writer.set_status(read, job_state.read(read), {"lastCheckpointStep": 4})
            except kube.Conflict as err:
                return read, err
            return read, None
        finally:
            await client.close()

    operator.process.send_signal(signal.SIGSTOP)  # its own reaction to the label is not the test
    try:
        _, refused = asyncio.run(scenario())
    finally:
        operator.process.send_signal(signal.SIGCONT)
    assert isinstance(refused, kube.Conflict), "a status decided before a label change landed"
    assert cluster.status(namespace, "quiet").get("lastCheckpointStep") == 3
