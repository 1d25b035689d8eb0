"""A throw-away S3-compatible server for tests: versitygw's posix backend on a loopback port.

Not an emulator: versitygw is a real S3 gateway, built by scripts/bootstrap.sh from its Go module
(``github.com/versity/versitygw``) into ``$MESHTRAIN_CACHE/versitygw-<version>/bin/``. Each bucket
is a directory under the server's root; :class:`S3Server` starts it with a temporary root and a
random key pair, waits for its health endpoint and stops it. Its access log (one line per
request, with the S3 operation) is kept under the root's parent.
"""

from __future__ import annotations

import dataclasses
import os
import re
import secrets
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

#: The versitygw release the project pins; must equal the default in scripts/bootstrap.sh.
DEFAULT_VERSION = "v1.8.0"
REGION = "us-east-1"
START_TIMEOUT_S = 30.0


class ServerMissingError(RuntimeError):
    """The versitygw binary is not where the bootstrap puts it."""


def binary() -> Path:
    """The bootstrap's versitygw, or :class:`ServerMissingError` saying how to build it."""
    version = os.environ.get("MESHTRAIN_VERSITYGW_VERSION", DEFAULT_VERSION)
    cache = Path(os.environ.get("MESHTRAIN_CACHE") or Path.home() / ".cache" / "meshtrain")
    path = cache / f"versitygw-{version}" / "bin" / "versitygw"
    if not os.access(path, os.X_OK):
        raise ServerMissingError(
            f"versitygw {version} is not at {path}: run `scripts/bootstrap.sh --no-node` "
            "(`make test` runs it; it builds github.com/versity/versitygw with Go in about a minute)"
        )
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class S3Server:
    """A running versitygw serving ``root`` (one directory per bucket) at ``endpoint``."""

    root: Path
    endpoint: str
    access_key: str
    secret_key: str
    access_log: Path
    process: subprocess.Popen[bytes]

    def env(self) -> dict[str, str]:
        """The environment a client (s3fs, a trainer) reaches this server with."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": REGION,
            "AWS_DEFAULT_REGION": REGION,
        }

    def make_bucket(self, name: str) -> str:
        """Create bucket ``name`` (a directory of the posix backend); returns ``s3://name``."""
        (self.root / name).mkdir(exist_ok=True)
        return f"s3://{name}"

    def operations(self) -> list[str]:
        """The S3 operation of every request so far (``s3_GetObject``, ...), from the access log."""
        if not self.access_log.exists():
            return []
        return re.findall(r" (s3_[A-Za-z]+) ", self.access_log.read_text())

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 10 s)."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start(work: Path) -> S3Server:
    """Start versitygw on a free loopback port serving ``work/root``; waits until it answers."""
    root, log = work / "root", work / "versitygw.log"
    root.mkdir(parents=True, exist_ok=True)
    access, secret = "test" + secrets.token_hex(6), secrets.token_hex(16)
    port = _free_port()
    command = [
        str(binary()),
        "--access", access,
        "--secret", secret,
        "--region", REGION,
        "--port", f"127.0.0.1:{port}",
        "--health", "/health",
        "--access-log", str(work / "access.log"),
        "--quiet",
        "posix", str(root),
    ]  # fmt: skip
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = S3Server(
        root=root,
        endpoint=f"http://127.0.0.1:{port}",
        access_key=access,
        secret_key=secret,
        access_log=work / "access.log",
        process=process,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"versitygw exited with {process.returncode}: {log.read_text()}")
        try:
            with urllib.request.urlopen(server.endpoint + "/health", timeout=1) as resp:
                if resp.status == 200:
                    return server
        except OSError:
            time.sleep(0.1)
    server.stop()
    raise RuntimeError(f"versitygw did not answer within {START_TIMEOUT_S} s: {log.read_text()}")
