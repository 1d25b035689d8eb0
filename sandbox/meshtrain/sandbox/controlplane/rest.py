"""A minimal HTTPS client for the local control plane's own needs.

JSON over ``urllib`` with the control plane's CA and a client certificate or bearer token: enough
to poll ``/readyz`` and to create what
:meth:`~meshtrain.sandbox.controlplane.server.ControlPlane.restricted_kubeconfig` needs.  Not a
Kubernetes client: it lets a control plane start with nothing but the standard library and
``cryptography``.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import ssl
import urllib.error
import urllib.request
from typing import Any


class ApiError(RuntimeError):
    """The API server answered with an HTTP error status."""

    def __init__(self, status: int, method: str, path: str, body: str) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:500]}")
        self.status = status
        """The HTTP status code."""


@dataclasses.dataclass(frozen=True)
class Response:
    """An HTTP answer with its decoded JSON body (None when not JSON)."""

    status: int
    """The HTTP status code."""
    body: Any
    """The decoded JSON body, or the text when the body is not JSON."""


@dataclasses.dataclass(frozen=True)
class Client:
    """Talks to one server with one identity."""

    server: str
    """Base URL, e.g. ``https://127.0.0.1:6443``."""
    ca_file: pathlib.Path | None
    """CA bundle to verify the server with; None skips verification (component health ports)."""
    cert: tuple[pathlib.Path, pathlib.Path] | None = None
    """Client certificate and key, if authenticating by certificate."""
    token: str | None = None
    """Bearer token, if authenticating by token."""

    def request(
        self, method: str, path: str, body: Any = None, *, timeout: float = 10.0
    ) -> Response:
        """Send one request; raise :class:`ApiError` on an HTTP error status."""
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.server + path, data=data, method=method)
        request.add_header("Accept", "application/json")
        if data is not None:
            request.add_header("Content-Type", "application/json")
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(
                request, context=self._context(), timeout=timeout
            ) as answer:
                return Response(status=answer.status, body=_decode(answer.read()))
        except urllib.error.HTTPError as error:
            raise ApiError(
                error.code, method, path, error.read().decode(errors="replace")
            ) from None

    def create(self, path: str, body: dict[str, Any]) -> Response:
        """POST ``body``; an existing object (409) counts as success."""
        try:
            return self.request("POST", path, body)
        except ApiError as error:
            if error.status == 409:
                return Response(status=409, body=None)
            raise

    def _context(self) -> ssl.SSLContext:
        if self.ca_file is None:
            context = ssl.create_default_context()
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        else:
            context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.cert:
            context.load_cert_chain(str(self.cert[0]), str(self.cert[1]))
        return context


def _decode(raw: bytes) -> Any:
    text = raw.decode(errors="replace")
    try:
        return json.loads(text)
    except ValueError:
        return text
