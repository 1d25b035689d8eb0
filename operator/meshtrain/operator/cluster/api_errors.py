"""The API server's answers that are errors, as the operator's client raises them."""

from __future__ import annotations

import json


class ApiError(RuntimeError):
    """A non-2xx answer of the API server (``status`` 0: the server could not be reached)."""

    def __init__(self, status: int, verb: str, what: str, body: str) -> None:
        super().__init__(f"{verb} {what} -> {status or 'unreachable'}: {body[:500]}")
        self.status = status
        self.body = body


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


def error_message(body: str) -> str:
    try:
        return str(json.loads(body).get("message") or body)
    except ValueError:
        return body
