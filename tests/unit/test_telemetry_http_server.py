"""The exporter's HTTP server under a flood: half-sent requests hold no thread and shut nobody out.

A real :class:`exporter.Exporter` of rank 0 on 127.0.0.1 and real client sockets.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import pytest

from meshtrain.api import layout as layout_mod
from meshtrain.sandbox.controlplane.ports import pick_free_port
from meshtrain.trainer.telemetry import context, exporter, http_server, progress, stepstats

HALF_SENT = 1500
"""Connections that send part of a request and then nothing (the issue's measurement)."""


def _exporter() -> exporter.Exporter:
    identity = context.RankIdentity.from_env(layout_mod.ParallelLayout(1, 1, 1), 0, 0, env={})
    facts = stepstats.JobFacts(1, 1, 1, 1, {"dp": 1, "tp": 1, "pp": 1}, 1.0, 1.0)
    doc = progress.Progress()
    doc.update(step=3)
    served = exporter.Exporter(
        identity, facts, port=pick_free_port(), progress=doc, host="127.0.0.1"
    )
    assert served.serving
    return served


def _get(port: int, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def _raw(port: int, request: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(request)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
        return b"".join(chunks)


def test_half_sent_requests_hold_no_thread_and_metrics_still_answer():
    served = _exporter()
    threads_before = threading.active_count()
    flood: list[socket.socket] = []
    try:
        for _ in range(HALF_SENT):
            sock = socket.create_connection(("127.0.0.1", served.port), timeout=5)
            sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: rank-0\r\n")  # never finished
            flood.append(sock)
        time.sleep(0.5)  # the server has accepted them all
        assert threading.active_count() <= threads_before + 1
        started = time.monotonic()
        status, body = _get(served.port, "/metrics")
        assert status == 200 and b"meshtrain_step" in body
        status, body = _get(served.port, "/progress")
        assert status == 200 and json.loads(body)["step"] == 3
        assert time.monotonic() - started < 2.0, "the scrape waited behind the flood"
        assert threading.active_count() <= threads_before + 1
    finally:
        for sock in flood:
            sock.close()
        served.close()


def test_a_half_sent_request_is_dropped_after_the_request_time(monkeypatch):
    monkeypatch.setattr(http_server, "REQUEST_SECONDS", 1.0)
    served = _exporter()
    try:
        with socket.create_connection(("127.0.0.1", served.port), timeout=5) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\n")
            started = time.monotonic()
            assert sock.recv(1024) == b"", "closed without an answer"
            assert 0.8 < time.monotonic() - started < 3.0
    finally:
        served.close()


def test_connections_past_the_cap_close_the_oldest_unfinished_ones():
    served = _exporter()
    idle = [
        socket.create_connection(("127.0.0.1", served.port), timeout=5)
        for _ in range(http_server.MAX_CONNECTIONS + 5)
    ]
    try:
        time.sleep(0.5)
        closed = 0
        for sock in idle[:5]:  # the five oldest made room for the last five
            sock.settimeout(2)
            closed += sock.recv(1) == b""
        assert closed == 5
        assert _get(served.port, "/healthz") == (200, b"ok\n")
    finally:
        for sock in idle:
            sock.close()
        served.close()


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"GET /metrics HTTP/1.1\r\n\r\n", b"200"),
        (b"POST /metrics HTTP/1.1\r\nContent-Length: 2\r\n\r\nhi", b"405"),
        (b"DELETE /progress HTTP/1.1\r\n\r\n", b"405"),
        (b"GET /../../etc/passwd HTTP/1.1\r\n\r\n", b"404"),
        (b"GET http://evil/metrics HTTP/1.1\r\n\r\n", b"404"),
        (b"\x16\x03\x01 tls hello\r\n\r\n", b"400"),
        (b"GET /metrics\r\n\r\n", b"400"),
    ],
)
def test_only_get_of_the_known_paths_is_answered(request_bytes, status):
    served = _exporter()
    try:
        answer = _raw(served.port, request_bytes)
    finally:
        served.close()
    assert answer.split(b" ", 2)[1] == status, answer[:200]
    assert b"Connection: close" in answer


def test_a_request_head_over_the_limit_is_dropped():
    served = _exporter()
    try:
        huge = (
            b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"y" * (2 * http_server.HEAD_LIMIT) + b"\r\n\r\n"
        )
        assert _raw(served.port, huge) == b""
        assert _get(served.port, "/healthz")[0] == 200
    finally:
        served.close()
