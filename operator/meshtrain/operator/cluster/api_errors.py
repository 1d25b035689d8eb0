"""The API server's answers that are errors, as the operator's client raises them."""

from __future__ import annotations

import datetime
import email.utils
import json
import math

from meshtrain.operator.policy import retries

RETRY_AFTER_CHARS = 64
"""Longest ``Retry-After`` value read; a longer one is no valid header and is ignored."""


class ApiError(RuntimeError):
    """A non-2xx answer of the API server (``status`` 0: the server could not be reached)."""

    def __init__(
        self, status: int, verb: str, what: str, body: str, retry_after: float | None = None
    ) -> None:
        super().__init__(f"{verb} {what} -> {status or 'unreachable'}: {body[:500]}")
        self.status = status
        self.body = body
        self.retry_after = retry_after
        """Seconds the server asked the client to wait (its ``Retry-After`` header), if it did."""


def retry_after(value: str | None, now: datetime.datetime) -> float | None:
    """Seconds a ``Retry-After`` header asks for: delta-seconds or an HTTP-date (RFC 9110 10.2.3).

    None for no header or one that is neither; a date in the past is 0.  Unbounded here: the
    caller caps it (``retries.jittered``).
    """
    if value is None or len(value) > RETRY_AFTER_CHARS:
        return None
    text = value.strip()
    if text.isascii() and text.isdigit():
        return float(int(text))
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    seconds = (when - now).total_seconds()
    return max(seconds, 0.0) if math.isfinite(seconds) else None


class Conflict(ApiError):
    """409 on a write guarded by resourceVersion: re-read and decide again."""


class NotLeading(RuntimeError):
    """A write not sent, or abandoned before its answer: this replica no longer holds the Lease.

    Not an :class:`ApiError`, so no handler of API errors swallows it: it ends the
    pass, and the leader decides from what the cluster holds.
    """


def transport_error(err: BaseException) -> bool:
    """Connection refused or reset, a timeout, a broken stream: the server was not reached.

    Matched by module so that aiohttp, the library's transport, is not imported here.
    """
    return isinstance(err, OSError | TimeoutError) or type(err).__module__.startswith("aiohttp")


def retry_delay(
    err: BaseException, failures: int, fraction: float, *, base: float, cap: float
) -> float:
    """Seconds before the next try after ``failures`` in a row, the last on ``err``.

    The operator's one backoff after 429/5xx and unreachable servers (``retries.jittered``):
    doubling from ``base`` up to ``cap``, stretched by ``fraction`` (``random.random()``), never
    sooner than the server's ``Retry-After`` (capped at ``cap``).
    """
    after = err.retry_after if isinstance(err, ApiError) else None
    return retries.jittered(failures, base=base, cap=cap, fraction=fraction, retry_after=after)


def error_message(body: str) -> str:
    try:
        return str(json.loads(body).get("message") or body)
    except ValueError:
        return body
