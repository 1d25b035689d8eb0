"""The owner records of a job's checkpoint directory: claim, heartbeat, fencing, release.

Rank 0 claims the directory at start (:func:`claim`; the policy is :func:`meshtrain.api.job_dir.decide`)
by creating the next generation's record exclusively, so of two claimants on one record exactly one
wins.  It refreshes only its own record from a thread every heartbeat, and loses the directory the
moment a higher generation exists: :meth:`Heartbeat.check` fences each publish and deletion, and the
trainer stops at its next step (docs/checkpoints.md, "Who may write").  Liveness is judged by change
seen on the claimant's own monotonic clock, and a dead process only where its pid means something.
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
from typing import Literal

from meshtrain.api import job_dir
from meshtrain.trainer import storage
from meshtrain.trainer.checkpointing import store

RECORDS_LIMIT = 1000
"""Most owner records (and their temporary files) a directory may hold; more is refused."""
CLAIM_TRIES = 5
"""Claims lost to a concurrent claimant before giving up."""


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


def _names(directory: store.Location) -> list[str]:
    """The entries of the records' folder (at most :data:`RECORDS_LIMIT`)."""
    records = directory / job_dir.OWNER_DIR
    try:
        if isinstance(records, storage.ObjectPath):
            names = list(storage.listing(records.url))
        else:
            with os.scandir(records) as entries:
                names = [entry.name for _, entry in zip(range(RECORDS_LIMIT + 1), entries)]
    except FileNotFoundError:
        return []
    except OSError as err:
        raise store.CheckpointError(f"{records}: cannot list the owner records ({err})") from None
    if len(names) > RECORDS_LIMIT:
        raise store.CheckpointError(
            f"{records}: more than {RECORDS_LIMIT} entries; not written by meshtrain, remove them"
        )
    return names


def _generations(directory: store.Location) -> list[int]:
    """The generations of the records there are, ascending."""
    found = (job_dir.GENERATION.match(name) for name in _names(directory))
    return sorted(int(match.group(1)) for match in found if match)


def newest(directory: store.Location) -> tuple[int, job_dir.Owner | None]:
    """The highest generation and its record ((0, None): none yet)."""
    for _ in range(CLAIM_TRIES):
        generations = _generations(directory)
        if not generations:
            return 0, None
        record = _read(directory / job_dir.record_name(generations[-1]))
        if record is not None:
            return generations[-1], record
        # pruned between the listing and the read (a newer one exists): list again
    raise store.CheckpointError(f"{directory / job_dir.OWNER_DIR}: keeps changing while read")


def _sync_write(path: Path, text: bytes, flags: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o666)
    with os.fdopen(fd, "wb") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())


def _write(path: store.Location, owner: job_dir.Owner, *, exclusive: bool = False) -> bool:
    """Write the record atomically; with ``exclusive`` only if none exists (False: one appeared).

    In a bucket one PUT is atomic, and an exclusive one is conditional (``If-None-Match: *``).
    A local rewrite goes through a temporary file named after the writer (:func:`job_dir.writer_tag`).
    """
    text = job_dir.render(owner).encode()
    if isinstance(path, storage.ObjectPath):
        try:
            return storage.write_bytes(path.url, text, exclusive=exclusive)
        except OSError as err:
            raise store.CheckpointError(f"{path}: cannot write the owner record ({err})") from None
    path.parent.mkdir(parents=True, exist_ok=True)
    if exclusive:
        try:
            _sync_write(path, text, os.O_EXCL)
        except FileExistsError:
            return False
        return True
    tag = job_dir.writer_tag(owner.writer)
    tmp = path.parent / store.tmp_name(tag, "owner")
    try:
        _sync_write(tmp, text, os.O_TRUNC)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _tidy(directory: store.Location, generation: int, stale_seconds: float) -> None:
    """The owner of ``generation`` removes older records and stale temporary files of the records' folder."""
    older = [g for g in _generations(directory) if g < generation]
    records = directory / job_dir.OWNER_DIR
    if isinstance(records, storage.ObjectPath):
        storage.remove([(records / f"{g:08d}.json").url for g in older])
        return
    for g in older:
        (records / f"{g:08d}.json").unlink(missing_ok=True)
    for name in _names(directory):
        if name.startswith(store.TMP_PREFIX) and store.stale(records / name, stale_seconds):
            (records / name).unlink(missing_ok=True)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text()[:64].strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _start_time(pid: int | str) -> int | None:
    """Field 22 of ``/proc/<pid>/stat`` (None: no such process)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()[:4096]
    except OSError:
        return None
    fields = text.rpartition(")")[2].split()  # the command name may hold spaces and parentheses
    return int(fields[19]) if len(fields) > 19 and fields[19].isdigit() else None


def _gone(owner: job_dir.Owner) -> bool:
    """Whether the record's writer is known dead: same boot and pid namespace, and its process is no more.

    Elsewhere (another node, container or boot) a pid says nothing, and only the heartbeat counts.
    """
    if not owner.boot_id or owner.pid <= 0 or owner.start_time <= 0:
        return False
    if owner.boot_id != _boot_id() or owner.pid_ns != _pid_ns():
        return False
    return _start_time(owner.pid) != owner.start_time


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
        boot_id=_boot_id(),
        pid_ns=_pid_ns(),
        start_time=_start_time("self") or 0,
    )


def _watch(
    directory: store.Location, generation: int, seen: job_dir.Owner, beat: float
) -> Literal["live", "gone", "moved"]:
    """Watch a foreign record on this process's monotonic clock.

    ``gone``: released, or unchanged for :data:`~job_dir.WATCH_BEATS` beats; ``live``: still changing
    after :data:`~job_dir.PATIENCE_BEATS`; ``moved``: another claim came first (judge again).
    """
    start = changed = time.monotonic()
    while True:
        time.sleep(beat / 4)
        current_generation, current = newest(directory)
        if current_generation != generation:
            return "moved"
        if current is None or current.released:
            return "gone"
        now = time.monotonic()
        if current != seen:
            seen, changed = current, now
        if now - changed >= job_dir.WATCH_BEATS * beat:
            return "gone"
        if now - start >= job_dir.PATIENCE_BEATS * beat:
            return "live"


def claim(
    directory: store.Location, mine: job_dir.Owner, beat: float = job_dir.HEARTBEAT_SECONDS
) -> tuple[job_dir.Verdict, int]:
    """Take ``directory`` for ``mine`` (creating it): the verdict and the generation now owned.

    Raises CheckpointError saying who holds it.  The next generation's record is created only if
    absent, so a concurrent claim makes this one judge the directory again.
    """
    if isinstance(directory, Path):
        directory.mkdir(parents=True, exist_ok=True)
    for _ in range(CLAIM_TRIES):
        generation, current = newest(directory)
        live = False
        if current is not None and job_dir.must_watch(current, mine) and not _gone(current):
            seen = _watch(directory, generation, current, beat)
            if seen == "moved":
                continue
            live = seen == "live"
        verdict = job_dir.decide(current, mine, live=live)
        if verdict.action == "refuse":
            raise store.CheckpointError(f"{directory}: {verdict.message}")
        if generation >= job_dir.MAX_GENERATION:
            raise store.CheckpointError(f"{directory / job_dir.OWNER_DIR}: generations exhausted")
        if _write(directory / job_dir.record_name(generation + 1), mine, exclusive=True):
            _tidy(directory, generation + 1, job_dir.PATIENCE_BEATS * beat)
            return verdict, generation + 1
    raise store.CheckpointError(
        f"{directory / job_dir.OWNER_DIR}: keeps changing under this writer; another job writes here"
    )


class Heartbeat:
    """Rank 0's hold on the directory: a thread refreshing its own record, and the fence of each write."""

    def __init__(
        self,
        directory: store.Location,
        mine: job_dir.Owner,
        generation: int,
        beat: float = job_dir.HEARTBEAT_SECONDS,
    ) -> None:
        self.directory = directory
        self.mine = mine
        self.generation = generation
        self.interval = beat
        self.tag = job_dir.writer_tag(mine.writer)
        """Names this writer's temporary files and directories."""
        self._lost: str | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-owner", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> str | None:
        """Why this writer no longer owns the directory (None: it does, as far as the last look saw)."""
        return self._lost

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.beat()
            except (OSError, store.CheckpointError):
                if self._lost is not None:
                    return  # taken over: the trainer stops at its next step
                # a failed read or write of the record (a volume hiccup): try again at the next beat

    def _judge(self) -> None:
        """Set the lost flag when a newer generation exists or this one's record names another writer."""
        generation, current = newest(self.directory)
        if generation != self.generation or current is None or current.writer != self.mine.writer:
            holder = "nobody" if current is None else f"{current.writer} on {current.host}"
            self._lost = (
                f"{self.directory}: this writer ({self.mine.writer}) no longer owns the directory "
                f"(the newest owner record, generation {generation}, names {holder}); stopping "
                f"instead of writing beside it"
            )

    def _hold(self) -> None:
        """Raise CheckpointError unless this writer still owns the directory (the caller holds the lock)."""
        if self._lost is None:
            self._judge()
        if self._lost is not None:
            raise store.CheckpointError(self._lost)

    def check(self) -> None:
        """The fence: raise CheckpointError unless this writer still owns the directory (read, no write)."""
        with self._lock:
            self._hold()

    def beat(self) -> None:
        """Refresh this writer's own record; raise CheckpointError when a newer claim exists."""
        with self._lock:
            self._hold()
            path = self.directory / job_dir.record_name(self.generation)
            _write(path, dataclasses.replace(self.mine, heartbeat=time.time()))
            _tidy(self.directory, self.generation, job_dir.PATIENCE_BEATS * self.interval)

    def release(self) -> None:
        """Stop the thread and mark the record released (a clean exit: the next job need not wait)."""
        self._stop.set()
        with self._lock:
            try:
                if self._lost is None:
                    self._judge()
                if self._lost is None:
                    path = self.directory / job_dir.record_name(self.generation)
                    _write(
                        path, dataclasses.replace(self.mine, heartbeat=time.time(), released=True)
                    )
            except (OSError, store.CheckpointError):
                pass  # best effort: a claimant sees the record stop changing anyway


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
    # a namespace may be named like step-NNNNNNNN: only a directory with a marker is a checkpoint
    steps = sorted(
        name
        for name in entries
        if store.STEP_DIR.match(name) and (Path(root) / name / store.MARKER).is_file()
    )
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
        beat = job_dir.heartbeat_seconds(env)
    except job_dir.OwnerError as err:
        raise store.CheckpointError(str(err)) from None
    if identity is None:
        return Holding(directory=root, heartbeat=None)
    directory = store.location(job_dir.job_dir(str(root), identity.namespace, identity.name))
    mine = me(identity)
    verdict, generation = claim(directory, mine, beat)
    notes = [verdict.message] if verdict.previous_uid is not None else []
    legacy = legacy_note(root, directory)
    if legacy is not None:
        notes.append(legacy)
    return Holding(
        directory, Heartbeat(directory, mine, generation, beat), tuple(notes), identity.uid
    )
