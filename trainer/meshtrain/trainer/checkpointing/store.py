"""The checkpoint directory on disk: naming, atomic publish, the COMPLETE marker, discovery, pruning.

Plain file-system logic, no process groups and no tensors.  A save is written into a ``.tmp-``
directory, which is renamed to ``step-NNNNNNNN`` once its ``COMPLETE`` marker is fsynced; rename
is atomic on POSIX, so a ``step-`` directory without a valid marker is not an interrupted save but
damage, and is reported as such (docs/checkpoints.md, "Writing a checkpoint").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

from meshtrain.api import job_dir

FORMAT = "meshtrain-checkpoint/1"
"""Value of the marker's ``format`` field; anything else is a foreign checkpoint."""
MARKER = "COMPLETE"
"""Name of the completion marker inside a published checkpoint."""
STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_PREFIX = ".tmp-"
GUARD_SKIPS = "loss_guard_consecutive_skips"
"""Marker ``extra`` key: updates the loss guard had skipped in a row when the checkpoint was taken (0: good)."""
IGNORED = {"lost+found", job_dir.LOG_SUBDIR, job_dir.OWNER_FILE}
"""Entries a checkpoint directory may carry that are not checkpoints and not a problem: ``lost+found``
of a fresh filesystem, ``logs``, where the operator's pods keep steps.jsonl and the rank traces
(``MESHTRAIN_LOG_DIR=<checkpoint.path>/<namespace>/<name>/logs``), and the job's owner record."""


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
    path: Path


def step_dir_name(step: int) -> str:
    """Directory name of the checkpoint of ``step``."""
    return f"step-{step:08d}"


def new_tmp_dir(root: Path, step: int) -> Path:
    """A fresh in-progress directory name for a save of ``step`` (not created)."""
    return root / f"{TMP_PREFIX}{step_dir_name(step)}-{uuid.uuid4().hex[:8]}"


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


def describe_files(directory: Path, *, part: int = 0, parts: int = 1) -> dict[str, dict[str, Any]]:
    """Size and sha256 of the data files of ``directory``; with ``parts`` > 1 only every parts-th from ``part``.

    The ranks of a job split the hashing this way (each takes its share, rank 0 merges).
    """
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


def publish(tmp: Path, marker: Marker) -> Path:
    """Write the marker into ``tmp`` and rename it to its final name; returns the published path.

    Called by one process after every rank's files are in ``tmp``.  Refuses
    to overwrite an existing checkpoint of the same step.
    """
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
    os.rename(tmp, final)
    _fsync_path(tmp.parent)
    return final


def read_marker(directory: Path) -> Marker:
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


def verify(directory: Path, marker: Marker, *, hashes: bool, part: int = 0, parts: int = 1) -> None:
    """Check that every file the marker lists is there with its size (and hash); raise naming the first bad file.

    With ``parts`` > 1 only every parts-th file from ``part`` is hashed (ranks split the reading).
    """
    for index, (name, facts) in enumerate(sorted(marker.files.items())):
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path}: listed in {directory / MARKER} but missing")
        size = path.stat().st_size
        if size != facts["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, the marker says {facts['bytes']} (truncated or overwritten)"
            )
        if hashes and index % parts == part:
            digest = file_digest(path)["sha256"]
            if digest != facts["sha256"]:
                raise CheckpointError(
                    f"{path}: sha256 {digest[:16]}... differs from the marker's "
                    f"{facts['sha256'][:16]}... (corrupt)"
                )
    if not marker.files:
        raise CheckpointError(f"{directory / MARKER}: lists no data files")


def scan(root: Path) -> list[Published]:
    """Published checkpoints under ``root``, oldest first; raises on anything foreign or damaged.

    In-progress (``.tmp-``) directories are skipped: they are interrupted
    saves.  Any other entry is not something meshtrain writes, and a
    checkpoint directory holding it is refused rather than trained into.
    """
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


def latest(root: Path, *, hashes: bool = True) -> tuple[Published, Marker] | None:
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


def prune(root: Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` published checkpoints and every leftover ``.tmp-`` directory of ``root``.

    ``root`` is the job's own directory, which its owner record gives to one writer at a time: nothing
    of another job is ever looked at (:mod:`meshtrain.api.job_dir`).

    The last good checkpoint (:func:`last_good`) is kept even when it is older
    than ``keep`` others: those may all have been taken while the loss guard
    skipped updates, and if it then stops the job, the last good one is the
    one to go back to.
    """
    removed = []
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name.startswith(TMP_PREFIX) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    published = scan(root)
    good = last_good(published)
    for old in published[: max(0, len(published) - keep)]:
        if old == good:
            continue
        # Rename first so a crash halfway through deleting leaves a .tmp- directory, not a damaged step-.
        doomed = root / f"{TMP_PREFIX}pruned-{old.path.name}-{uuid.uuid4().hex[:8]}"
        os.rename(old.path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(old.path)
    return removed
