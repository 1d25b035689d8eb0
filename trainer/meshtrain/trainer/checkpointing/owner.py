"""The owner record of a job's checkpoint directory on a file system: claim, heartbeat, release.

Rank 0 claims the directory at start (:func:`claim`, the policy is :func:`meshtrain.api.job_dir.decide`),
refreshes the heartbeat from a thread every :data:`~meshtrain.api.job_dir.HEARTBEAT_SECONDS` and at
each save, and gives it up on a clean exit.  A writer whose record was taken over stops at its next
save instead of writing beside the new owner.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import stat
import threading
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from meshtrain.api import job_dir
from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import store


def _read_local(path: Path) -> bytes | None:
    """At most RECORD_LIMIT + 1 bytes of the file (None: there is none)."""
    try:  # non-blocking and checked: a FIFO or a device put there must not hang or flood the reader
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as err:
        raise store.CheckpointError(f"{path}: cannot read the owner record ({err})") from None
    with os.fdopen(fd, "rb") as handle:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise store.CheckpointError(f"{path}: not a regular file; remove it")
        return handle.read(job_dir.RECORD_LIMIT + 1)


def _read(path: store.Location) -> job_dir.Owner | None:
    """The record at ``path`` (None: there is none); raises CheckpointError on a bad one."""
    data: bytes | None
    if isinstance(path, storage.ObjectPath):
        try:
            data = storage.read_small(path.url, job_dir.RECORD_LIMIT)
        except FileNotFoundError:
            return None
        except OSError as err:
            raise store.CheckpointError(f"{path}: cannot read the owner record ({err})") from None
    else:
        data = _read_local(path)
    if data is None:
        return None
    try:
        return job_dir.parse(data.decode("utf-8", errors="replace"), str(path))
    except job_dir.OwnerError as err:
        raise store.CheckpointError(str(err)) from None


def _write(path: store.Location, owner: job_dir.Owner, *, exclusive: bool = False) -> bool:
    """Write the record atomically; with ``exclusive`` only if none exists (False: one appeared).

    In a bucket one PUT is atomic, and an exclusive one is conditional (``If-None-Match: *``).
    """
    text = job_dir.render(owner).encode()
    if isinstance(path, storage.ObjectPath):
        try:
            return storage.write_bytes(path.url, text, exclusive=exclusive)
        except OSError as err:
            raise store.CheckpointError(f"{path}: cannot write the owner record ({err})") from None
    if exclusive:
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        with os.fdopen(fd, "wb") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        return True
    tmp = path.parent / f"{store.TMP_PREFIX}owner-{uuid.uuid4().hex[:8]}"
    with tmp.open("wb") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    return True


def _gone(owner: job_dir.Owner) -> bool:
    """Whether the record's writer is known dead: it ran on this host and its process is no more."""
    if owner.host != socket.gethostname() or owner.pid <= 0:
        return False
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def me(identity: job_dir.JobIdentity) -> job_dir.Owner:
    """This process's record: a fresh writer id for this attempt, the heartbeat now."""
    attempt = os.environ.get(job_dir.ATTEMPT_ENV, "0")
    return job_dir.Owner(
        namespace=identity.namespace,
        name=identity.name,
        uid=identity.uid,
        writer=f"{identity.uid or '-'}/{attempt}/{uuid.uuid4().hex[:8]}",
        host=socket.gethostname(),
        pid=os.getpid(),
        heartbeat=time.time(),
    )


def claim(directory: store.Location, mine: job_dir.Owner) -> job_dir.Verdict:
    """Take ``directory`` for ``mine`` (creating it) or raise CheckpointError saying who holds it."""
    if isinstance(directory, Path):
        directory.mkdir(parents=True, exist_ok=True)
    path = directory / job_dir.OWNER_FILE
    for _ in range(3):  # a record created between the read and the exclusive create is judged again
        current = _read(path)
        gone = current is not None and _gone(current)
        verdict = job_dir.decide(current, mine, time.time(), holder_gone=gone)
        if verdict.action == "refuse":
            raise store.CheckpointError(f"{directory}: {verdict.message}")
        if _write(path, mine, exclusive=current is None):
            return verdict
    raise store.CheckpointError(
        f"{path}: keeps changing under this writer; another job writes here"
    )


class Heartbeat:
    """Rank 0's hold on the directory: a thread refreshing the record, and the check before each save."""

    def __init__(self, directory: store.Location, mine: job_dir.Owner) -> None:
        self.path = directory / job_dir.OWNER_FILE
        self.mine = mine
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-owner", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(job_dir.HEARTBEAT_SECONDS):
            try:
                self.beat()
            except (OSError, store.CheckpointError):
                if self._lost is not None:
                    return  # taken over: beat() raises it again at the next save
                # a failed read or write of the record (a volume hiccup): try again at the next beat

    def beat(self) -> None:
        """Refresh the heartbeat; raise CheckpointError when another writer holds the record now."""
        with self._lock:
            if self._lost is None:
                current = _read(self.path)
                if current is None or current.writer != self.mine.writer:
                    holder = "nobody" if current is None else f"{current.writer} on {current.host}"
                    self._lost = (
                        f"{self.path}: this writer ({self.mine.writer}) no longer owns the directory "
                        f"(the record names {holder}); stopping instead of writing beside it"
                    )
                else:
                    _write(self.path, dataclasses.replace(current, heartbeat=time.time()))
            if self._lost is not None:
                raise store.CheckpointError(self._lost)

    def release(self) -> None:
        """Stop the thread and mark the record released (a clean exit: the next job need not wait)."""
        self._stop.set()
        with self._lock:
            try:
                current = _read(self.path) if self._lost is None else None
                if current is not None and current.writer == self.mine.writer:
                    _write(self.path, dataclasses.replace(current, released=True))
            except (OSError, store.CheckpointError):
                pass  # best effort: the record goes stale STALE_SECONDS after the last beat anyway


LEGACY_SCAN_LIMIT = 10_000
"""Most entries of ``checkpoint.path`` looked at for checkpoints of the flat layout of older releases."""


def legacy_note(root: store.Location, directory: store.Location) -> str | None:
    """A warning when ``root`` holds ``step-*`` written straight into it by an older meshtrain.

    They are not resumed (which job wrote them is unknown) and nothing deletes them; the note says
    how to hand them to this job.
    """
    if isinstance(root, storage.ObjectPath):
        return None  # no release wrote checkpoints into a bucket before job directories
    try:
        entries = [entry.name for _, entry in zip(range(LEGACY_SCAN_LIMIT), os.scandir(root))]
    except OSError:
        return None
    steps = sorted(name for name in entries if store.STEP_DIR.match(name))
    if not steps:
        return None
    return (
        f"{root} holds {len(steps)} checkpoint(s) of the flat layout of older meshtrain releases "
        f"({steps[0]} .. {steps[-1]}); they are not resumed, and nothing deletes them. To resume them as "
        f"this job, stop it and run: mkdir -p {directory} && mv {root}/step-* {directory}/"
    )


@dataclasses.dataclass(frozen=True)
class Holding:
    """The directory a trainer writes in, and its hold on it."""

    directory: store.Location
    """The job's own directory (``<checkpoint.path>/<namespace>/<name>``), or the path as given."""
    heartbeat: Heartbeat | None
    """Rank 0's refreshing hold (None: no job identity, the directory is used as given)."""
    notes: tuple[str, ...] = ()
    """What to log: whose checkpoints are resumed, the flat-layout warning."""
    uid: str = ""
    """This job's UID (recorded in each checkpoint's marker)."""


def take(root: store.Location, env: Mapping[str, str]) -> Holding:
    """Claim the directory of the job ``env`` names under ``root`` (rank 0); with none, ``root`` itself, unguarded."""
    try:
        identity = job_dir.identity_from_env(env)
    except job_dir.OwnerError as err:
        raise store.CheckpointError(str(err)) from None
    if identity is None:
        return Holding(directory=root, heartbeat=None)
    directory = store.location(job_dir.job_dir(str(root), identity.namespace, identity.name))
    mine = me(identity)
    verdict = claim(directory, mine)
    notes = [verdict.message] if verdict.previous_uid is not None else []
    legacy = legacy_note(root, directory)
    if legacy is not None:
        notes.append(legacy)
    return Holding(directory, Heartbeat(directory, mine), tuple(notes), identity.uid)
