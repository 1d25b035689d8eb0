"""The checkpoint directory on disk: naming, atomic publish, the COMPLETE marker, discovery, pruning.

Plain file-system logic, no process groups and no tensors.  A save is written into a ``.tmp-``
directory, which is renamed to ``step-NNNNNNNN`` once its ``COMPLETE`` marker is fsynced; rename
is atomic on POSIX, so a ``step-`` directory without a valid marker is not an interrupted save but
damage, and is reported as such (docs/checkpoints.md, "Writing a checkpoint").

An ``s3://`` checkpoint path has no rename: there each save writes under a prefix of its own,
``step-NNNNNNNN/a-<random>/`` (an attempt), and publishes by a conditional PUT (``If-None-Match``)
of the step's one marker ``step-NNNNNNNN/COMPLETE``, which names the attempt and each object's
size and ETag: of two writers of one step only one can publish, and readers load only the attempt
the marker names.  An attempt without a marker is a save in progress (not damage); pruning deletes
the marker first and another attempt's objects only once stale (the ``_bucket_`` functions below;
docs/checkpoints.md, "Checkpoints in a bucket").  Each public function takes a :data:`Location`
of either kind.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir, limits
from meshtrain.trainer import small_files, storage

FORMAT = "meshtrain-checkpoint/1"
"""Value of the marker's ``format`` field; anything else is a foreign checkpoint."""
MARKER = "COMPLETE"
"""Name of the completion marker inside a published checkpoint."""
STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"
GUARD_SKIPS = "loss_guard_consecutive_skips"
"""Marker ``extra`` key: updates the loss guard had skipped in a row when the checkpoint was taken (0: good)."""
IGNORED = {
    "lost+found",
    job_dir.LOG_SUBDIR,
    job_dir.OWNER_FILE,
    job_dir.OWNER_DIR,
    job_dir.TENSORBOARD_SUBDIR,
    job_dir.TRACKING_SUBDIR,
}
"""Entries a checkpoint directory may carry that are not checkpoints and not a problem: ``lost+found``
of a fresh filesystem, ``tensorboard`` and ``tracking`` of the experiment trackers, ``logs``, where the operator's pods keep steps.jsonl and the rank traces
(``MESHTRAIN_LOG_DIR=<checkpoint.path>/<namespace>/<name>/logs``), and the job's owner records."""
JOB_UID_KEY = "job_uid"
"""Marker ``extra`` key: the UID of the job that wrote the checkpoint (empty for a bare trainer)."""
Fence = Callable[[], None]
"""Raises CheckpointError unless this writer still owns the directory (:meth:`.owner.Heartbeat.check`)."""


HASH_CHUNK = 8 * 1024 * 1024
"""Bytes per ranged read while hashing an object of a bucket (bounded memory whatever its size)."""
HASH_BATCH = 8
"""Ranged reads of one object in flight at once while hashing it (``HASH_BATCH * HASH_CHUNK`` bytes held)."""
DCP_METADATA = ".metadata"
"""DCP's metadata object, which a bucket checkpoint must hold to be published."""
ATTEMPT_KEY = "attempt"
"""Marker ``extra`` key of a bucket checkpoint: the attempt prefix (``a-<hex>``) the marker approves."""
ATTEMPT = re.compile(r"^a-[0-9a-f]{16}$")
STALE_SECONDS = 6 * 3600
"""Age after which an unpublished attempt in a bucket is an abandoned save that pruning may delete."""
REHASH_ENV = "MESHTRAIN_CHECKPOINT_REHASH"
"""Set to 1: a resume from a bucket re-reads every object to check its sha256 (default: sizes and ETags)."""

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

    In a bucket: a new attempt prefix ``step-NNNNNNNN/a-<random>`` (nothing is deleted).
    """
    if isinstance(root, storage.ObjectPath):
        return _bucket_new_attempt(root, step)
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


def listed_names(directory: Location) -> list[str]:
    """The data files of ``directory`` by one listing (rank 0's, which every rank then hashes from)."""
    if isinstance(directory, storage.ObjectPath):
        return sorted(data_listing(directory))
    return data_files(directory)


def describe_files(
    directory: Location, *, part: int = 0, parts: int = 1, names: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the data files of ``directory``; with ``parts`` > 1 only every parts-th from ``part``.

    The ranks of a job split the hashing this way (each takes its share, rank 0 merges). ``names``:
    the files one listing found (rank 0's, broadcast), instead of each rank's own listing.
    """
    if isinstance(directory, storage.ObjectPath):
        return _bucket_describe_files(directory, part=part, parts=parts, names=names)
    return {
        name: file_digest(directory / name)
        for i, name in enumerate(sorted(names) if names is not None else data_files(directory))
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
    path = (
        _bucket_marker(directory)
        if isinstance(directory, storage.ObjectPath)
        else directory / MARKER
    )
    if not path.is_file():
        raise CheckpointError(
            f"{path}: missing; {directory} is named like a published checkpoint but has no "
            f"completion marker (damaged or not written by meshtrain); remove it to continue"
        )
    try:
        raw = small_files.read_json(
            path,
            limits.MAX_CHECKPOINT_MARKER_BYTES,
            "checkpoint's COMPLETE marker",
            CheckpointError,
        )
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
    if isinstance(directory, storage.ObjectPath):
        _bucket_check_attempt(directory, path, marker)
    return marker


def verify(
    directory: Location, marker: Marker, *, hashes: bool, part: int = 0, parts: int = 1
) -> None:
    """Check that every file the marker lists is there with its size (and hash); raise naming the first bad file.

    With ``parts`` > 1 only every parts-th file from ``part`` is hashed (ranks split the reading).
    In a bucket: sizes and ETags from one listing (hashes only with :data:`REHASH_ENV`).
    """
    if isinstance(directory, storage.ObjectPath):
        _bucket_verify(directory, marker, hashes=hashes, part=part, parts=parts)
        return
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
    directory: Path,
) -> tuple[Callable[[str], int | None], Callable[[str, int], str]]:
    """(size of a file by name or None, its sha256) in ``directory``."""
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
        return _bucket_prune(root, keep, uid=uid)
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


# --- a bucket: attempts and one conditional marker per step (no rename on an object store) ----


def _bucket_new_attempt(root: storage.ObjectPath, step: int) -> storage.ObjectPath:
    """A fresh attempt prefix for a save of ``step``; refused when the step is already published."""
    prefix = root / step_dir_name(step)
    if (prefix / MARKER).is_file():
        raise CheckpointError(
            f"{prefix}: already published; refusing to overwrite a published checkpoint"
        )
    return prefix / f"a-{uuid.uuid4().hex[:16]}"


def approved(directory: Location) -> Location:
    """A bucket's step prefix as the attempt its marker approves; anything else itself."""
    if isinstance(directory, storage.ObjectPath) and STEP_DIR.match(directory.name):
        step = int(directory.name.removeprefix("step-"))
        found = _bucket_published(directory.with_name(""), {step: True})
        return found[0].path
    return directory


def _bucket_marker(directory: storage.ObjectPath) -> storage.ObjectPath:
    """The marker of ``directory``: its own for a step prefix, its step prefix's for an attempt."""
    return directory / MARKER if STEP_DIR.match(directory.name) else directory.with_name(MARKER)


def _bucket_check_attempt(directory: storage.ObjectPath, path: Location, marker: Marker) -> None:
    """An attempt is loaded only when its step's marker approves it (and says its step)."""
    if STEP_DIR.match(directory.name):
        return
    approved = marker.extra.get(ATTEMPT_KEY)
    if approved != directory.name:
        raise CheckpointError(
            f"{path}: approves attempt {approved!r}, not {directory.name!r}; load "
            f"{directory.with_name(str(approved))} (or the step prefix) instead"
        )
    step_name = directory.url.rsplit("/", 2)[-2]
    if step_name != step_dir_name(marker.step):
        raise CheckpointError(f"{path}: says step {marker.step} but the prefix is {step_name}")


def _bucket_digest(url: str, size: int) -> dict[str, Any]:
    """Size and sha256 of one object, read in :data:`HASH_CHUNK` ranges, :data:`HASH_BATCH` at a time."""
    hasher = hashlib.sha256()
    ranges = [(url, start, min(size, start + HASH_CHUNK)) for start in range(0, size, HASH_CHUNK)]
    for first in range(0, len(ranges), HASH_BATCH):
        for data in storage.read_ranges(ranges[first : first + HASH_BATCH]):
            hasher.update(data)
    return {"bytes": size, "sha256": hasher.hexdigest()}


def data_listing(directory: storage.ObjectPath) -> dict[str, dict[str, Any]]:
    """The data objects of an attempt (one listing): relative name -> {size, etag, modified}.

    Rank 0 may list once and hand the names to every rank's :func:`describe_files` (``names``).
    """
    return {n: f for n, f in storage.listing(directory.url).items() if n != MARKER}


def _bucket_describe_files(
    directory: storage.ObjectPath, *, part: int = 0, parts: int = 1, names: list[str] | None = None
) -> dict[str, dict[str, Any]]:
    """Size, ETag and sha256 of the data objects under ``directory`` (every parts-th from ``part``)."""
    objects = data_listing(directory)
    chosen = sorted(objects) if names is None else sorted(names)
    described: dict[str, dict[str, Any]] = {}
    for i, name in enumerate(chosen):
        if i % parts != part:
            continue
        if name not in objects:
            raise CheckpointError(f"{directory.url}/{name}: listed by rank 0 but missing")
        described[name] = _bucket_describe(f"{directory.url}/{name}")
    return described


def _bucket_describe(url: str) -> dict[str, Any]:
    """Size, ETag and SHA-256 of one object: the one the store kept from the upload (one HEAD),
    else read back and hashed (stores that keep no checksums)."""
    found = storage.head(url)
    if found["sha256"]:
        return {
            "bytes": found["size"],
            "etag": found["etag"],
            "s3_sha256": found["sha256"],
            "s3_sha256_type": found["sha256_type"],
        }
    return {**_bucket_digest(url, found["size"]), "etag": found["etag"]}


def _bucket_compare(directory: storage.ObjectPath, files: dict[str, dict[str, Any]]) -> None:
    """Raise unless the objects under ``directory`` are exactly ``files``, each with its size and ETag."""
    objects = data_listing(directory)
    if DCP_METADATA not in objects:
        raise CheckpointError(f"{directory.url}/{DCP_METADATA}: missing (DCP's metadata)")
    extra, missing = sorted(set(objects) - set(files)), sorted(set(files) - set(objects))
    if extra or missing:
        raise CheckpointError(
            f"{directory.url}: objects {extra[:5]} are not in the marker's list and "
            f"{missing[:5]} of the list are missing"
        )
    for name, facts in sorted(files.items()):
        found = objects[name]
        if found["size"] != facts["bytes"]:
            raise CheckpointError(
                f"{directory.url}/{name}: {found['size']} bytes, the marker says {facts['bytes']} "
                "(truncated or overwritten)"
            )
        if facts.get("etag") and found["etag"] != facts["etag"]:
            raise CheckpointError(
                f"{directory.url}/{name}: ETag {found['etag']} differs from the marker's "
                f"{facts['etag']} (overwritten since it was described)"
            )


def _bucket_publish(attempt: storage.ObjectPath, marker: Marker) -> storage.ObjectPath:
    """Write the step's marker LAST and only if there is none (``If-None-Match``), naming ``attempt``."""
    if not ATTEMPT.match(attempt.name):
        raise CheckpointError(f"{attempt}: not an attempt prefix (from new_tmp_dir)")
    try:
        _bucket_compare(attempt, marker.files)
    except CheckpointError as err:
        raise CheckpointError(f"{err}; not publishing") from None
    approved = dataclasses.replace(marker, extra={**marker.extra, ATTEMPT_KEY: attempt.name})
    path = _bucket_marker(attempt)
    if not storage.write_bytes(path.url, approved.to_json().encode(), exclusive=True):
        raise CheckpointError(
            f"{path}: already published (by another attempt); refusing to overwrite a "
            "published checkpoint"
        )
    return attempt


def _bucket_verify(
    directory: storage.ObjectPath, marker: Marker, *, hashes: bool, part: int, parts: int
) -> None:
    """Sizes and ETags from one listing; sha256 re-read only with :data:`REHASH_ENV` or an ETag-less marker."""
    if not marker.files:
        raise CheckpointError(f"{_bucket_marker(directory)}: lists no data files")
    _bucket_compare(directory, marker.files)
    rehash = hashes and os.environ.get(REHASH_ENV) == "1"
    for index, (name, facts) in enumerate(sorted(marker.files.items())):
        if (rehash or not facts.get("etag")) and hashes and index % parts == part:
            found, expected = _bucket_rehash(f"{directory.url}/{name}", facts)
            if found != expected:
                raise CheckpointError(
                    f"{directory.url}/{name}: sha256 {found[:16]}... differs from the marker's "
                    f"{expected[:16]}... (corrupt)"
                )


def _bucket_rehash(url: str, facts: dict[str, Any]) -> tuple[str, str]:
    """(sha256 found, sha256 the marker has) of one object, re-read in full where that can tell.

    A composite checksum (a multipart upload's, of its parts' checksums) cannot be recomputed
    without the part boundaries: there the store's kept value is compared (the store checked
    every part's SHA-256 at upload).
    """
    if "sha256" in facts:
        return str(_bucket_digest(url, facts["bytes"])["sha256"]), str(facts["sha256"])
    expected = str(facts["s3_sha256"])
    if facts.get("s3_sha256_type") == "COMPOSITE":
        return str(storage.head(url)["sha256"]), expected
    digest = bytes.fromhex(_bucket_digest(url, facts["bytes"])["sha256"])
    return base64.b64encode(digest).decode(), expected


@dataclasses.dataclass(frozen=True)
class _Attempt:
    """One attempt prefix of a bucket's step and what it holds."""

    step: int
    """Its step."""
    prefix: str
    """``step-NNNNNNNN/a-...`` ('' name part for stray objects directly under the step prefix)."""
    objects: tuple[str, ...]
    """Its objects, relative to the job's directory."""
    newest: float
    """Newest LastModified of its objects (seconds since the epoch)."""


def _bucket_steps(root: storage.ObjectPath) -> tuple[dict[int, bool], list[_Attempt]]:
    """({step: has a marker}, every attempt) of ``root`` in one listing; foreign objects refused."""
    objects = storage.listing(root.url)
    steps: dict[int, bool] = {}
    grouped: dict[tuple[int, str], list[tuple[str, float]]] = {}
    for name, facts in objects.items():
        top, _, rest = name.partition("/")
        match = STEP_DIR.match(top)
        if match:
            step = int(match.group(1))
            steps[step] = steps.get(step, False) or rest == MARKER
            if rest != MARKER:
                attempt = rest.partition("/")[0] if "/" in rest else ""
                grouped.setdefault((step, f"{top}/{attempt}"), []).append((name, facts["modified"]))
        elif top not in IGNORED and not top.startswith(storage.PROBE_PREFIX):
            raise CheckpointError(
                f"{root.url}/{name}: not a meshtrain checkpoint (expected only step-NNNNNNNN/ "
                f"prefixes in {root.url}); point spec.checkpoint.path at a prefix of its own"
            )
    attempts = [
        _Attempt(step, prefix, tuple(n for n, _ in found), max(m for _, m in found))
        for (step, prefix), found in sorted(grouped.items())
    ]
    return steps, attempts


def _bucket_published(root: storage.ObjectPath, steps: dict[int, bool]) -> list[Published]:
    """Each marked step as the attempt its marker approves (the step prefix when the marker is unreadable)."""
    published = []
    for step, marked in sorted(steps.items()):
        if not marked:
            continue
        prefix = root / step_dir_name(step)
        try:
            raw = json.loads(
                storage.read_small(f"{prefix}/{MARKER}", limits.MAX_CHECKPOINT_MARKER_BYTES)
            )
            attempt = raw.get("extra", {}).get(ATTEMPT_KEY)
        except (OSError, ValueError, AttributeError):
            attempt = None
        ok = isinstance(attempt, str) and ATTEMPT.match(attempt)
        published.append(Published(step=step, path=prefix / str(attempt) if ok else prefix))
    return published


def _bucket_scan(root: storage.ObjectPath) -> list[Published]:
    """Published (marked) checkpoints under ``root``, oldest first; unmarked attempts are saves in progress."""
    steps, _ = _bucket_steps(root)
    return _bucket_published(root, steps)


def _bucket_prune(root: storage.ObjectPath, keep: int, *, uid: str = "") -> list[Location]:
    """Delete all but the newest ``keep`` checkpoints of ``uid`` (the last good one kept), marker first.

    Of another attempt (a save in progress, a loser, a crashed save) nothing is deleted until
    its newest object is :data:`STALE_SECONDS` old: it may be a live writer's.  Checkpoints
    whose marker names another job UID (inherited) are neither counted nor deleted.
    """
    steps, attempts = _bucket_steps(root)
    published = _bucket_published(root, steps)
    own = [p for p in published if not _foreign_uid(p, uid)]
    good = last_good(own)
    doomed = [p for p in own[: max(0, len(own) - keep)] if p != good]
    storage.remove([f"{root.url}/{step_dir_name(old.step)}/{MARKER}" for old in doomed])
    approved = {str(p.path) for p in published}
    doomed_paths = {str(old.path) for old in doomed}
    now = time.time()
    removed: list[Location] = []
    for attempt in attempts:
        prefix = root / attempt.prefix.rstrip("/")
        mine = prefix.url in approved
        gone = prefix.url in doomed_paths
        if gone or (not mine and now - attempt.newest > STALE_SECONDS):
            storage.remove([f"{root.url}/{name}" for name in attempt.objects])
            removed.append(prefix)
    return removed
