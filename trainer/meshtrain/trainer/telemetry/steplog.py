"""The step log: ``DIR/steps.jsonl``, one JSON object per optimizer step, written by rank 0.

The one writer and reader of that file.  Each line is flushed, so the launcher's progress bar and
anyone tailing the file see steps as they finish.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

FILENAME = "steps.jsonl"


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
