"""The step log: ``DIR/steps.jsonl``, one JSON object per optimizer step, written by rank 0.

The one writer and reader of that file.  Each line is flushed, so the launcher's progress bar and
anyone tailing the file see steps as they finish.

A run may take several attempts (a killed ``meshtrain run`` started again with its ``--log-dir``,
a gang the operator rebuilt).  Each attempt's steps are kept: ``meshtrain run`` moves the previous
attempt's ``steps.jsonl`` to ``attempts/steps-NNNN.jsonl`` (:func:`keep_previous`), so
``steps.jsonl`` is always the current attempt's; the pods append every attempt to one
``steps.jsonl``, where an attempt starts at a step that does not follow its predecessor's
(:func:`attempts` splits there: a resume recomputes the steps after its checkpoint).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from meshtrain.api import limits

FILENAME = "steps.jsonl"
ATTEMPTS_DIR = "attempts"
"""Where :func:`keep_previous` keeps the earlier attempts' step logs of a ``meshtrain run``."""
ATTEMPT_PATTERN = "steps-[0-9][0-9][0-9][0-9].jsonl"
"""Their names: ``steps-0001.jsonl`` for the first attempt, and so on."""


class StepLog:
    """Appends step records to ``directory/steps.jsonl``."""

    def __init__(self, directory: str | Path) -> None:
        self.path = Path(directory) / FILENAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        """Append one record and flush it."""
        self._file.write(json.dumps(record, sort_keys=True) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def read(path: str | Path) -> list[dict[str, Any]]:
    """All complete records of a step log (a partly written last line is skipped)."""
    records = []
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def _kept(log_dir: Path) -> list[Path]:
    """The earlier attempts' step logs, oldest first (at most MAX_COUNT of them)."""
    found = sorted((Path(log_dir) / ATTEMPTS_DIR).glob(ATTEMPT_PATTERN))
    return found[: limits.MAX_COUNT]


def keep_previous(log_dir: str | Path) -> Path | None:
    """Move the previous attempt's ``steps.jsonl`` of ``log_dir`` to ``attempts/steps-NNNN.jsonl``
    (the next number); where it went, or None when there was none (or it was empty)."""
    current = Path(log_dir) / FILENAME
    if not current.is_file() or current.stat().st_size == 0:
        current.unlink(missing_ok=True)
        return None
    kept = _kept(Path(log_dir))
    number = int(kept[-1].stem.rsplit("-", 1)[1]) + 1 if kept else 1
    if number > limits.MAX_COUNT:
        raise OSError(
            f"{Path(log_dir) / ATTEMPTS_DIR} holds {limits.MAX_COUNT} attempts already: "
            "use a new --log-dir for a new run"
        )
    target = Path(log_dir) / ATTEMPTS_DIR / f"steps-{number:04d}.jsonl"
    target.parent.mkdir(parents=True, exist_ok=True)
    os.replace(current, target)
    return target


def attempts(
    log_dir: str | Path, records: Callable[[Path], list[dict[str, Any]]] | None = None
) -> list[list[dict[str, Any]]]:
    """Every attempt's step records of ``log_dir``, oldest first: each kept file of
    :func:`keep_previous`, then ``steps.jsonl`` split where a step does not follow its predecessor
    (the pods' one file).  ``records``: reads one file (default :func:`read`)."""
    reader = records or read
    found: list[list[dict[str, Any]]] = [reader(path) for path in _kept(Path(log_dir))]
    current = Path(log_dir) / FILENAME
    found += _split(reader(current)) if current.is_file() else []
    return [attempt for attempt in found if attempt]


def _split(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``records`` cut before each record whose step is not above the previous record's."""
    out: list[list[dict[str, Any]]] = [[]]
    for record in records:
        if out[-1] and record["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(record)
    return out


class Tail:
    """Follows a growing step log: each call returns only the records appended since the last."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._offset = 0

    def new_records(self) -> list[dict[str, Any]]:
        """Complete records written since the previous call (none if the file does not exist yet)."""
        try:
            with self.path.open("rb") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
        except FileNotFoundError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]  # leave a partly written last line for next time
        self._offset += len(complete)
        return [json.loads(line) for line in complete.decode("utf-8").splitlines() if line.strip()]
