"""Rank 0's ``GET /progress``: the only request the operator sends to a tenant's pod, bounded.

aiohttp (already kubernetes_asyncio's transport) rather than urllib in a thread: one deadline for
the whole request (connect, headers, body) that cancels it, no thread held while a pod dribbles
bytes, and settings for each limit below.  No redirect is followed, no proxy is taken from the
environment, nothing is decompressed (a gzip bomb), no cookie is kept; headers are capped in
count and length and at most ``BODY_LIMIT + 1`` body bytes are read before the connection is
dropped.  What the body says passes :mod:`~meshtrain.operator.policy.progress_report`'s schema.
Each job is polled at most once per ``--progress-seconds``, less often after failures; what is
kept per job is keyed by its UID, so a namesake re-created starts afresh.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from typing import Any

import aiohttp

from meshtrain.operator.policy import identity, progress_report

logger = logging.getLogger("meshtrain.operator")

PATH = "/progress"
"""The trainer's progress endpoint (on ``spec.metrics.port``, or a custom program's ``progressPort``)."""
BODY_LIMIT = progress_report.BODY_LIMIT
"""Most body bytes read; one more refuses the answer."""
LINE_LIMIT = 1024
"""Longest status line or header line of the answer."""
MAX_HEADERS = 32
"""Most header lines of the answer."""
CONCURRENT = 64
"""Polls in flight at once across every job (each holds one socket)."""
ERROR_QUOTE = 200
"""Characters of an error kept in a log line (an error may quote the pod's bytes)."""


class Refused(Exception):
    """The pod gave no usable answer (the message says why, bounded)."""

    def __init__(self, message: str, *, counted: bool = True) -> None:
        super().__init__(message)
        self.counted = counted
        """Whether it slows the job's polls down: not when nothing listens yet (a starting trainer)."""


async def _capped(content: aiohttp.StreamReader, limit: int) -> bytes:
    """At most ``limit`` bytes of the body; more refuses it after reading ``limit + 1``."""
    body = bytearray()
    while len(body) <= limit:
        chunk = await content.read(limit + 1 - len(body))
        if not chunk:
            return bytes(body)
        body += chunk
    raise Refused(f"the answer has more than {limit} bytes")


def url(ip: str, port: int) -> str:
    """``http://ip:port/progress`` of a pod IP (an IPv6 address in brackets)."""
    try:
        address = ipaddress.ip_address(ip)
    except ValueError:
        raise Refused(f"pod IP {ip[:64]!r} is not an IP address") from None
    host = f"[{address}]" if address.version == 6 else str(address)
    return f"http://{host}:{port}{PATH}"


class Poller:
    """The bounded progress client of the operator process, and when each job is due again."""

    def __init__(self, *, every: float, timeout: float) -> None:
        self.every = every
        """Seconds between two polls of one job (``--progress-seconds``)."""
        self.timeout = timeout
        """Deadline of one whole request, in seconds."""
        self._session: aiohttp.ClientSession | None = None
        self._next: dict[str, float] = {}
        """Job UID -> when it is due again (monotonic seconds)."""
        self._failures: dict[str, int] = {}
        """Job UID -> failed polls in a row."""
        self._notes: dict[str, tuple[str, ...]] = {}
        """Job UID -> what its last refused answer was refused for."""
        self._busy: set[str] = set()
        """UIDs of the jobs being polled now."""

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on the operator's loop, at its first poll
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=CONCURRENT, force_close=True),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers={"Accept": "application/json", "Accept-Encoding": "identity"},
                cookie_jar=aiohttp.DummyCookieJar(),
                trust_env=False,
                auto_decompress=False,
                max_line_size=LINE_LIMIT,
                max_field_size=LINE_LIMIT,
                max_headers=MAX_HEADERS,
                read_bufsize=2 * BODY_LIMIT,
            )
        return self._session

    async def fetch(self, *, ip: str, port: int) -> bytes:
        """The body of one ``GET /progress`` within :attr:`timeout`; :class:`Refused` otherwise."""
        try:
            async with asyncio.timeout(self.timeout):
                async with self._client().get(url(ip, port), allow_redirects=False) as response:
                    if response.status != 200:  # a redirect included: it is not followed
                        raise Refused(f"HTTP status {response.status}, not 200")
                    length = response.content_length
                    if length is not None and length > BODY_LIMIT:
                        raise Refused(f"the answer announces {length} bytes (limit {BODY_LIMIT})")
                    return await _capped(response.content, BODY_LIMIT)
        except TimeoutError:
            raise Refused(f"no complete answer within {self.timeout:g} s") from None
        except aiohttp.ClientConnectorError as err:
            message = f"not listening yet: {str(err)[:ERROR_QUOTE]}"
            raise Refused(message, counted=False) from None
        except (aiohttp.ClientError, OSError, ValueError) as err:
            raise Refused(f"{type(err).__name__}: {str(err)[:ERROR_QUOTE]}") from None

    async def poll(self, job: identity.JobRef, *, ip: str, port: int) -> dict[str, Any] | None:
        """The checked document of ``job``'s rank 0 when it is due and answers; else None (logged)."""
        key = job.uid
        now = time.monotonic()
        if key in self._busy or now < self._next.get(key, 0.0):
            return None
        self._busy.add(key)
        try:
            reading = progress_report.parse(await self.fetch(ip=ip, port=port))
        except Refused as err:
            if not err.counted:  # the trainer is still starting: the normal rate, no warning
                self._next[key] = now + self.every
                logger.debug("progress of %s/%s: %s", job.namespace, job.name, err)
                return None
            reading = progress_report.Reading(None, (str(err),))
        finally:
            self._busy.discard(key)
        failures = self._failures.get(key, 0) + 1 if reading.document is None else 0
        self._failures[key] = failures
        self._next[key] = now + progress_report.wait_after(failures, self.every)
        self._note(job, reading.notes, failures)
        return reading.document

    def _note(self, job: identity.JobRef, notes: tuple[str, ...], failures: int) -> None:
        """Log what the schema or the client refused: a warning when it changes, else at debug."""
        if not notes:
            self._notes.pop(job.uid, None)
            return
        level = logging.DEBUG if self._notes.get(job.uid) == notes else logging.WARNING
        self._notes[job.uid] = notes
        logger.log(
            level,
            "progress of %s/%s: %s (%d failed poll(s) in a row)",
            job.namespace,
            job.name,
            "; ".join(notes),
            failures,
        )

    def forget(self, uid: str) -> None:
        """Drop what is kept about the deleted job of ``uid``."""
        for kept in (self._next, self._failures, self._notes):
            kept.pop(uid, None)

    async def close(self) -> None:
        """Close the connection pool (the operator stops)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
