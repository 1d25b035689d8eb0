"""``meshtrain run``: train a TrainingJob on this machine with one process per rank.

:func:`run_local` checks spec and dataset before any process starts, then runs ``world_size``
processes of ``python -m meshtrain.trainer`` with torchrun's variables, showing how many ranks are
ready, then the steps (:class:`_Watch`).
Its own spawner, not ``torch.distributed.run``: the agent's restarts and rendezvous are what the
operator does in a cluster, and here we want the opposite (fail fast, one log per rank).
"""

from __future__ import annotations

import datetime
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import FrameType
from typing import IO, Any

import torch

from meshtrain.api import console, exitcodes, job_dir, limits, loading
from meshtrain.api import spec as api_spec
from meshtrain.api.spec import checkpoint as api_checkpoint
from meshtrain.planner import host_model
from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import store
from meshtrain.trainer.data import dataset
from meshtrain.trainer.interop import config_json, from_hf
from meshtrain.trainer.telemetry import readiness, steplog
from meshtrain.trainer.telemetry.tracking import terminal as trackers

POLL_S = 0.2
KILL_GRACE_S = 3.0
"""After a rank failed: how long the others get before they are killed."""
STOP_GRACE_S = 60.0
"""After an interrupt: how long the ranks get to finish a step and save it."""
READY_DIR = "ready"
"""Under the log directory: the ranks' ready files (:mod:`.telemetry.readiness`)."""


EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
PICKED_PORTS = (12000, 30000)
"""Where :func:`free_port` picks, below the kernel's ephemeral range: above Kubernetes' own fixed
ports (the kubelet's 10250, the control plane's 10257 and 10259), below its NodePort range."""
PORT_TRIES = 64


def free_port() -> int:
    """A loopback TCP port that was free a moment ago, below the kernel's ephemeral range where
    it can: a port the kernel picks for port 0 lies in that range, where any process's next
    outgoing connection may take it before the caller binds it (a test's store lost its port so
    beside a busy control plane); below it only another explicit bind can."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        fallback = int(sock.getsockname()[1])
    try:
        ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return fallback
    low, high = PICKED_PORTS[0], min(PICKED_PORTS[1], ephemeral_low)
    if high <= low:
        return fallback
    pick = random.SystemRandom()
    for _ in range(PORT_TRIES):
        port = pick.randrange(low, high)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return fallback


def default_log_dir(name: str) -> Path:
    """runs/<name>-<timestamp>."""
    return Path("runs") / f"{name}-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"


def checkpoint_dir(job: api_spec.TrainingJobSpec, log_dir: Path) -> store.Location:
    """Where a local run keeps checkpoints: spec.checkpoint.path if the spec changes it, else <log-dir>/checkpoints.

    So re-running ``meshtrain run`` with the same ``--log-dir`` resumes, and
    local runs never share the pod default ``/checkpoints``.
    """
    pod_default = api_checkpoint.Checkpoint.model_fields["path"].default
    return (
        store.location(job.checkpoint.path)
        if job.checkpoint.path != pod_default
        else log_dir / "checkpoints"
    )


def job_identity(
    job: api_spec.TrainingJobSpec, metadata: dict[str, Any], name: str, log_dir: Path
) -> dict[str, str]:
    """The job the ranks run for, as their environment (raises OwnerError on a bad name).

    With ``checkpoint.path`` set, that directory may be shared: the job writes in its own
    ``<path>/<namespace>/<name>`` (namespace ``local`` unless the manifest or ``MESHTRAIN_NAMESPACE`` names one), under a UID
    of this run, so a second live run of the name is refused and a later one resumes.  Without it,
    ``<log-dir>/checkpoints`` is the run's own directory already and is used as it is (no identity).
    """
    directory = checkpoint_dir(job, log_dir)
    if directory == log_dir / "checkpoints":
        return {}
    # the manifest's namespace, else the one the environment names (as a pod's does), else "local"
    namespace = str(
        metadata.get("namespace")
        or os.environ.get(job_dir.NAMESPACE_ENV)
        or job_dir.LOCAL_NAMESPACE
    )
    # a name that cannot name a directory fails here, before any process starts
    job_dir.job_dir(str(directory), namespace, name)
    return {
        job_dir.NAMESPACE_ENV: namespace,
        job_dir.NAME_ENV: name,
        job_dir.UID_ENV: str(uuid.uuid4()),
    }


def rank_env(rank: int, world: int, port: int, log_dir: Path, cuda: bool) -> dict[str, str]:
    """torchrun's environment for ``rank`` of a one-machine job (tests and benchmarks launch ranks so too)."""
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
        GROUP_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        MESHTRAIN_LOG_DIR=str(log_dir),
        MESHTRAIN_DEVICE="cuda" if cuda else "cpu",
    )
    if not cuda:  # share the cores instead of every rank spawning one thread per core
        env.setdefault("OMP_NUM_THREADS", str(max(1, host_model.host_cores() // world)))
    return env


def stop_processes(procs: list[subprocess.Popen[bytes]], grace: float = KILL_GRACE_S) -> None:
    """Terminate every live process, then kill what is left after ``grace`` seconds (the supervisor
    stops its workers so too)."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Terminated(Exception):
    """The launcher itself got SIGTERM."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise _Terminated


def _tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a rank's log, read from at most its last MAX_LOG_TAIL_BYTES."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, os.fstat(handle.fileno()).st_size - limits.MAX_LOG_TAIL_BYTES))
            text = handle.read(limits.MAX_LOG_TAIL_BYTES).decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


def _summary(
    job: api_spec.TrainingJobSpec,
    records: list[dict[str, Any]],
    seconds: float,
    log_dir: Path,
    identity: dict[str, str] | None = None,
) -> str:
    rows = [
        ("layout", job.parallelism.layout_string),
        ("schedule", job.parallelism.schedule),
        ("steps", str(len(records))),
        ("wall time", f"{seconds:.1f} s"),
    ]
    if records:
        steady = records[1:] or records
        tps = sum(r["tokens"] for r in steady) / max(1e-9, sum(r["step_seconds"] for r in steady))
        rows += [
            ("first loss", f"{records[0]['loss']:.4f}"),
            ("last loss", f"{records[-1]['loss']:.4f}"),
            ("tokens/s (after step 1)", f"{tps:,.0f}"),
            ("mean step time", f"{sum(r['step_seconds'] for r in steady) / len(steady):.3f} s"),
        ]
    rows.append(("step log", str(log_dir / steplog.FILENAME)))
    rows.append(("pictures", f"meshtrain report {log_dir} -o report.html"))
    rows += trackers.rows(job, _tracker_home(job, log_dir, identity or {}))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _tracker_home(job: api_spec.TrainingJobSpec, log_dir: Path, identity: dict[str, str]) -> Path:
    """The job's checkpoint directory as the ranks see it (the trackers' files), else the log dir."""
    directory = checkpoint_dir(job, log_dir)
    if not isinstance(directory, Path):
        return log_dir
    if not identity:
        return directory
    return Path(
        job_dir.job_dir(str(directory), identity[job_dir.NAMESPACE_ENV], identity[job_dir.NAME_ENV])
    )


def run_local(
    spec_path: str | Path,
    *,
    steps: int | None = None,
    log_dir: str | Path | None = None,
    overrides: list[str] | tuple[str, ...] = (),
) -> int:
    """Train ``spec_path`` with local processes; returns the exit code (0 success)."""
    extra = list(overrides) + ([f"training.steps={steps}"] if steps is not None else [])
    checked = _load_checked(spec_path, extra)
    if isinstance(checked, int):
        return checked
    metadata, job = checked
    name = metadata.get("name") or Path(spec_path).stem
    log_dir = Path(log_dir) if log_dir else default_log_dir(name)
    log_dir.mkdir(parents=True, exist_ok=True)
    steplog.keep_previous(log_dir)  # the previous attempt's steps, for meshtrain report
    started = time.monotonic()
    try:
        identity = job_identity(job, metadata, name, log_dir)
    except job_dir.OwnerError as err:
        print(
            f"metadata: {err}; set metadata.name (and namespace) to a Kubernetes name",
            file=sys.stderr,
        )
        return exitcodes.SPEC
    readiness.reset(log_dir / READY_DIR)
    procs, logs = _start_ranks(job, spec_path, extra, log_dir, identity)
    bar = _Watch(name, job, log_dir / READY_DIR)
    records: list[dict[str, Any]] = []
    # A terminated launcher (Ctrl-C, SIGTERM from CI or a pod) takes its ranks with it.
    previous = (
        signal.signal(signal.SIGTERM, _on_sigterm)
        if threading.current_thread() is threading.main_thread()
        else None
    )
    try:
        relay = trackers.Relay(log_dir / "rank-0.log")  # tracker warnings to this terminal
        code = _follow(
            procs, bar, steplog.Tail(log_dir / steplog.FILENAME), records, log_dir, relay
        )
        if code != 0:
            return code
    except (KeyboardInterrupt, _Terminated):
        bar.close("interrupted")
        print(
            f"interrupted: asking the ranks to save their last step (up to {STOP_GRACE_S:.0f}s; "
            f"the same command with --log-dir {log_dir} resumes)",
            file=sys.stderr,
        )
        stop_processes(procs, grace=STOP_GRACE_S)
        return exitcodes.INTERRUPTED
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        for handle in logs:
            handle.close()
    bar.close()
    print(
        f"meshtrain run {name}: done\n"
        f"{_summary(job, records, time.monotonic() - started, log_dir, identity)}"
    )
    return 0


def _load_checked(
    spec_path: str | Path, extra: list[str]
) -> tuple[dict[str, Any], api_spec.TrainingJobSpec] | int:
    """(metadata, spec with ``extra`` overrides) once spec and dataset are valid, else the exit code.

    A missing file fails here, before any process starts; the default corpus is built once here.
    """
    try:
        metadata, job = loading.load_manifest(spec_path)
        if extra:
            job = loading.apply_overrides(job, extra)
        storage.configure(job.object_storage)  # the ranks inherit the endpoint and region
        job = from_hf.check_spec(job)  # config.json's values where the spec is silent
        dataset.check_dataset(
            job.training, vocab=job.model.shape().vocab, from_hf=job.model.init.from_hf
        )
        if job.training.dataset == dataset.STDLIB:
            dataset.stdlib_corpus()
    except (loading.SpecError, config_json.HFError) as err:
        print(err, file=sys.stderr)
        return exitcodes.SPEC
    except dataset.DatasetError as err:
        print(err, file=sys.stderr)
        return exitcodes.DATA
    return metadata, job


def _start_ranks(
    job: api_spec.TrainingJobSpec,
    spec_path: str | Path,
    extra: list[str],
    log_dir: Path,
    identity: dict[str, str],
) -> tuple[list[subprocess.Popen[bytes]], list[IO[str]]]:
    """One ``python -m meshtrain.trainer`` per rank, each logging to ``rank-<r>.log``; (processes, logs)."""
    world = job.world_size
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "meshtrain.trainer",
        "--spec",
        str(spec_path),
        "--log-dir",
        str(log_dir),
    ]
    command += [arg for item in extra for arg in ("--set", item)]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[IO[str]] = []
    for rank in range(world):
        logs.append((log_dir / f"rank-{rank}.log").open("w"))
        env = rank_env(rank, world, port, log_dir, cuda)
        env.setdefault("MESHTRAIN_CHECKPOINT_DIR", str(checkpoint_dir(job, log_dir)))
        for key in (job_dir.NAMESPACE_ENV, job_dir.NAME_ENV, job_dir.UID_ENV):
            env.pop(key, None)  # this run's identity, never one inherited from a pod's environment
        env.update(identity)
        env[readiness.ENV] = str(log_dir / READY_DIR)
        procs.append(subprocess.Popen(command, env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
    return procs, logs


class _Watch:
    """What a user sees while a local run goes: ``3 of 8 ranks ready``, then the steps with loss
    and tokens/s (:class:`meshtrain.api.console.Phase`: bars on a terminal, else a line each)."""

    def __init__(self, name: str, job: api_spec.TrainingJobSpec, ready_dir: Path) -> None:
        self.world, self.ready_dir = job.world_size, ready_dir
        self.steps_desc, self.total = f"{name} {job.parallelism.layout_string}", job.training.steps
        self.phase = console.Phase(name, total=self.world, unit="ranks ready")
        self.stepping = False

    def poll(self, fresh: list[dict[str, Any]]) -> None:
        """The ready files while ranks start; the step log's new records once they train."""
        if not self.stepping:
            self.phase.to(readiness.count(self.ready_dir, self.world))
            if not fresh and self.phase.n < self.world:
                return
            self.phase.close()
            self.phase = console.Phase(self.steps_desc, total=self.total, unit="steps")
            self.stepping = True
        if fresh:
            last = fresh[-1]
            self.phase.to(last["step"])  # by step number: a resumed run starts past 0
            self.phase.status(f"loss {last['loss']:.4f}, {last['tokens_per_second']:,.0f} tokens/s")

    def close(self, outcome: str = "") -> None:
        """End what is shown (``outcome``: why, when the run did not finish)."""
        self.phase.close(outcome)


def _follow(
    procs: list[subprocess.Popen[bytes]],
    bar: _Watch,
    tail: steplog.Tail,
    records: list[dict[str, Any]],
    log_dir: Path,
    relay: trackers.Relay | None = None,
) -> int:
    """Drive the progress from the ranks' ready files and rank 0's step log (appending to ``records``) until every rank
    exited 0 (returns 0) or one failed: the others are stopped, and its code returned."""
    while True:
        codes = [p.poll() for p in procs]
        fresh = tail.new_records()
        records += fresh
        if relay is not None:
            relay.poll()
        bar.poll(fresh)
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            stop_processes(procs)
            bar.close(f"rank {rank} exited with code {code}")
            print(
                f"rank {rank} exited with code {code}; stopped the other ranks. "
                f"End of {log_dir / f'rank-{rank}.log'}:\n{_tail(log_dir / f'rank-{rank}.log')}",
                file=sys.stderr,
            )
            return code
        if all(c == 0 for c in codes):
            return 0
        time.sleep(POLL_S)
