"""A real HTTP server on 127.0.0.1 that answers ``GET /progress`` as a hostile pod could.

Each :data:`ANSWERS` entry writes raw bytes to the socket (status line, headers, body) so the
tests see what a real client does with a huge, slow, redirecting, compressed or malformed
answer.  The server records every request line it was sent (a followed redirect shows up).
Shared by the unit tests of the operator's progress client and the operator's integration test.
"""

from __future__ import annotations

import itertools
import json
import socket
import socketserver
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any, BinaryIO

HUGE_BYTES = 300 * 2**20
"""What the huge answer announces and streams: 300 MiB."""

GOOD = {
    "step": 17,
    "loss": 3.25,
    "tokens_per_second": 1234.5,
    "last_checkpoint_step": 10,
    "updated_at": "2026-01-01T00:00:00Z",
}
"""A trainer's ordinary progress document."""


def _head(out: BinaryIO, status: str, headers: dict[str, str]) -> None:
    lines = [f"HTTP/1.1 {status}", *(f"{k}: {v}" for k, v in headers.items()), "", ""]
    out.write("\r\n".join(lines).encode())


def document(doc: Any) -> Callable[[BinaryIO], None]:
    """An answer with ``doc`` as its JSON body (``allow_nan`` so NaN can be sent)."""
    body = doc if isinstance(doc, bytes) else json.dumps(doc, allow_nan=True).encode()

    def answer(out: BinaryIO) -> None:
        _head(out, "200 OK", {"Content-Type": "application/json", "Content-Length": str(len(body))})
        out.write(body)

    return answer


def _huge(announce: bool) -> Callable[[BinaryIO], None]:
    def answer(out: BinaryIO) -> None:
        headers = {"Content-Type": "application/json"}
        if announce:
            headers["Content-Length"] = str(HUGE_BYTES)
        _head(out, "200 OK", headers)
        chunk = b'{"step": 1, "pad": "' + b"x" * 65_000
        for _ in range(HUGE_BYTES // len(chunk)):
            out.write(chunk)

    return answer


def _slow(out: BinaryIO) -> None:
    body = json.dumps(GOOD).encode()
    _head(out, "200 OK", {"Content-Length": str(len(body))})
    out.flush()
    for byte in body:  # one byte a second
        out.write(bytes([byte]))
        out.flush()
        time.sleep(1.0)


def _redirect(out: BinaryIO) -> None:
    _head(out, "302 Found", {"Location": "/elsewhere", "Content-Length": "0"})


def _gzip_bomb(out: BinaryIO) -> None:
    packer = zlib.compressobj(wbits=31)  # the gzip container
    spaces = b" " * 2**20
    body = b"".join(packer.compress(spaces) for _ in range(3))  # 3 KiB inflating to 3 MiB
    body += packer.compress(json.dumps(GOOD).encode()) + packer.flush()
    headers = {"Content-Encoding": "gzip", "Content-Length": str(len(body))}
    _head(out, "200 OK", headers)
    out.write(body)


def _many_headers(out: BinaryIO) -> None:
    _head(out, "200 OK", {f"X-Pad-{i}": "y" * 1000 for i in range(10_000)})


def _long_header(out: BinaryIO) -> None:
    _head(out, "200 OK", {"X-Pad": "y" * 1_000_000})


ANSWERS: dict[str, Callable[[BinaryIO], None]] = {
    "good": document(GOOD),
    "huge announced": _huge(announce=True),
    "huge streamed": _huge(announce=False),
    "slow": _slow,
    "redirect": _redirect,
    "gzip bomb": _gzip_bomb,
    "many headers": _many_headers,
    "long header": _long_header,
    "malformed JSON": document(b'{"step": 12, "loss": '),
    "not an object": document([1, 2, 3]),
    "duplicate keys": document(b'{"step": 1, "step": 2}'),
    "NaN loss": document(b'{"step": 3, "loss": NaN}'),
    "infinite rate": document(b'{"step": 3, "tokens_per_second": Infinity}'),
    "deep nesting": document(b"[" * 3000 + b"]" * 3000),
    "not UTF-8": document(b'{"step": 1, "updated_at": "\xff\xfe"}'),
}
"""Answers by name: each writes the whole HTTP response (or as much as the client takes)."""


def rotating(names: list[str]) -> Callable[[BinaryIO], None]:
    """Each request answered by the next of ``names`` (of :data:`ANSWERS`), round and round."""
    turns = itertools.cycle([ANSWERS[name] for name in names])
    lock = threading.Lock()

    def answer(out: BinaryIO) -> None:
        with lock:
            chosen = next(turns)
        chosen(out)

    return answer


class Server:
    """``GET`` on 127.0.0.1:``port`` answered by ``answer``; ``requests`` are the lines it got."""

    def __init__(self, answer: Callable[[BinaryIO], None]) -> None:
        self.answer = answer
        """What the server writes back (may be changed while it runs)."""
        self.requests: list[str] = []
        """Every request line received, in order."""
        owner = self

        class Handler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                line = self.rfile.readline(4096).decode("latin-1").strip()
                owner.requests.append(line)
                while self.rfile.readline(4096) not in (b"\r\n", b"\n", b""):
                    pass
                try:
                    owner.answer(self.wfile)
                    self.wfile.flush()
                except OSError:  # the client hung up: what a bounded client does
                    pass

        class Threads(socketserver.ThreadingTCPServer):
            daemon_threads = True
            allow_reuse_address = True

            def handle_error(self, request: Any, client_address: Any) -> None:
                pass

        self._server = Threads(("127.0.0.1", 0), Handler)
        self.port: int = self._server.server_address[1]
        """The port it listens on."""

    def __enter__(self) -> Server:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *_: Any) -> None:
        self._server.shutdown()
        self._server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (free a moment ago)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
