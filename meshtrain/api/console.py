"""Progress on stderr while a user waits: a tqdm bar on a terminal, else one plain line per phase.

Every command that makes a user wait (``meshtrain run`` while its ranks start and train,
``plan --calibrate``, ``export``, ``data prepare``, the sandbox's image builds) shows a
:class:`Phase`.  On a terminal it is a tqdm bar; when stderr is a file or a pipe (CI, a pod's log)
a phase writes nothing while it runs and one line when it ends (``desc: 8 of 8 ranks ready
(41.2 s)``), so logs stay readable.  ``MESHTRAIN_PROGRESS=bar`` or ``plain`` forces either
(tests, and a user who pipes through ``tee`` yet wants the bar).  Results go to stdout, never here.
"""

from __future__ import annotations

import os
import sys
import time
from types import TracebackType
from typing import IO, Any

import tqdm

FORCE_ENV = "MESHTRAIN_PROGRESS"
"""``bar`` or ``plain`` overrides the terminal test (anything else: ask the stream)."""


def on_terminal(stream: IO[str] | None = None) -> bool:
    """Whether progress on ``stream`` (default stderr) is drawn as a bar: forced, or a terminal that
    has a width.  A 0x0 pseudo-terminal (``script``, ``docker exec -t`` before its first resize,
    some CI runners) is no terminal here: tqdm would draw nothing at all on it."""
    forced = os.environ.get(FORCE_ENV, "")
    if forced in ("bar", "plain"):
        return forced == "bar"
    target = stream if stream is not None else sys.stderr
    isatty = getattr(target, "isatty", None)
    return bool(isatty and isatty()) and _columns(target) > 0


def _columns(stream: IO[str]) -> int:
    """The terminal's width in columns, 0 where it is unknown."""
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no descriptor, closed, or not a terminal
        return 0


def _amount(n: float, unit: str, scaled: bool) -> str:
    if scaled:
        return str(tqdm.tqdm.format_sizeof(n, unit, 1024))
    return f"{n:,.0f}"


class Phase:
    """One wait a user sees: a tqdm bar on a terminal, else one plain line when it ends.

    ``total`` None counts without an end (a spinner with elapsed time); ``unit`` names what is
    counted (``ranks ready``, ``B``, ``documents``); ``scaled`` writes byte counts as KB/MB;
    ``disable`` shows nothing (a library call that asked for no progress).
    """

    def __init__(
        self,
        desc: str,
        *,
        total: float | None = None,
        unit: str = "it",
        scaled: bool = False,
        stream: IO[str] | None = None,
        disable: bool = False,
    ) -> None:
        self.desc, self.total, self.unit, self.scaled = desc, total, unit, scaled
        self.n: float = 0
        self.started = time.monotonic()
        self._stream = stream if stream is not None else sys.stderr
        self._status = ""
        self._closed = disable  # a disabled phase shows nothing, not even its line
        self._bar: Any = None
        if not disable and on_terminal(self._stream):
            counted = "{n_fmt} of {total_fmt} " if total is not None and not scaled else ""
            self._bar = tqdm.tqdm(
                total=total,
                desc=desc,
                unit=unit if scaled or total is None else "",
                unit_scale=scaled,
                unit_divisor=1024,
                file=self._stream,
                bar_format=(
                    "{desc}: " + counted + unit + " |{bar}| [{elapsed}<{remaining}]{postfix}"
                    if counted
                    else None
                ),
            )

    def expect(self, total: float) -> None:
        """The count the phase ends at, once known (an export knows its bytes after planning shards)."""
        self.total = total
        if self._bar is not None:
            self._bar.total = total
            self._bar.refresh()

    def update(self, n: float = 1) -> None:
        """Count ``n`` more."""
        self.to(self.n + n)

    def to(self, n: float) -> None:
        """Set the count to ``n`` (a resumed run starts past 0)."""
        if self._bar is not None and n != self.n:
            self._bar.update(n - self.n)
        self.n = n

    def status(self, text: str) -> None:
        """What the phase is doing now (a bar's postfix; the plain line keeps the last one)."""
        self._status = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=True)

    def counted(self) -> str:
        """``3 of 8 ranks ready``, ``1.2MB`` or ``40 documents``: the count as the plain line writes it."""
        if self.total is not None:
            return (
                f"{_amount(self.n, self.unit, self.scaled)} of "
                f"{_amount(self.total, self.unit, self.scaled)}"
                + ("" if self.scaled else f" {self.unit}")
            )
        return _amount(self.n, self.unit, self.scaled) + ("" if self.scaled else f" {self.unit}")

    def close(self, outcome: str = "") -> None:
        """End the phase: the bar closes; without one, the phase's single line (count, status, time)."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            self._bar.close()
            if outcome:
                print(f"{self.desc}: {outcome}", file=self._stream, flush=True)
            return
        parts = [p for p in (self.counted() if self.n or self.total else "", self._status) if p]
        parts.append(outcome or ("" if parts else "done"))
        seconds = time.monotonic() - self.started
        shown = ", ".join(p for p in parts if p)
        print(f"{self.desc}: {shown} ({seconds:.1f} s)", file=self._stream, flush=True)

    def __enter__(self) -> Phase:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close("" if kind is None else "stopped")
