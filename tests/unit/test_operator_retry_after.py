"""429/5xx answers: the operator's client reads ``Retry-After`` and its retries wait at least that long.

A real HTTP server on loopback answers every request 429 with ``Retry-After`` (as the API
server's priority and fairness does); the operator's own client and informer talk to it.
"""

from __future__ import annotations

import asyncio
import collections
import datetime
import email.utils
import http.server
import threading
import time
from collections.abc import Iterator

import pytest
from kubernetes_asyncio import client as k8s

from meshtrain.operator.cluster import api_errors, informer, kube

NOW = datetime.datetime(2026, 1, 1, 12, 0, 0, tzinfo=datetime.UTC)


class _Throttling(http.server.BaseHTTPRequestHandler):
    """Every request: 429 with the server's ``retry_after`` header; each path's request times kept."""

    def do_GET(self) -> None:
        server = self.server
        assert isinstance(server, _Server)
        server.seen[self.path.split("?")[0]].append(time.monotonic())
        body = b'{"kind":"Status","code":429,"message":"too many requests, please try again later"}'
        self.send_response(429)
        self.send_header("Content-Type", "application/json")
        self.send_header("Retry-After", server.retry_after)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self, retry_after: str) -> None:
        super().__init__(("127.0.0.1", 0), _Throttling)
        self.retry_after = retry_after
        self.seen: dict[str, list[float]] = collections.defaultdict(list)


@pytest.fixture
def throttling() -> Iterator[_Server]:
    server = _Server("2")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def _client(server: _Server) -> kube.Client:
    configuration = k8s.Configuration()
    configuration.host = f"http://127.0.0.1:{server.server_address[1]}"
    return kube.Client(api=k8s.ApiClient(configuration), refresher=None)


def test_a_429_carries_the_servers_retry_after_and_the_backoff_honours_it(throttling):
    async def read() -> kube.ApiError:
        client = _client(throttling)
        try:
            await client.get_job(namespace="ns", name="j")
        except kube.ApiError as err:
            return err
        finally:
            await client.close()
        raise AssertionError("a 429 must raise")

    throttling.retry_after = "7"
    err = asyncio.run(read())
    assert err.status == 429 and err.retry_after == 7.0
    # The first retry would come after 2-3 s; the server asked for 7.
    assert api_errors.retry_delay(err, 1, 0.5, base=2.0, cap=120.0) == 7.0
    # Bounded: a server asking for a day gets the cap.
    throttling.retry_after = "86400"
    err = asyncio.run(read())
    assert api_errors.retry_delay(err, 1, 0.5, base=2.0, cap=120.0) == 120.0


def test_the_informer_retries_a_throttled_list_no_sooner_than_retry_after(throttling):
    """Without Retry-After its retries would come 1 s, then 2 s apart; the server asks for 2 s."""

    async def follow() -> None:
        client = _client(throttling)
        try:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(informer.Cache().run(client), timeout=5.5)
        finally:
            await client.close()

    asyncio.run(follow())
    for path, times in throttling.seen.items():
        gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
        assert len(times) >= 2, (path, times)
        assert all(gap >= 1.9 for gap in gaps), (path, gaps)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("3", 3.0),
        (" 120 ", 120.0),
        (email.utils.format_datetime(NOW + datetime.timedelta(seconds=30), usegmt=True), 30.0),
        (email.utils.format_datetime(NOW - datetime.timedelta(seconds=30), usegmt=True), 0.0),
        (None, None),
        ("-1", None),
        ("soon", None),
        ("1" * 100, None),
        ("٣", None),  # a digit, but not an ASCII one
    ],
)
def test_retry_after_is_read_as_seconds_or_an_http_date(header, seconds):
    assert api_errors.retry_after(header, NOW) == seconds
