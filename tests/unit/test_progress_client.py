"""The operator's /progress client against a real hostile HTTP server on 127.0.0.1.

Every answer a pod could give (huge, slow, redirecting, compressed, malformed, NaN) comes back
within the deadline as a refusal or a checked document, without the client's memory growing
by what the pod sent, and a slow pod does not hold up the poll of another job.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from meshtrain.operator.cluster import progress_client
from meshtrain.operator.policy import identity
from tests import hostile_progress

DEADLINE = 1.5
"""The poll deadline in these tests (the operator's default is 2 s)."""
MARGIN = 1.5
"""Seconds past the deadline a loaded 2-core machine may take to tear the request down."""


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS in /proc/self/status")


def _job(name: str = "j", uid: str = "uid-1") -> identity.JobRef:
    return identity.JobRef(name=name, namespace="ns", uid=uid)


JOB = _job()


def _poller() -> progress_client.Poller:
    return progress_client.Poller(every=10.0, timeout=DEADLINE)


async def _fetch(port: int) -> tuple[bytes | str, float]:
    poller = _poller()
    started = time.monotonic()
    try:
        return await poller.fetch(ip="127.0.0.1", port=port), time.monotonic() - started
    except progress_client.Refused as err:
        return str(err), time.monotonic() - started
    finally:
        await poller.close()


REFUSED = {
    "huge announced": "announces 314572800 bytes",
    "huge streamed": "more than 4096 bytes",
    "slow": "no complete answer within 1.5 s",
    "redirect": "HTTP status 302",
    "many headers": "Too many headers",
    "long header": "Got more than 1024 bytes",
}
"""Answers the client refuses, and what its reason says."""


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_hostile_answer_is_refused_within_the_deadline(name):
    before = _rss_mib()
    with hostile_progress.Server(hostile_progress.ANSWERS[name]) as server:
        result, seconds = asyncio.run(_fetch(server.port))
    assert isinstance(result, str), f"{name}: accepted {result[:80]!r}"
    assert REFUSED[name] in result
    assert len(result) < 400, "the reason quotes a bounded part of the answer"
    assert seconds < DEADLINE + MARGIN, f"{name}: {seconds:.1f} s"
    assert _rss_mib() - before < 32, f"{name}: the client's memory grew by what the pod sent"
    assert server.requests == ["GET /progress HTTP/1.1"], "one request, no redirect followed"


def test_a_compressed_answer_is_not_inflated():
    before = _rss_mib()
    with hostile_progress.Server(hostile_progress.ANSWERS["gzip bomb"]) as server:
        result, _ = asyncio.run(_fetch(server.port))
    # 3 KiB of gzip inflate to 3 MiB; read as it came, it is no progress document.
    assert isinstance(result, bytes) and result.startswith(b"\x1f\x8b") and len(result) <= 4096
    assert _rss_mib() - before < 32


@pytest.mark.parametrize(
    "name",
    [
        "malformed JSON",
        "not an object",
        "duplicate keys",
        "deep nesting",
        "not UTF-8",
        "gzip bomb",
    ],
)
def test_a_body_that_is_no_document_gives_no_report_and_slows_the_polls(name):
    async def twice() -> tuple[dict | None, bool]:
        poller = _poller()
        try:
            first = await poller.poll(JOB, ip="127.0.0.1", port=server.port)
            again = await poller.poll(JOB, ip="127.0.0.1", port=server.port)
            return first, again is None and poller._failures[JOB.uid] == 1
        finally:
            await poller.close()

    with hostile_progress.Server(hostile_progress.ANSWERS[name]) as server:
        report, waited = asyncio.run(twice())
    assert report is None
    assert waited and len(server.requests) == 1, "the second poll waits for its turn"


def test_a_namesake_re_created_is_polled_afresh_and_a_forgotten_job_at_once():
    """The backoff is the job's, by UID: a job deleted and created again under its name (a new
    UID) does not wait out the old one's failures, and forget(uid) drops what was kept."""

    async def polls() -> tuple[bool, bool, bool, int]:
        poller = _poller()
        try:
            await poller.poll(JOB, ip="127.0.0.1", port=server.port)  # refused: backs off
            waits = await poller.poll(JOB, ip="127.0.0.1", port=server.port) is None
            namesake = _job(uid="uid-2")
            await poller.poll(namesake, ip="127.0.0.1", port=server.port)
            fresh = poller._failures.get(namesake.uid) == 1
            poller.forget(JOB.uid)
            await poller.poll(JOB, ip="127.0.0.1", port=server.port)
            return waits, fresh, poller._failures.get(JOB.uid) == 1, len(server.requests)
        finally:
            await poller.close()

    with hostile_progress.Server(hostile_progress.ANSWERS["malformed JSON"]) as server:
        waits, fresh, forgotten, requests = asyncio.run(polls())
    assert waits and fresh and forgotten
    assert requests == 3, "the namesake and the forgotten job are polled, the waiting one is not"


def test_nan_and_infinity_are_not_numbers_json_allows():
    async def poll(name: str) -> dict | None:
        poller = _poller()
        try:
            with hostile_progress.Server(hostile_progress.ANSWERS[name]) as server:
                return await poller.poll(_job(name), ip="127.0.0.1", port=server.port)
        finally:
            await poller.close()

    assert asyncio.run(poll("NaN loss")) is None
    assert asyncio.run(poll("infinite rate")) is None


def test_a_good_answer_is_read_and_checked():
    async def poll() -> dict | None:
        poller = _poller()
        try:
            return await poller.poll(JOB, ip="127.0.0.1", port=server.port)
        finally:
            await poller.close()

    with hostile_progress.Server(hostile_progress.ANSWERS["good"]) as server:
        assert asyncio.run(poll()) == hostile_progress.GOOD


def test_a_slow_pod_does_not_hold_up_another_jobs_poll():
    async def both() -> tuple[float, dict | None]:
        poller = _poller()
        try:
            started = time.monotonic()
            slow_poll = asyncio.create_task(
                poller.poll(_job("slow", "uid-slow"), ip="127.0.0.1", port=slow.port)
            )
            report = await poller.poll(_job("good", "uid-good"), ip="127.0.0.1", port=good.port)
            took = time.monotonic() - started
            assert await slow_poll is None
            return took, report
        finally:
            await poller.close()

    with (
        hostile_progress.Server(hostile_progress.ANSWERS["slow"]) as slow,
        hostile_progress.Server(hostile_progress.ANSWERS["good"]) as good,
    ):
        took, report = asyncio.run(both())
    assert report == hostile_progress.GOOD
    assert took < 1.0, f"the good job's poll waited {took:.1f} s for the slow one"


def test_a_pod_not_listening_yet_is_polled_at_the_normal_rate():
    async def poll() -> tuple[dict | None, int]:
        poller = _poller()
        try:
            port = hostile_progress.closed_port()
            report = await poller.poll(JOB, ip="127.0.0.1", port=port)
            return report, poller._failures.get(JOB.uid, 0)
        finally:
            await poller.close()

    assert asyncio.run(poll()) == (None, 0)


def test_an_ipv6_pod_ip_is_put_in_brackets_and_junk_is_refused():
    assert progress_client.url("fd00::1", 9400) == "http://[fd00::1]:9400/progress"
    assert progress_client.url("10.0.0.7", 9400) == "http://10.0.0.7:9400/progress"
    with pytest.raises(progress_client.Refused, match="not an IP address"):
        progress_client.url("evil.example/#", 9400)
