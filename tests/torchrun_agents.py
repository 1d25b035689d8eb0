"""torchrun agents on loopback started exactly as the operator's pods start them (tests, benchmarks).

The command, arguments and plain environment come from ``builders.build_pod`` for a custom
trainer; only what a loopback machine cannot give is replaced: the rank-0 pod's DNS name becomes
127.0.0.1 and ``MASTER_PORT`` a free port (in every variable that names them), and ``torchrun``
resolves to this interpreter's ``torch.distributed.run`` (what torchrun's console script runs).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from meshtrain.api import loading
from meshtrain.operator.policy import builders, identity, naming
from tests.builders import JobBuilder

JOB = identity.JobRef(name="ddp", namespace="research", uid="0f3c9d2e-uid")
MAX_PROC_ENTRIES = 100_000
"""Bound on /proc entries read when looking for an agent's workers."""


def ddp_example(steps: int, limit: int, progress_port: int | None = None) -> JobBuilder:
    """The DDP example as a custom trainer under torchrun's elastic tier, two one-GPU pods."""
    args = ["--steps", str(steps), "--checkpoint-every", "10"]
    reported: dict[str, Any] = {}
    if progress_port is not None:
        args += ["--progress-port", str(progress_port)]
        reported["progressPort"] = progress_port
    return (
        JobBuilder("ddp")
        .layout(data=2, gpus_per_node=1)
        .trainer(
            type="custom",
            command=["torchrun", "-m", "meshtrain.examples.ddp"],
            args=args,
            **reported,
        )
        .run_policy(recovery={"inPlaceLimit": limit, "torchrunElastic": True})
    )


def pods(builder: JobBuilder, attempt: int = 0) -> list[dict[str, Any]]:
    """The gang's pods as the operator builds them for ``builder``'s spec."""
    spec = loading.parse_spec(builder.raw())
    return builders.build_pods(JOB, spec, attempt, [f"n-{i}" for i in range(spec.pods)])


def shim(folder: Path) -> Path:
    """A ``torchrun`` in ``folder`` running this interpreter's torch (the console script's target)."""
    path = folder / "torchrun"
    path.write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
    path.chmod(0o755)
    return folder


def loopback_env(pod: dict[str, Any], port: int, bin_dir: Path, **extra: str) -> dict[str, str]:
    """The pod's plain environment (``valueFrom`` ones left out) moved to 127.0.0.1:``port``, with
    every path on its checkpoint volume moved under ``bin_dir``'s folder.

    The volume's paths must never reach the host as they are: a test run as root would create them
    at ``/`` and the next run, in any clone, would resume from the last one's checkpoint.
    """
    container = pod["spec"]["containers"][0]
    plain = {e["name"]: e["value"] for e in container["env"] if "value" in e}
    host, master_port = plain["MASTER_ADDR"], plain["MASTER_PORT"]
    volume, folder = plain["MESHTRAIN_CHECKPOINT_DIR"], str(bin_dir.parent)
    moved = {
        key: _on_volume_moved(
            value.replace(f"{host}:{master_port}", f"127.0.0.1:{port}").replace(host, "127.0.0.1"),
            volume,
            folder,
        )
        for key, value in plain.items()
    }
    moved["MASTER_PORT"] = moved["PET_MASTER_PORT"] = str(port)
    moved["MESHTRAIN_TERMINATION_LOG"] = f"{folder}/termination-log"
    assert master_port == str(naming.MASTER_PORT)
    path = f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, **moved, "PATH": path, "OMP_NUM_THREADS": "1", **extra}


def _on_volume_moved(value: str, volume: str, folder: str) -> str:
    """``value`` with a leading ``volume`` path replaced by ``folder`` (other values as they are)."""
    if value == volume or value.startswith(volume.rstrip("/") + "/"):
        return folder + value[len(volume.rstrip("/")) :]
    return value


def start(pod: dict[str, Any], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """Pod ``pod``'s container command and arguments, as built, in a session of its own."""
    container = pod["spec"]["containers"][0]
    with log.open("ab") as out:
        return subprocess.Popen(
            [*container["command"], *container["args"]],
            env=env,
            cwd=container.get("workingDir"),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def workers(*agents: int) -> dict[int, int]:
    """{global RANK: pid} of the processes the ``agents`` (their :func:`start` pids) run now."""
    found: dict[int, int] = {}
    entries = [e for e in os.listdir("/proc") if e.isdigit()][:MAX_PROC_ENTRIES]
    for entry in entries:
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid not in agents:
                continue
            environ = Path(f"/proc/{entry}/environ").read_bytes()[:1_000_000].split(b"\0")
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
        ranks = [v[5:] for v in environ if v.startswith(b"RANK=")]
        if ranks and ranks[0].isdigit():
            found[int(ranks[0])] = int(entry)
    return found


def end(procs: list[subprocess.Popen[bytes]]) -> None:
    """SIGKILL what is left of each process's session (started by :func:`start`) and the workers
    of those that are torchrun agents (torchrun starts them in sessions of their own), and reap it."""
    for pid in workers(*(proc.pid for proc in procs)).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for proc in procs:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start_gang(
    builder: JobBuilder, folder: Path, port: int, **extra: str
) -> list[subprocess.Popen[bytes]]:
    """Every pod of ``builder``'s gang started on loopback (rendezvous on ``port``), each logging to
    ``folder/agent-<index>.log``, with torchrun shimmed from ``folder/bin``."""
    bin_dir = folder / "bin"
    bin_dir.mkdir(exist_ok=True)
    shim(bin_dir)
    return [
        start(pod, loopback_env(pod, port, bin_dir, **extra), folder / f"agent-{index}.log")
        for index, pod in enumerate(pods(builder))
    ]
