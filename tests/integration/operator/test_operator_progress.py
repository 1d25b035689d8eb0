"""A hostile rank 0 against the operator on a real API server: nothing its /progress says hurts.

Two jobs run side by side (the test plays the kubelet: pods Running at 127.0.0.1): one whose
rank 0 answers every poll with the next hostile answer (300 MiB streamed, one byte a second, a
redirect, malformed JSON, NaN, a gzip bomb), one whose rank 0 is an ordinary trainer.  The
operator's memory stays far under the chart's 512Mi limit, it follows no redirect, the hostile
job's status takes nothing from it, and the other job's progress keeps reaching its status.
"""

from __future__ import annotations

import pathlib

import pytest

from tests import hostile_progress
from tests.builders import JobBuilder
from tests.integration.operator.cluster import wait_for

pytestmark = pytest.mark.integration

HOSTILE = ["huge streamed", "slow", "redirect", "malformed JSON", "NaN loss"]
"""What the hostile rank 0 answers, one per poll, round and round (each failed poll doubles the
wait before the next: 0.5 s, 1 s, 2 s, ... at the test operator's --progress-seconds 0.5)."""

CHART_LIMIT_MIB = 512
"""The operator container's memory limit in the chart (operator.resources.limits.memory)."""


def _memory_mib(pid: int) -> tuple[float, float]:
    """(resident, peak resident) MiB of process ``pid``."""
    found = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) / 1024
    return found["VmRSS"], found["VmHWM"]


def test_a_hostile_rank_zero_neither_hurts_the_operator_nor_stalls_another_job(
    cluster, operator, namespace, pool
):
    assert operator.process is not None
    rss_before, _ = _memory_mib(operator.process.pid)
    with (
        hostile_progress.Server(hostile_progress.rotating(HOSTILE)) as hostile,
        hostile_progress.Server(hostile_progress.ANSWERS["good"]) as good,
    ):
        cluster.add_node(pool, gpus=8)
        for name, server in (("hostile", hostile), ("normal", good)):
            cluster.apply(
                JobBuilder(name, namespace, pool).layout(data=2).gpus(1).metrics(port=server.port)
            )
        for name in ("hostile", "normal"):
            for pod in cluster.wait_gang(namespace, name, 2):
                cluster.set_pod_phase(namespace, pod.metadata.name, "Running", ip="127.0.0.1")
        wait_for(
            "the normal job's progress in its status",
            lambda: (cluster.status(namespace, "normal").get("progress") or {}).get("step") == 17,
            timeout=30,
        )
        wait_for(
            "every hostile answer served at least once",
            lambda: len(hostile.requests) >= len(HOSTILE),
            timeout=60,
        )
        # While the hostile pod is still being polled, the other job's new progress arrives.
        good.answer = hostile_progress.document({**hostile_progress.GOOD, "step": 18})
        wait_for(
            "the normal job's next progress",
            lambda: (cluster.status(namespace, "normal").get("progress") or {}).get("step") == 18,
            timeout=15,
        )
        assert operator.alive(), "the operator's liveness endpoint stopped answering"
        rss_after, peak = _memory_mib(operator.process.pid)
        assert rss_after - rss_before < 64, f"operator grew {rss_after - rss_before:.0f} MiB"
        assert peak < CHART_LIMIT_MIB, f"operator peaked at {peak:.0f} MiB"
        assert set(hostile.requests) == {"GET /progress HTTP/1.1"}, "a redirect was followed"
        hostile_status = cluster.status(namespace, "hostile")
        assert hostile_status["phase"] == "Running"
        assert "progress" not in hostile_status and "lastCheckpointStep" not in hostile_status
    log = pathlib.Path(operator.log_path).read_text(encoding="utf-8", errors="replace")
    assert f"progress of {namespace}/hostile" in log and "more than 4096 bytes" in log
