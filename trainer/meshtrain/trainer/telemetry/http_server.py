"""The HTTP server of a rank's exporter: ``GET`` of a few fixed paths, bounded in time and connections.

One asyncio loop in one daemon thread serves every connection, so an idle or half-sent
connection costs a socket and a small buffer, never a thread (``http.server``'s threading server
held a thread per connection with no timeout: 1,500 half-sent requests held 1,500 threads).  A
request's head (at most :data:`HEAD_LIMIT` bytes) must arrive within :data:`REQUEST_SECONDS`.
At most :data:`MAX_CONNECTIONS` are open at once: a new one beyond that closes the oldest one
still sending its request, so a flood of half-sent requests cannot shut Prometheus or the
operator out.  Only ``GET`` of a route is answered (405 for another method, 404 for another
path, 400 for what is no HTTP/1.x request); one request per connection.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Callable, Mapping

log = logging.getLogger(__name__)

Route = Callable[[], tuple[bytes, str]]
"""What a path serves: the body and its Content-Type, made at each request."""

HEAD_LIMIT = 8192
"""Most bytes of a request line and its headers."""
REQUEST_SECONDS = 5.0
"""Time a connection has to send its whole request head."""
ANSWER_SECONDS = 10.0
"""Time a client has to take the answer."""
MAX_CONNECTIONS = 64
"""Connections open at once (Prometheus and the operator need a few)."""
CLOSE_SECONDS = 2.0
"""Time the open connections' handlers get to end at :meth:`Server.close`."""
BACKLOG = 512
"""Connections the kernel queues before the loop accepts them (a flood is accepted, then shed)."""

_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed"}


def _answer(status: int, body: bytes, content_type: str) -> bytes:
    head = (
        f"HTTP/1.1 {status} {_REASONS[status]}\r\n"
        f"Content-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\n"
        "Connection: close\r\n"
    )
    if status == 405:
        head += "Allow: GET\r\n"
    return head.encode("ascii") + b"\r\n" + body


def respond(head: bytes, routes: Mapping[str, Route]) -> bytes:
    """The whole HTTP answer to a request ``head`` (its request line and headers)."""
    line = head.split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return _answer(400, b"not an HTTP/1.x request\n", "text/plain")
    method, target = parts[0], parts[1].split("?", 1)[0]
    if target not in routes:
        return _answer(404, b"not found\n", "text/plain")
    if method != "GET":
        return _answer(405, b"only GET\n", "text/plain")
    body, content_type = routes[target]()
    return _answer(200, body, content_type)


class Server:
    """``routes`` served on ``host:port`` from a thread of its own until :meth:`close`.

    The port is bound in the constructor, so an address in use raises ``OSError`` there.
    """

    def __init__(self, host: str, port: int, routes: Mapping[str, Route]) -> None:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=BACKLOG)
        self._routes = dict(routes)
        self._loop = asyncio.new_event_loop()
        self._open: dict[asyncio.StreamWriter, bool] = {}
        """Open connections, oldest first: True while the request is still being read."""
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"metrics-{port}", daemon=True)
        self._thread.start()
        self._started.wait()

    def _run(self) -> None:
        loop = self._loop
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(
            asyncio.start_server(self._serve, sock=self._socket, limit=HEAD_LIMIT)
        )
        self._started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            loop.run_until_complete(self._drop_all())
            loop.run_until_complete(server.wait_closed())
            loop.close()

    async def _drop_all(self) -> None:
        """Abort every connection and let its handler end (accepted ones included)."""
        for _ in range(3):
            await asyncio.sleep(0)  # connections accepted before the close start their handlers
            for writer in list(self._open):
                writer.transport.abort()
            pending = asyncio.all_tasks() - {asyncio.current_task()}
            if not pending:
                return
            await asyncio.wait(pending, timeout=CLOSE_SECONDS)

    def _make_room(self) -> bool:
        """Room for one more connection: close the oldest still sending its request if need be."""
        if len(self._open) < MAX_CONNECTIONS:
            return True
        oldest = next((w for w, reading in self._open.items() if reading), None)
        if oldest is None:
            return False
        del self._open[oldest]
        oldest.transport.abort()
        return True

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._make_room():
            writer.transport.abort()
            return
        self._open[writer] = True
        writer.transport.set_write_buffer_limits(high=0)  # drain() returns once all is sent
        answered = False
        try:
            async with asyncio.timeout(REQUEST_SECONDS):
                head = await reader.readuntil(b"\r\n\r\n")
            self._open[writer] = False
            writer.write(respond(head, self._routes))
            async with asyncio.timeout(ANSWER_SECONDS):
                await writer.drain()
            answered = True
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
            pass  # too slow, too long, or gone: dropped
        except Exception:  # a route that fails answers nothing; the server goes on
            log.exception("metrics request failed")
        finally:
            self._open.pop(writer, None)
            if answered:
                writer.close()
            else:
                writer.transport.abort()

    def close(self) -> None:
        """Stop serving and close every connection."""
        if self._loop.is_closed():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
