"""Rank 0's live goodput account (:class:`Tracker`) and its summary on disk.

One tracker per worker process: it reads the log directory once when the process starts, then
takes each step and recovery as they come (a supervised worker keeps it across its generations).
A process start does not replay the whole history: when a checkpoint is published the tracker
writes ``goodput-summary.json`` next to ``steps.jsonl`` (atomically: a temporary file renamed),
the account with the runs up to that checkpoint folded into one entry and the byte offsets of the
two logs it covers; a new process reads the summary and only what the logs gained since, at most
:data:`START_TAIL_BYTES` of ``steps.jsonl`` (its end: steps past a longer gap are not counted).
Without a usable summary it reads the same bounded tail of the whole log.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from meshtrain.trainer.telemetry import goodput, steplog

SUMMARY = "goodput-summary.json"
"""The summary's file name, next to ``steps.jsonl``."""

MAX_SUMMARY_BYTES = 16 * 2**20
"""Largest summary read (a longer one is ignored: the logs are read instead)."""

START_TAIL_BYTES = 64 * 2**20
"""Most bytes of ``steps.jsonl`` a process start reads (past the summary's offset, its end):
about 50,000 steps of a large world's records, a few seconds of parsing."""

VERSION = 1
"""The summary's format."""


def _key(record: goodput.Recovery) -> tuple[float, int | None]:
    """What tells a recovery record from another (one failure, one restore)."""
    return record.failed_at, record.resumed_step


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def read_summary(log_dir: Path) -> dict[str, Any] | None:
    """The summary's document when it is one and the logs still hold what it covers, else None."""
    try:
        with (log_dir / SUMMARY).open("rb") as handle:
            raw = handle.read(MAX_SUMMARY_BYTES + 1)
        document = json.loads(raw) if len(raw) <= MAX_SUMMARY_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict) or document.get("version") != VERSION:
        return None
    # a log shorter than its offset was replaced (a new run): the summary is of another history
    for key, path in (("stepsOffset", steplog.FILENAME), ("recoveriesOffset", goodput.RECOVERIES)):
        offset = document.get(key)
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            return None
        if offset > _size(log_dir / path):
            return None
    return document


class Tracker:
    """Rank 0's live account: the log directory's history, then each step and new recovery record.

    Its session hands it each in-place recovery at restore time (:meth:`recovered`), before the
    first step after it, whose record is written only then.
    """

    def __init__(self, log_dir: str | Path, environ: Mapping[str, str] | None = None) -> None:
        self._dir = Path(log_dir)
        self._path = self._dir / goodput.RECOVERIES
        started = goodput.job_started(os.environ if environ is None else environ)
        self._handed: dict[tuple[float, int | None], None] = {}  # recovered(), not yet read back
        self._found: list[goodput.Failure] = []  # recovered() since the last step
        self.accountant = self._start(started)
        """The account so far."""

    def _start(self, started: float | None) -> goodput.Accountant:
        """The account at this process's start: the summary, and what the logs gained since."""
        summary = read_summary(self._dir)
        steps_from = recoveries_from = 0
        accountant = None
        if summary is not None:
            try:
                accountant = goodput.Accountant.from_state(summary.get("account"), started)
                handed = summary.get("handed") or []
                for failed_at, resumed in handed[: goodput.MAX_FAILURES]:
                    self._handed[float(failed_at), None if resumed is None else int(resumed)] = None
                steps_from, recoveries_from = summary["stepsOffset"], summary["recoveriesOffset"]
            except (ValueError, TypeError):
                accountant, self._handed = None, {}
        if accountant is None:
            accountant, steps_from, recoveries_from = goodput.Accountant(started), 0, 0
        self._offset = _size(self._path)  # new records come after what is read here
        records = goodput.read_recoveries(self._dir, start=recoveries_from)
        goodput.feed(
            accountant,
            goodput.read_steps(self._dir, tail_bytes=START_TAIL_BYTES, start=steps_from),
            [r for r in records if not self._known(r)],
        )
        return accountant

    def recovered(self, record: goodput.Recovery) -> None:
        """A recovery of this process, known before its first step: counted now, and its line in
        ``recoveries.jsonl`` (written after that step) is not counted again."""
        self._handed[_key(record)] = None
        while len(self._handed) > goodput.MAX_FAILURES:  # never written (a full disk): forget
            del self._handed[next(iter(self._handed))]
        self._found.append(self.accountant.recovery(record))

    def _known(self, record: goodput.Recovery) -> bool:
        """Whether ``record`` was handed to :meth:`recovered` already (then forgotten there)."""
        if _key(record) not in self._handed:
            return False
        del self._handed[_key(record)]
        return True

    def _new_recoveries(self) -> list[goodput.Recovery]:
        """Recovery records appended since the last call (at most ``MAX_RECOVERY_BYTES``)."""
        try:
            with self._path.open("rb") as handle:
                if handle.seek(0, 2) < self._offset:  # truncated: read it again from the start
                    self._offset = 0
                handle.seek(self._offset)
                chunk = handle.read(goodput.MAX_RECOVERY_BYTES)
        except OSError:
            return []
        complete = chunk[: chunk.rfind(b"\n") + 1]
        if not complete and len(chunk) == goodput.MAX_RECOVERY_BYTES:  # one line longer than it
            complete = chunk
        self._offset += len(complete)
        found = (
            goodput.parse_recovery(goodput.json_line(line))
            for line in complete.splitlines()
            if len(line) <= goodput.MAX_RECOVERY_LINE
        )
        return [r for r in found if r is not None and not self._known(r)]

    def step(self, step: int, seconds: float, at: float) -> list[goodput.Failure]:
        """A step ended: the failures recorded or revealed since the last one."""
        found, self._found = self._found, []
        found += [self.accountant.recovery(r) for r in self._new_recoveries()]
        unrecorded = self.accountant.step(step, seconds, at)
        return found + ([unrecorded] if unrecorded is not None else [])

    def checkpoint_saved(self, step: int) -> None:
        """A checkpoint of ``step`` was published: fold the runs up to it and write the summary
        (atomically; a write error leaves the previous one, and the next process reads more)."""
        self.accountant.fold(step)
        self._new_recoveries_pending()
        document = {
            "version": VERSION,
            "stepsOffset": _size(self._dir / steplog.FILENAME),
            "recoveriesOffset": self._offset,
            "handed": [list(key) for key in self._handed],
            "account": self.accountant.state(),
        }
        target = self._dir / SUMMARY
        partial = target.with_name(f".{SUMMARY}.{os.getpid()}")
        with contextlib.suppress(OSError):
            partial.write_text(json.dumps(document), encoding="utf-8")
            os.replace(partial, target)

    def _new_recoveries_pending(self) -> None:
        """Take the records appended since the last step now, so the summary's offset covers them."""
        self._found += [self.accountant.recovery(r) for r in self._new_recoveries()]
