"""A throw-away Prometheus for tests: Debian's ``prometheus`` on a loopback port.

:class:`PrometheusApi` queries a running Prometheus;
:class:`PrometheusServer` writes a config scraping the given
targets every second as the chart's PodMonitor does (no ``honor_labels``: the
target's job and namespace win, the exporters' copies are dropped), loads rule files, starts ``prometheus`` with a
temporary data directory, waits until it is ready and answers instant
queries through the HTTP API.  :func:`free_port_block` finds consecutive
free ports for a run's exporters.

Not a mock.  It fails loudly when the binary is missing
(``make bootstrap`` or ``apt-get install prometheus`` installs it).
"""

from __future__ import annotations

import json
import random
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from meshtrain.sandbox import prometheus as sandbox_prometheus


def free_port_block(count: int, start: int = 20000, stop: int = 40000) -> int:
    """First port of ``count`` consecutive ports free on 127.0.0.1 and 0.0.0.0 now, tried in a
    random order: two pytest workers scanning from ``start`` at the same moment would both find
    its first block free, and the second server to bind it fails."""
    bases = list(range(start, stop, count + 3))
    random.SystemRandom().shuffle(bases)
    for base in bases:
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                s.bind(("0.0.0.0", port))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports in {start}..{stop}")


class PrometheusApi:
    """Instant queries and API reads of a running Prometheus at ``url``."""

    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: Any) -> Any:
        """GET /api/v1/<path>; returns ``data`` or raises with Prometheus' error."""
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as err:
            body = json.load(err)
        if body.get("status") != "success":
            raise ValueError(f"{body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str, at: float) -> list[dict[str, Any]]:
        """Instant query at unix time ``at``: the result vector (raises on a bad query)."""
        data = self.api("query", query=expr, time=f"{at:.3f}")
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]


class PrometheusServer(PrometheusApi):
    """A prometheus process scraping ``targets`` every second."""

    def __init__(
        self,
        workdir: Path,
        targets: list[str],
        rule_files: list[Path] = (),
        *,
        namespace: str,
        job: str = "meshtrain-trainer",
        relabel: list[dict[str, Any]] | None = None,
        pod: str | None = None,
    ) -> None:
        """Scrape ``targets`` as pods of ``namespace`` (the target label Kubernetes discovery sets;
        ``pod`` too when given: the ports of one pod) in the scrape job ``job``, relabelled as the
        chart's monitor (the trainers' by default)."""
        binary = shutil.which("prometheus")
        if binary is None:
            raise RuntimeError(
                "prometheus is not installed: run `make bootstrap` or `apt-get install -y prometheus`"
            )
        self.port = free_port_block(1, start=41000, stop=49000)
        super().__init__(f"http://127.0.0.1:{self.port}")
        workdir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": "1s",
                "scrape_timeout": "900ms",
                "evaluation_interval": "1s",
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [
                {
                    "job_name": job,
                    "static_configs": [
                        {
                            "targets": targets,
                            "labels": {"namespace": namespace} | ({"pod": pod} if pod else {}),
                        }
                    ],
                    "metric_relabel_configs": (
                        sandbox_prometheus.TRAINER_METRIC_RELABEL if relabel is None else relabel
                    ),
                }
            ],
        }
        (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [
                binary,
                f"--config.file={workdir / 'prometheus.yml'}",
                f"--storage.tsdb.path={workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--storage.tsdb.retention.time=1h",
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.3)
        raise RuntimeError(
            f"prometheus not ready after {timeout}s:\n{self.log_path.read_text()[-3000:]}"
        )

    def stop(self) -> None:
        """Terminate the process (its data directory goes with the test's tmp dir)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
