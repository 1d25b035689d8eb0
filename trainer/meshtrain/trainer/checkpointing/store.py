"""The checkpoint directory on disk: naming, atomic publish, the COMPLETE marker, discovery, pruning.

Plain file-system logic, no process groups and no tensors.  A save is written into a ``.tmp-``
directory, which is renamed to ``step-NNNNNNNN`` once its ``COMPLETE`` marker is fsynced; rename
is atomic on POSIX, so a ``step-`` directory without a valid marker is not an interrupted save but
damage, and is reported as such (docs/checkpoints.md, "Writing a checkpoint").

An ``s3://`` checkpoint path has no rename: there every object is written under its final
``step-`` prefix and the marker LAST, a prefix without a marker is a save in progress (not damage),
and pruning deletes the marker first (the ``_bucket_`` functions below; docs/checkpoints.md,
"Checkpoints in a bucket").  Each public function takes a :data:`Location` of either kind.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir
from meshtrain.trainer import storage

FORMAT = "meshtrain-checkpoint/1"
"""Value of the marker's ``format`` field; anything else is a foreign checkpoint."""
MARKER = "COMPLETE"
"""Name of the completion marker inside a published checkpoint."""
STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"
GUARD_SKIPS = "loss_guard_consecutive_skips"
"""Marker ``extra`` key: updates the loss guard had skipped in a row when the checkpoint was taken (0: good)."""
IGNORED = {"lost+found", job_dir.LOG_SUBDIR, job_dir.OWNER_FILE, job_dir.OWNER_DIR}
"""Entries a checkpoint directory may carry that are not checkpoints and not a problem: ``lost+found``
of a fresh filesystem, ``logs``, where the operator's pods keep steps.jsonl and the rank traces
(``MESHTRAIN_LOG_DIR=<checkpoint.path>/<namespace>/<name>/logs``), and the job's owner records."""
JOB_UID_KEY = "job_uid"
"""Marker ``extra`` key: the UID of the job that wrote the checkpoint (empty for a bare trainer)."""
Fence = Callable[[], None]
"""Raises CheckpointError unless this writer still owns the directory (:meth:`.owner.Heartbeat.check`)."""


HASH_CHUNK = 8 * 1024 * 1024
"""Bytes per ranged read while hashing an object of a bucket (bounded memory whatever its size)."""

Location = Path | storage.ObjectPath
"""A checkpoint directory on a file system, or a prefix of a bucket."""


def location(path: str | Path) -> Location:
    """``path`` as a :data:`Location`: an ``s3://`` URL is a prefix of a bucket, anything else a path."""
    return storage.ObjectPath(str(path).rstrip("/")) if storage.is_url(path) else Path(path)


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be used; the message names the file and what is wrong."""


@dataclasses.dataclass(frozen=True)
class Marker:
    """Contents of the COMPLETE file of one checkpoint."""

    step: int
    """Optimizer steps completed when the checkpoint was taken."""
    layout: dict[str, int]
    """Parallel layout that wrote it: data, pipeline, tensor, zero_stage (informational: any layout can load)."""
    model: dict[str, int]
    """Model shape (layers, hidden, heads, vocab, seq_len, ffn_hidden); loading refuses another shape."""
    files: dict[str, dict[str, Any]]
    """Every other file of the checkpoint: relative path -> {bytes, sha256}."""
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form facts (tensor count, save seconds)."""
    format: str = FORMAT
    """Checkpoint format version."""

    def to_json(self) -> str:
        """The marker as indented JSON."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)


@dataclasses.dataclass(frozen=True)
class Published:
    """A published checkpoint found on disk."""

    step: int
    path: Location


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


def tmp_name(tag: str, what: str) -> str:
    """A temporary entry of the writer ``tag`` (:func:`job_dir.writer_tag`): ``.tmp-<what>-<tag>-<random>``."""
    return f"{TMP_PREFIX}{what}-{tag}-{uuid.uuid4().hex[:8]}"


def tmp_of(name: str, tag: str) -> bool:
    """Whether ``name`` is a temporary entry of the writer ``tag`` (:func:`tmp_name`)."""
    return (
        name.startswith(TMP_PREFIX)
        and re.search(rf"-{re.escape(tag)}-[0-9a-f]{{8}}$", name) is not None
    )


def new_tmp_dir(root: Location, step: int, tag: str = "x") -> Location:
    """A fresh in-progress directory name for a save of ``step`` by the writer ``tag`` (not created).

    In a bucket: the final ``step-`` prefix, cleared of what an interrupted save of it left.
    """
    if isinstance(root, storage.ObjectPath):
        final = root / step_dir_name(step)
        _bucket_clear(final)
        return final
    return root / tmp_name(tag, step_dir_name(step))


def stale(path: Path, seconds: float, limit: int = 1000) -> bool:
    """Whether ``path`` and its direct entries (at most ``limit``) were all last modified ``seconds`` ago.

    Only the file system's own times are compared (a save in progress keeps touching them).
    """
    try:
        newest = path.lstat().st_mtime
        if path.is_dir() and not path.is_symlink():
            with os.scandir(path) as entries:
                for _, entry in zip(range(limit), entries):
                    newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
        probe = path.parent / tmp_name("clock", "probe")
        probe.touch()
        try:
            now = probe.lstat().st_mtime
        finally:
            probe.unlink(missing_ok=True)
    except OSError:
        return False
    return now - newest >= seconds


def file_digest(path: Path) -> dict[str, Any]:
    """Size and sha256 of one file."""
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": digest.hexdigest()}


def data_files(directory: Path) -> list[str]:
    """Every file under ``directory`` except the marker, as sorted relative POSIX paths."""
    return sorted(
        p.relative_to(directory).as_posix()
        for p in directory.rglob("*")
        if p.is_file() and p.name != MARKER
    )


def describe_files(
    directory: Location, *, part: int = 0, parts: int = 1
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the data files of ``directory``; with ``parts`` > 1 only every parts-th from ``part``.

    The ranks of a job split the hashing this way (each takes its share, rank 0 merges).
    """
    if isinstance(directory, storage.ObjectPath):
        return _bucket_describe_files(directory, part=part, parts=parts)
    return {
        name: file_digest(directory / name)
        for i, name in enumerate(data_files(directory))
        if i % parts == part
    }


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Location, marker: Marker, fence: Fence | None = None) -> Location:
    """Write the marker into ``tmp`` and rename it to its final name; returns the published path.

    Called by one process after every rank's files are in ``tmp``.  Refuses
    to overwrite an existing checkpoint of the same step.  In a bucket: the marker, last.
    ``fence`` runs right before the rename (the marker's write in a bucket): a writer that was
    taken over publishes nothing.
    """
    if isinstance(tmp, storage.ObjectPath):
        if fence is not None:
            fence()
        return _bucket_publish(tmp, marker)
    for path in tmp.rglob("*"):
        if path.is_file():
            _fsync_path(path)
    marker_path = tmp / MARKER
    with marker_path.open("w") as handle:
        handle.write(marker.to_json())
        handle.flush()
        os.fsync(handle.fileno())
    _fsync_path(tmp)
    final = tmp.parent / step_dir_name(marker.step)
    if final.exists():
        raise CheckpointError(
            f"{final} already exists; refusing to overwrite a published checkpoint"
        )
    if fence is not None:
        fence()
    os.rename(tmp, final)
    _fsync_path(tmp.parent)
    return final


def read_marker(directory: Location) -> Marker:
    """Parse and check a checkpoint's COMPLETE file; raises :class:`CheckpointError` naming it."""
    path = directory / MARKER
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {directory} is named like a published checkpoint but has no "
            f"completion marker (damaged or not written by meshtrain); remove it to continue"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"{path}: not a valid completion marker ({err})") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(
            f"{path}: format {got!r} is not {FORMAT!r}; this is not a meshtrain checkpoint"
        )
    try:
        marker = Marker(**raw)
    except TypeError as err:
        raise CheckpointError(f"{path}: unexpected marker fields ({err})") from None
    expected = STEP_DIR.match(directory.name)
    if expected and int(expected.group(1)) != marker.step:
        raise CheckpointError(
            f"{path}: says step {marker.step} but the directory is {directory.name}"
        )
    return marker


def verify(
    directory: Location, marker: Marker, *, hashes: bool, part: int = 0, parts: int = 1
) -> None:
    """Check that every file the marker lists is there with its size (and hash); raise naming the first bad file.

    With ``parts`` > 1 only every parts-th file from ``part`` is hashed (ranks split the reading).
    In a bucket the sizes come from one listing and the hashes from ranged reads.
    """
    sizes, digest = _sizes_and_digest(directory)
    for index, (name, facts) in enumerate(sorted(marker.files.items())):
        path = directory / name
        size = sizes(name)
        if size is None:
            raise CheckpointError(f"{path}: listed in {directory / MARKER} but missing")
        if size != facts["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the marker says {facts['bytes']} (truncated or overwritten)"
            )
        if hashes and index % parts == part:
            found = digest(name, size)
            if found != facts["sha256"]:
                raise CheckpointError(
                    f"{path}: sha256 {found[:16]}... differs from the marker's "
                    f"{facts['sha256'][:16]}... (corrupt)"
                )
    if not marker.files:
        raise CheckpointError(f"{directory / MARKER}: lists no data files")


def _sizes_and_digest(
    directory: Location,
) -> tuple[Callable[[str], int | None], Callable[[str, int], str]]:
    """(size of a file by name or None, its sha256) in ``directory``: a file system's, or a bucket's."""
    if isinstance(directory, storage.ObjectPath):
        objects = _bucket_objects(directory)
        return (
            lambda name: objects[name]["size"] if name in objects else None,
            lambda name, size: _bucket_digest(f"{directory.url}/{name}", size)["sha256"],
        )
    return (
        lambda name: (directory / name).stat().st_size if (directory / name).is_file() else None,
        lambda name, _: str(file_digest(directory / name)["sha256"]),
    )


def scan(root: Location) -> list[Published]:
    """Published checkpoints under ``root``, oldest first; raises on anything foreign or damaged.

    In-progress (``.tmp-``) directories are skipped: they are interrupted
    saves.  Any other entry is not something meshtrain writes, and a
    checkpoint directory holding it is refused rather than trained into.
    """
    if isinstance(root, storage.ObjectPath):
        return _bucket_scan(root)
    if not root.exists():
        return []
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint path exists but is not a directory")
    found = []
    for entry in sorted(root.iterdir()):
        if entry.name.startswith(TMP_PREFIX) or entry.name in IGNORED:
            continue
        match = STEP_DIR.match(entry.name)
        if not match or not entry.is_dir():
            raise CheckpointError(
                f"{entry}: not a meshtrain checkpoint (expected only step-NNNNNNNN directories "
                f"in {root}, a job's own directory <checkpoint.path>/<namespace>/<name>); move it elsewhere"
            )
        found.append(Published(step=int(match.group(1)), path=entry))
    return sorted(found, key=lambda p: p.step)


def latest(root: Location, *, hashes: bool = True) -> tuple[Published, Marker] | None:
    """The newest published checkpoint, its marker read and its files verified; None when there is none.

    A damaged newest checkpoint raises: resuming from an older one, or from
    scratch, without being told would silently lose training.
    """
    published = scan(root)
    if not published:
        return None
    newest = published[-1]
    marker = read_marker(newest.path)
    verify(newest.path, marker, hashes=hashes)
    return newest, marker


def is_good(marker: Marker) -> bool:
    """Whether the checkpoint was taken after an applied update, not amid loss-guard skips (older markers: yes)."""
    return int(marker.extra.get(GUARD_SKIPS, 0)) == 0


def last_good(published: list[Published]) -> Published | None:
    """The newest checkpoint taken after an applied update (unreadable markers are passed over)."""
    for candidate in reversed(published):
        try:
            marker = read_marker(candidate.path)
        except CheckpointError:
            continue
        if is_good(marker):
            return candidate
    return None


def _foreign_uid(published: Published, uid: str) -> bool:
    """Whether the checkpoint's marker names another job UID than ``uid`` (an inherited checkpoint)."""
    try:
        marker = read_marker(published.path)
    except CheckpointError:
        return False
    writer = str(marker.extra.get(JOB_UID_KEY) or "")
    return bool(uid and writer and writer != uid)


def prune(
    root: Location,
    keep: int,
    *,
    tag: str = "x",
    fence: Fence | None = None,
    uid: str = "",
    stale_seconds: float = job_dir.STALE_SECONDS,
) -> list[Location]:
    """Delete all but the newest ``keep`` published checkpoints of ``uid`` and this writer's leftover ``.tmp-``.

    ``root`` is the job's own directory, which its owner records give to one writer at a time:
    nothing of another job is ever looked at (:mod:`meshtrain.api.job_dir`).  Only the writer
    ``tag``'s temporary directories go at once; another writer's only once :func:`stale` (a
    taken-over writer must not delete its successor's save in progress).  ``fence`` runs before
    each deletion.  Checkpoints whose marker names another job UID (inherited from the job of the
    same name before it was re-created) are neither counted nor deleted.

    The last good checkpoint (:func:`last_good`) is kept even when it is older
    than ``keep`` others: those may all have been taken while the loss guard
    skipped updates, and if it then stops the job, the last good one is the
    one to go back to.
    """
    check: Fence = fence or (lambda: None)
    check()
    if isinstance(root, storage.ObjectPath):
        return _bucket_prune(root, keep)
    removed: list[Location] = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        mine = tmp_of(entry.name, tag)
        if not entry.name.startswith(TMP_PREFIX) or not entry.is_dir():
            continue
        if mine or stale(entry, stale_seconds):
            check()
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    published = [p for p in scan(root) if not _foreign_uid(p, uid)]
    good = last_good(published)
    for old in published[: max(0, len(published) - keep)]:
        if old == good:
            continue
        # Rename first so a crash halfway through deleting leaves a .tmp- directory, not a damaged step-.
        doomed = root / tmp_name(tag, f"pruned-{old.path.name}")
        check()
        os.rename(root / old.path.name, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(old.path)
    return removed


# --- a bucket: the marker-last protocol (no rename on an object store) -------------------------


def _bucket_objects(directory: storage.ObjectPath) -> dict[str, dict[str, Any]]:
    return storage.listing(directory.url)


def _bucket_digest(url: str, size: int) -> dict[str, Any]:
    """Size and sha256 of one object, read in :data:`HASH_CHUNK` ranges."""
    hasher = hashlib.sha256()
    for start in range(0, size, HASH_CHUNK):
        (data,) = storage.read_ranges([(url, start, min(size, start + HASH_CHUNK))])
        hasher.update(data)
    return {"bytes": size, "sha256": hasher.hexdigest()}


def _bucket_clear(directory: storage.ObjectPath) -> None:
    """Delete what an interrupted save left under ``directory``; refuse when it is published."""
    objects = _bucket_objects(directory)
    if MARKER in objects:
        raise CheckpointError(
            f"{directory}: already published; refusing to overwrite a published checkpoint"
        )
    storage.remove([f"{directory.url}/{name}" for name in objects])


def _bucket_describe_files(
    directory: storage.ObjectPath, *, part: int = 0, parts: int = 1
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the data objects under ``directory`` (every parts-th from ``part``)."""
    objects = _bucket_objects(directory)
    names = sorted(name for name in objects if name != MARKER)
    return {
        name: _bucket_digest(f"{directory.url}/{name}", objects[name]["size"])
        for i, name in enumerate(names)
        if i % parts == part
    }


def _bucket_publish(directory: storage.ObjectPath, marker: Marker) -> storage.ObjectPath:
    """Write the marker LAST, once every object it lists is there with its size."""
    objects = _bucket_objects(directory)
    if MARKER in objects:
        raise CheckpointError(
            f"{directory}: already published; refusing to overwrite a published checkpoint"
        )
    for name, facts in marker.files.items():
        if objects.get(name, {}).get("size") != facts["bytes"]:
            raise CheckpointError(f"{directory.url}/{name}: not written whole; not publishing")
    storage.write_bytes(f"{directory.url}/{MARKER}", marker.to_json().encode())
    return directory


def _bucket_steps(root: storage.ObjectPath) -> tuple[dict[int, bool], dict[str, Any]]:
    """({step: has a marker}, every object of ``root``) in one listing; foreign objects refused."""
    objects = storage.listing(root.url)
    steps: dict[int, bool] = {}
    for name in objects:
        top, _, rest = name.partition("/")
        match = STEP_DIR.match(top)
        if match:
            step = int(match.group(1))
            steps[step] = steps.get(step, False) or rest == MARKER
        elif top not in IGNORED:
            raise CheckpointError(
                f"{root.url}/{name}: not a meshtrain checkpoint (expected only step-NNNNNNNN/ "
                f"prefixes in {root.url}); point spec.checkpoint.path at a prefix of its own"
            )
    return steps, objects


def _bucket_scan(root: storage.ObjectPath) -> list[Published]:
    """Published (marked) checkpoints under ``root``, oldest first; unmarked prefixes are saves in progress."""
    steps, _ = _bucket_steps(root)
    return [
        Published(step=step, path=root / step_dir_name(step))
        for step, marked in sorted(steps.items())
        if marked
    ]


def _bucket_prune(root: storage.ObjectPath, keep: int) -> list[Location]:
    """Delete unmarked prefixes and all but the newest ``keep`` checkpoints (the last good one kept).

    Each doomed checkpoint loses its marker first, then its objects.
    """
    steps, objects = _bucket_steps(root)
    published = [Published(s, root / step_dir_name(s)) for s, m in sorted(steps.items()) if m]
    good = last_good(published)
    doomed = [p for p in published[: max(0, len(published) - keep)] if p != good]
    removed: list[Location] = []
    for old in doomed:
        storage.remove([f"{root.url}/{step_dir_name(old.step)}/{MARKER}"])
    garbage = {step_dir_name(s) for s, marked in steps.items() if not marked}
    garbage |= {step_dir_name(p.step) for p in doomed}
    storage.remove([f"{root.url}/{name}" for name in objects if name.partition("/")[0] in garbage])
    removed += [root / name for name in sorted(garbage)]
    return removed
